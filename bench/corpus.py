"""A deterministic corpus of multi-turn chats in the Chat Completions shape.

``chats(count, seed)`` returns the same chats for the same arguments, on any
machine, with nothing downloaded. Each chat has 2 to 12 messages after an
optional system prompt; message lengths are spread log-uniformly from 10 to
2,000 characters, so short questions and pasted documents both occur. Some
messages carry code, some non-Latin scripts and emoji, a few a typed
special-token spelling; a quarter of the chats declare tools, and in those the
assistant calls tools and the results come back as ``tool`` messages.

Assistant messages that call tools carry a string ``content`` (sometimes
empty), never ``null``: the default model's own chat template concatenates
``content`` and would fail on ``null``, and the baseline must render the same
messages.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from typing import Any

MIN_TURNS, MAX_TURNS = 2, 12
MIN_CHARS, MAX_CHARS = 10, 2000
MAX_CHAT_CHARS = 16_000  # keeps every chat well inside the default model's 8,192 tokens
SYSTEM_SHARE = 0.5
TOOLS_SHARE = 0.25

_WORD_TEXT = (
    "the of and to in is that it for on with as was by be this are from at or have an "
    "not which but all were when we there can more if will one about would their what "
    "so up out them some into time has two like other could then these its our only "
    "model request server token cache latency stream batch prompt answer question data "
    "function result error value list table query user system memory thread queue"
)
WORDS = tuple(_WORD_TEXT.split())
UNICODE_WORDS = (
    "café",
    "naïve",
    "Zürich",
    "façade",
    "日本語",
    "数据库",
    "東京",
    "Привет",
    "мир",
    "γειά",
    "σου",
    "مرحبا",
    "שלום",
    "한국어",
    "ñandú",
    "→",
    "✓",
    "€42",
    "😀",
    "🚀",
    "👍🏽",
)
SPECIAL_SPELLINGS = ("<|im_end|>", "<|im_start|>assistant", "<|endoftext|>")
CODE_SNIPPETS = (
    "def fibonacci(n: int) -> int:\n    a, b = 0, 1\n    for _ in range(n):\n"
    "        a, b = b, a + b\n    return a\n",
    "SELECT u.id, u.name, COUNT(o.id) AS orders\nFROM users u\n"
    "LEFT JOIN orders o ON o.user_id = u.id\nWHERE u.created_at > '2024-01-01'\n"
    "GROUP BY u.id, u.name\nORDER BY orders DESC\nLIMIT 20;\n",
    "const debounce = (fn, ms = 300) => {\n  let timer;\n  return (...args) => {\n"
    "    clearTimeout(timer);\n    timer = setTimeout(() => fn.apply(this, args), ms);\n"
    "  };\n};\n",
    "fn main() {\n    let v: Vec<u32> = (1..=10).map(|x| x * x).collect();\n"
    '    println!("{:?} sum={}", v, v.iter().sum::<u32>());\n}\n',
    "for f in *.log; do\n  grep -E 'ERROR|WARN' \"$f\" | awk '{print $1, $5}' >> out.txt\ndone\n",
    '{"name": "sluice", "version": "0.1.0", "dependencies": {"fastapi": ">=0.110"}}\n',
)
SYSTEM_PROMPTS = (
    "You are a concise assistant. Answer in at most three sentences.",
    "You are a senior software engineer reviewing code. Point out bugs first, style last.",
    "Tu es un assistant qui répond toujours en français, poliment et précisément.",
    "You are a helpful assistant. Today is 2025-03-14. Use tools when they help.",
)

TOOLS: tuple[dict[str, Any], ...] = (
    {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Zürich"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
    {
        "name": "search_docs",
        "description": "Full-text search over the product documentation.",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "limit": {"type": "integer", "minimum": 1, "maximum": 50},
                "sections": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["query"],
        },
    },
    {
        "name": "run_sql",
        "description": "Run a read-only SQL query against the analytics warehouse.",
        "parameters": {
            "type": "object",
            "properties": {"sql": {"type": "string"}, "timeout_s": {"type": "number"}},
            "required": ["sql"],
        },
    },
    {
        "name": "create_ticket",
        "description": "Open a support ticket.",
        "parameters": {
            "type": "object",
            "properties": {
                "title": {"type": "string"},
                "priority": {"type": "string", "enum": ["low", "normal", "high"]},
                "labels": {"type": "array", "items": {"type": "string"}},
                "assignee": {
                    "type": "object",
                    "properties": {"id": {"type": "integer"}, "team": {"type": "string"}},
                },
            },
            "required": ["title"],
        },
    },
    {
        "name": "convert_currency",
        "description": "Convert an amount between currencies at today's rate.",
        "parameters": {
            "type": "object",
            "properties": {
                "amount": {"type": "number"},
                "from": {"type": "string"},
                "to": {"type": "string"},
            },
            "required": ["amount", "from", "to"],
        },
    },
    {"name": "get_time", "description": "The current UTC time.", "parameters": {}},
)


@dataclass(slots=True)
class Chat:
    """One request's conversation: Chat Completions messages and tool definitions."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=list)

    def body(self, model: str = "default") -> dict[str, Any]:
        """The Chat Completions request body for this chat."""
        body: dict[str, Any] = {"model": model, "messages": self.messages}
        if self.tools:
            body["tools"] = self.tools
        return body


def chats(count: int, seed: int = 0) -> list[Chat]:
    """``count`` chats, the same ones for the same ``seed``."""
    rng = random.Random(seed)
    return [_chat(rng) for _ in range(count)]


def _chat(rng: random.Random) -> Chat:
    tools: list[dict[str, Any]] = []
    if rng.random() < TOOLS_SHARE:
        tools = [{"type": "function", "function": t} for t in rng.sample(TOOLS, rng.randint(1, 4))]
    turns = rng.randint(MIN_TURNS, MAX_TURNS)
    budget = _Budget(MAX_CHAT_CHARS)
    system: list[dict[str, Any]] = []
    if rng.random() < SYSTEM_SHARE:
        system.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    dialogue = _dialogue(rng, turns + 6, tools, budget)
    kept = _cut(dialogue, turns - len(system), least=MIN_TURNS - len(system))
    return Chat(system + dialogue[:kept], tools)


def _cut(dialogue: list[dict[str, Any]], wanted: int, least: int) -> int:
    """How many messages to keep: about ``wanted``, ending where the model answers next.

    A request ends with a user question or with tool results: the longest such
    prefix of ``least`` to ``wanted`` messages is kept, or else the shortest
    one longer than ``least``.
    """
    ends = [i + 1 for i, message in enumerate(dialogue) if message["role"] in ("user", "tool")]
    fitting = [end for end in ends if least <= end <= wanted]
    return fitting[-1] if fitting else next(end for end in ends if end >= least)


def _dialogue(
    rng: random.Random, turns: int, tools: list[dict[str, Any]], budget: _Budget
) -> list[dict[str, Any]]:
    """At least ``turns`` messages of questions and answers, calling tools when there are any."""
    messages: list[dict[str, Any]] = []
    while len(messages) < turns:
        messages.append({"role": "user", "content": _text(rng, budget)})
        if tools and rng.random() < 0.6:
            picked = rng.choices(tools, k=rng.randint(1, 2))
            calls = [_call(rng, tool["function"]) for tool in picked]
            preface = rng.choice(("", "", "Let me check that.", "I'll look it up."))
            messages.append({"role": "assistant", "content": preface, "tool_calls": calls})
            messages.extend(
                {"role": "tool", "tool_call_id": call["id"], "content": _tool_result(rng, budget)}
                for call in calls
            )
        messages.append({"role": "assistant", "content": _text(rng, budget)})
    return messages


def _call(rng: random.Random, function: dict[str, Any]) -> dict[str, Any]:
    properties = function["parameters"].get("properties", {})
    arguments = {name: _argument(rng, schema) for name, schema in properties.items()}
    return {
        "id": f"call_{rng.getrandbits(64):016x}",
        "type": "function",
        "function": {"name": function["name"], "arguments": json.dumps(arguments)},
    }


def _argument(rng: random.Random, schema: dict[str, Any]) -> Any:
    kind = schema.get("type")
    if "enum" in schema:
        return rng.choice(schema["enum"])
    if kind == "integer":
        return rng.randint(1, 50)
    if kind == "number":
        return round(rng.uniform(0, 1000), 2)
    if kind == "array":
        return [rng.choice(WORDS) for _ in range(rng.randint(1, 3))]
    if kind == "object":
        return {"id": rng.randint(1, 9999), "team": rng.choice(WORDS)}
    return " ".join(rng.choice(WORDS + UNICODE_WORDS[:4]) for _ in range(rng.randint(1, 6)))


def _tool_result(rng: random.Random, budget: _Budget) -> str:
    if rng.random() < 0.5:
        rows = [
            {"id": rng.randint(1, 10**6), "name": rng.choice(WORDS), "score": rng.random()}
            for _ in range(rng.randint(1, 12))
        ]
        return budget.take(json.dumps({"ok": True, "rows": rows}, ensure_ascii=False))
    return _text(rng, budget)


class _Budget:
    """Characters left for the rest of one chat."""

    def __init__(self, chars: int) -> None:
        self.left = chars

    def take(self, text: str) -> str:
        text = text[: max(MIN_CHARS, self.left)]
        self.left -= len(text)
        return text


def _text(rng: random.Random, budget: _Budget) -> str:
    """Prose of a log-uniform length; sometimes with code, other scripts or a special spelling."""
    length = int(math.exp(rng.uniform(math.log(MIN_CHARS), math.log(MAX_CHARS))))
    unicode_share = 0.25 if rng.random() < 0.1 else 0.02
    code = rng.random() < 0.2
    parts: list[str] = []
    size = 0
    while size < length:
        if code and rng.random() < 0.15:
            piece = f"\n```\n{rng.choice(CODE_SNIPPETS)}```\n"
        elif rng.random() < 0.003:
            piece = " " + rng.choice(SPECIAL_SPELLINGS)
        else:
            piece = _sentence(rng, unicode_share)
        parts.append(piece)
        size += len(piece)
    return budget.take("".join(parts)[:length].strip() or "ok")


def _sentence(rng: random.Random, unicode_share: float) -> str:
    words = [
        rng.choice(UNICODE_WORDS) if rng.random() < unicode_share else rng.choice(WORDS)
        for _ in range(rng.randint(4, 18))
    ]
    words[0] = words[0].capitalize()
    ending = rng.choice((".", ".", ".", "?", "!", ",", ": 3.14159", " (see §4.2)."))
    return " " + " ".join(words) + ending


__all__ = ["Chat", "chats"]
