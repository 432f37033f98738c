"""A field we accept is a field we honour: every request field of every protocol, probed.

Each field of OpenAI Chat Completions, Completions and Responses and Anthropic Messages
(as the official SDKs name them, read at run time), and each of vLLM's Chat
Completions extensions, has one or more entries in the tables below, and each
entry shows one of three things against the real server:

- ``Case``: sending the field changes the response relative to a baseline
  request without it (greedy, a few tokens), in the way the field promises.
  With ``may_refuse`` a 400 that names the field and says it is not supported
  passes too: the field is one we could implement or refuse, and either keeps
  the rule.
- ``Refused``: the field cannot be honoured here, so only that 400 passes.
- ``Allowed``: the field's effect cannot show in generated output (it changes
  the transport, is echoed, or asks for what the server always does); the
  entry says why, and checks the echo or the shape where one exists.

A field the SDK gains later fails ``test_every_sdk_parameter_is_classified``
until it gets an entry.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from tokenizers import Tokenizer

from shared.registry import default_registry
from shared.tokenizer_loader import load_tokenizer

pytestmark = pytest.mark.slow

TRANSPORT_PARAMETERS = {"self", "extra_headers", "extra_query", "extra_body", "timeout"}
CONCURRENCY = 8  # twice the server fixture's --max-num-seqs: its batch stays full
TOKENS = 4  # a baseline's answer: enough for every field below to show

SEA = "Write one sentence about the sea."
MOON = "Write one sentence about the moon."
REPEAT = "Repeat after me: la la la la la la la la"  # penalties show within 12 tokens
SHORT = "Answer with one word: is water wet?"  # ends (EOS) after 6 tokens
TIME = "What time is it?"
PREFILL = "Waves crash"
RAW_SEA = "The sea is"
RAW_MOON = "The moon is"
RAW_REPEAT = "sea sea sea sea sea sea"
LOGPROBS_INCLUDE = "message.output_text.logprobs"
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}
TOOL_TOKENS = 28  # one call to ``now`` takes 23 tokens; without a stop, the answer goes on
FRUIT = ["apple", "banana"]
# About 3,500 tokens: more than the server fixture's 2,048-token context.
TOO_LONG = [{"role": "user", "content": f"{SEA} The sea is vast and deep. " * 8}] * 30

# vLLM's ChatCompletionRequest fields beyond OpenAI's (vllm/entrypoints/openai/
# chat_completion/protocol.py, 2026), plus the guided_* spellings older vLLM
# clients still send. No SDK lists them, so this list is the reference.
VLLM_CHAT_EXTENSIONS = (
    "thinking_token_budget",
    "include_reasoning",
    "use_beam_search",
    "top_k",
    "min_p",
    "repetition_penalty",
    "watermarking",
    "length_penalty",
    "stop_token_ids",
    "include_stop_str_in_output",
    "ignore_eos",
    "min_tokens",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "truncate_prompt_tokens",
    "truncation_side",
    "prompt_logprobs",
    "logprob_token_ids",
    "allowed_token_ids",
    "bad_words",
    "echo",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "documents",
    "chat_template",
    "chat_template_kwargs",
    "media_io_kwargs",
    "mm_processor_kwargs",
    "structured_outputs",
    "priority",
    "request_id",
    "session_id",
    "return_tokens_as_token_ids",
    "return_token_ids",
    "routed_experts_prompt_start",
    "return_token_offsets",
    "return_prompt_text",
    "return_mm_kwargs",
    "cache_salt",
    "kv_transfer_params",
    "ec_transfer_params",
    "vllm_xargs",
    "repetition_detection",
    "stream_interval",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


# --- the three routes: where to send, the baseline body, how to read a reply ---------------


NOISE = ("id", "call_id", "logprob")  # random ids; log-probabilities vary with the batch


def _comparable(value: Any) -> Any:
    """``value`` without what differs between two runs of one request."""
    if isinstance(value, dict):
        return {k: _comparable(v) for k, v in value.items() if k not in NOISE}
    if isinstance(value, list):
        return [_comparable(item) for item in value]
    return value


class ChatShape:
    path = "/v1/chat/completions"
    limit = "max_tokens"
    base = {"model": "default", "messages": user(SEA), limit: TOKENS, "temperature": 0}

    @staticmethod
    def text(body: Any) -> str:
        if isinstance(body, list):
            deltas = [chunk["choices"][0]["delta"] for chunk in body if chunk.get("choices")]
            return "".join(delta.get("content") or "" for delta in deltas)
        return body["choices"][0]["message"]["content"] or ""

    @staticmethod
    def calls(body: dict) -> list[dict]:
        return body["choices"][0]["message"].get("tool_calls") or []

    @staticmethod
    def finish(body: dict) -> str:
        return body["choices"][0]["finish_reason"]

    @staticmethod
    def output_tokens(body: dict) -> int:
        return body["usage"]["completion_tokens"]

    @staticmethod
    def cached_tokens(body: dict) -> int:
        return body["usage"]["prompt_tokens_details"]["cached_tokens"]

    @staticmethod
    def logprobs(body: dict) -> list[dict]:
        return (body["choices"][0].get("logprobs") or {}).get("content") or []

    @staticmethod
    def content(body: dict) -> Any:
        return _comparable({"choices": body["choices"], "tokens": ChatShape.output_tokens(body)})


class ResponsesShape:
    path = "/v1/responses"
    limit = "max_output_tokens"
    base = {"model": "default", "input": SEA, limit: TOKENS, "temperature": 0}

    @staticmethod
    def _parts(body: dict) -> list[dict]:
        messages = [item for item in body["output"] if item["type"] == "message"]
        return [part for item in messages for part in item["content"]]

    @staticmethod
    def text(body: Any) -> str:
        if isinstance(body, list):
            deltas = [e["delta"] for e in body if e.get("type") == "response.output_text.delta"]
            return "".join(deltas)
        return "".join(part.get("text", "") for part in ResponsesShape._parts(body))

    @staticmethod
    def calls(body: dict) -> list[dict]:
        return [item for item in body["output"] if item["type"] == "function_call"]

    @staticmethod
    def finish(body: dict) -> str:
        return body["status"]

    @staticmethod
    def output_tokens(body: dict) -> int:
        return body["usage"]["output_tokens"]

    @staticmethod
    def cached_tokens(body: dict) -> int:
        return body["usage"]["input_tokens_details"]["cached_tokens"]

    @staticmethod
    def logprobs(body: dict) -> list[dict]:
        return [entry for part in ResponsesShape._parts(body) for entry in part.get("logprobs", [])]

    @staticmethod
    def content(body: dict) -> Any:
        generated = {
            "output": body["output"],
            "status": body["status"],
            "incomplete": body["incomplete_details"],
            "tokens": ResponsesShape.output_tokens(body),
        }
        return _comparable(generated)


class MessagesShape:
    path = "/v1/messages"
    limit = "max_tokens"
    base = {"model": "default", "messages": user(SEA), limit: TOKENS, "temperature": 0}

    @staticmethod
    def text(body: Any) -> str:
        if isinstance(body, list):
            deltas = [e["delta"] for e in body if e.get("type") == "content_block_delta"]
            return "".join(delta.get("text", "") for delta in deltas)
        return "".join(block.get("text", "") for block in body["content"])

    @staticmethod
    def calls(body: dict) -> list[dict]:
        return [block for block in body["content"] if block["type"] == "tool_use"]

    @staticmethod
    def finish(body: dict) -> str:
        return body["stop_reason"]

    @staticmethod
    def output_tokens(body: dict) -> int:
        return body["usage"]["output_tokens"]

    @staticmethod
    def cached_tokens(body: dict) -> int:
        return body["usage"]["cache_read_input_tokens"]

    @staticmethod
    def logprobs(body: dict) -> list[dict]:
        return []

    @staticmethod
    def content(body: dict) -> Any:
        generated = {
            "content": body["content"],
            "stop_reason": body["stop_reason"],
            "stop_sequence": body["stop_sequence"],
            "tokens": MessagesShape.output_tokens(body),
        }
        return _comparable(generated)


class CompletionsShape(ChatShape):
    """Completions' usage is Chat Completions'; its text and logprobs are its own."""

    path = "/v1/completions"
    limit = "max_tokens"
    base = {"model": "default", "prompt": RAW_SEA, limit: TOKENS, "temperature": 0}

    @staticmethod
    def text(body: Any) -> str:
        chunks = body if isinstance(body, list) else [body]
        return "".join(c["text"] for chunk in chunks for c in chunk.get("choices", []))

    @staticmethod
    def calls(body: dict) -> list[dict]:
        return []

    @staticmethod
    def logprobs(body: dict) -> list[dict]:
        """The legacy object, one entry per token: token, logprob and the top map."""
        legacy = body["choices"][0].get("logprobs") or {}
        columns = zip(
            legacy.get("tokens", []),
            legacy.get("token_logprobs", []),
            legacy.get("top_logprobs", []),
            strict=True,
        )
        return [{"token": t, "logprob": lp, "top_logprobs": top} for t, lp, top in columns]

    @staticmethod
    def content(body: dict) -> Any:
        generated = {"choices": body["choices"], "tokens": CompletionsShape.output_tokens(body)}
        return _comparable(generated)

    @staticmethod
    def token_ids(text: str) -> list[int]:
        """A raw prompt's answer is plain text after plain text: its ids are its own encoding."""
        return _tokenizer().encode(text, add_special_tokens=False).ids


@functools.cache
def _tokenizer() -> Tokenizer:
    return load_tokenizer(default_registry().resolve("default").weights).tokenizer


SHAPES: dict[str, Any] = {
    "chat": ChatShape,
    "completions": CompletionsShape,
    "responses": ResponsesShape,
    "messages": MessagesShape,
}
SDK_CREATE = {
    "chat": ("openai.resources.chat.completions", "Completions"),
    "completions": ("openai.resources.completions", "Completions"),
    "responses": ("openai.resources.responses", "Responses"),
    "messages": ("anthropic.resources.messages", "Messages"),
}
ENDED_FOR_A_TOOL = {"tool_calls", "completed", "tool_use"}


@dataclass
class Reply:
    """One answer: its status and JSON body (for a stream, the list of event payloads)."""

    probe: Probe
    sent: dict[str, Any]
    status: int
    body: Any
    content_type: str

    @property
    def shape(self) -> Any:
        return SHAPES[self.probe.route]

    @property
    def text(self) -> str:
        return self.shape.text(self.body)

    @property
    def calls(self) -> list[dict]:
        return self.shape.calls(self.body)

    @property
    def finish(self) -> str:
        return self.shape.finish(self.body)

    @property
    def output_tokens(self) -> int:
        return self.shape.output_tokens(self.body)

    @property
    def cached_tokens(self) -> int:
        return self.shape.cached_tokens(self.body)

    @property
    def logprobs(self) -> list[dict]:
        return self.shape.logprobs(self.body)

    @property
    def content(self) -> Any:
        return self.body if isinstance(self.body, list) else self.shape.content(self.body)

    def names(self, name: str) -> bool:
        """Whether this is a 400 whose error names ``name``."""
        error = self.body.get("error") if isinstance(self.body, dict) else None
        return self.status == 400 and error is not None and name in json.dumps(error)

    def refuses(self, name: str) -> bool:
        """Whether this is a 400 that names ``name`` and says it is not supported."""
        return self.names(name) and "support" in json.dumps(self.body["error"]).lower()

    def again(self, max_tokens: int | None = None) -> Reply:
        """The same request sent afresh, with another token limit if given."""
        limit = {} if max_tokens is None else {self.shape.limit: max_tokens}
        return self.probe.send({**self.sent, **limit}, fresh=True)

    def token_ids(self) -> list[int]:
        return self.probe.token_ids(self.text)

    def summary(self) -> str:
        if self.status != 200:
            return f"{self.status} {json.dumps(self.body)[:160]}"
        if isinstance(self.body, list):
            return f"{len(self.body)} events, text {self.text!r}"
        calls = f", {len(self.calls)} tool calls" if self.calls else ""
        return f"{self.text!r} ({self.finish}, {self.output_tokens} tokens{calls})"


class Probe:
    """Sends the route's baseline body plus overrides; an identical body is sent once."""

    def __init__(self, http: httpx.Client, route: str) -> None:
        self.http = http
        self.route = route
        self.shape = SHAPES[route]
        self._replies: dict[str, Future[Reply]] = {}
        self._lock = threading.Lock()

    def send(self, overrides: dict[str, Any], *, fresh: bool = False) -> Reply:
        """The reply to the baseline body with ``overrides``, shared unless ``fresh``."""
        if fresh:
            return self._post(overrides)
        key = json.dumps(overrides, sort_keys=True)
        with self._lock:
            future = self._replies.get(key)
            owner = future is None
            if owner:
                future = self._replies[key] = Future()
        if owner:
            try:
                future.set_result(self._post(overrides))
            except BaseException as error:
                future.set_exception(error)
        return future.result()

    def _post(self, overrides: dict[str, Any]) -> Reply:
        body = {**self.shape.base, **overrides}
        if not body.get("stream"):
            response = self.http.post(self.shape.path, json=body)
            return Reply(self, overrides, response.status_code, response.json(), "")
        with self.http.stream("POST", self.shape.path, json=body) as response:
            kind = response.headers.get("content-type", "")
            if not kind.startswith("text/event-stream"):
                response.read()
                return Reply(self, overrides, response.status_code, response.json(), kind)
            lines = [line[len("data: ") :] for line in response.iter_lines()]
            events = [json.loads(data) for data in lines if data.startswith("{")]
            return Reply(self, overrides, response.status_code, events, kind)

    def token_ids(self, text: str) -> list[int]:
        """The token ids of ``text`` as an answer: the prompt with it, minus the prompt without."""
        if hasattr(self.shape, "token_ids"):
            return self.shape.token_ids(text)
        body = {"model": "default", "messages": user(SEA)}
        prompt = self.http.post("/v1/tokenize", json=body).json()["token_ids"]
        body["messages"] = [*user(SEA), {"role": "assistant", "content": text}]
        full = self.http.post("/v1/tokenize", json={**body, "continue_final_message": True})
        ids = full.json()["token_ids"]
        assert ids[: len(prompt)] == prompt, "the answer's tokens do not follow the prompt's"
        return ids[len(prompt) :]


# --- what an entry is ------------------------------------------------------------------------

Check = Callable[[Reply, Reply], bool]  # (reply, baseline) -> honoured?


def differs(reply: Reply, baseline: Reply) -> bool:
    return reply.content != baseline.content


@dataclass(frozen=True)
class Case:
    """``field: value`` sent on top of ``base`` (and ``extra``) must pass ``honoured``.

    The baseline is the route's body plus ``base``; ``extra`` is sent with the
    field only. A callable ``value`` is computed from the baseline reply.
    """

    field: str
    value: Any
    base: dict[str, Any] = field(default_factory=dict)
    honoured: Check = differs
    may_refuse: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    label: str = ""

    @property
    def name(self) -> str:
        return f"{self.field}[{self.label}]" if self.label else self.field

    def judge(self, probe: Probe) -> None:
        baseline = probe.send(self.base)
        value = self.value(baseline) if callable(self.value) else self.value
        reply = probe.send({**self.base, **self.extra, self.field: value})
        shown = f"{self.field}={json.dumps(value)}"
        if self.may_refuse and reply.refuses(self.field):
            return
        assert reply.status == 200, f"{shown} answered {reply.summary()}"
        assert self.honoured(reply, baseline), (
            f"{shown} was accepted but not honoured: {reply.summary()}, "
            f"without it {baseline.summary()}"
        )


@dataclass(frozen=True)
class Refused:
    """A field the server cannot honour: only a 400 that says it is not supported passes."""

    field: str
    value: Any
    label: str = ""

    @property
    def name(self) -> str:
        return f"{self.field}[{self.label}]" if self.label else self.field

    def judge(self, probe: Probe) -> None:
        reply = probe.send({probe.shape.limit: 1, self.field: self.value})  # any answer will do
        assert reply.refuses(self.field), (
            f"{self.field}={json.dumps(self.value)} was accepted, not refused: {reply.summary()}"
        )


@dataclass(frozen=True)
class Allowed:
    """A field whose effect cannot show in generated output; ``reason`` says how it is honoured."""

    field: str
    reason: str
    check: Callable[[Probe], None] | None = None
    label: str = ""

    @property
    def name(self) -> str:
        return f"{self.field}[{self.label}]" if self.label else self.field

    def judge(self, probe: Probe) -> None:
        if self.check is not None:
            self.check(probe)


Entry = Case | Refused | Allowed


# --- checks ----------------------------------------------------------------------------------


def tokens(count: int) -> Check:
    return lambda reply, _: reply.output_tokens == count


def shorter(reply: Reply, baseline: Reply) -> bool:
    return baseline.text.startswith(reply.text) and len(reply.text) < len(baseline.text)


def has_logprobs(reply: Reply, _: Reply) -> bool:
    return len(reply.logprobs) == reply.output_tokens > 0


def top_logprobs(count: int) -> Check:
    def check(reply: Reply, _: Reply) -> bool:
        entries = reply.logprobs
        return bool(entries) and all(len(entry["top_logprobs"]) == count for entry in entries)

    return check


def is_json(reply: Reply, _: Reply) -> bool:
    try:
        return isinstance(json.loads(reply.text), dict)
    except ValueError:
        return False


def one_of(choices: Iterable[str]) -> Check:
    return lambda reply, _: reply.text in choices


def calls_a_tool(reply: Reply, baseline: Reply) -> bool:
    return bool(reply.calls) and not baseline.calls


def one_call_then_ends(reply: Reply, baseline: Reply) -> bool:
    """One tool call and the end of the answer, where the baseline went on after it."""
    ended = len(reply.calls) == 1 and reply.finish in ENDED_FOR_A_TOOL
    return ended and reply.content != baseline.content


def greedy(reply: Reply, baseline: Reply) -> bool:
    """Sampled (``extra`` raises the temperature) yet the same as the greedy baseline."""
    return reply.content == baseline.content


def sampled(reply: Reply, baseline: Reply) -> bool:
    """Unlike the greedy baseline; a second draw settles the rare sample that matches it."""
    return reply.content != baseline.content or reply.again().content != baseline.content


def fewer_events(reply: Reply, baseline: Reply) -> bool:
    return reply.text == baseline.text and len(reply.body) < len(baseline.body)


def adds_usage_chunk(reply: Reply, baseline: Reply) -> bool:
    def usage(events: list[dict]) -> bool:
        return any(event.get("usage") for event in events)

    return usage(reply.body) and not usage(baseline.body)


def obfuscated(reply: Reply, _: Reply) -> bool:
    """Every event that carries text also carries padding."""
    texts = [event for event in reply.body if reply.shape.text([event])]
    return bool(texts) and all("obfuscation" in event for event in texts)


def never_cached(reply: Reply, baseline: Reply) -> bool:
    """The prompt, which the baseline's repeat reads from the cache, is never read from it."""
    return baseline.again(1).cached_tokens > 0 and reply.again(1).cached_tokens == 0


def salted(reply: Reply, baseline: Reply) -> bool:
    """With a salt never sent before, the prompt the baseline's repeat cached is not found."""
    warm = baseline.again(1).cached_tokens > 0
    fresh = reply.probe.send({**reply.sent, "cache_salt": "another-salt"}, fresh=True)
    return warm and fresh.cached_tokens == 0


def prediction_accepted(reply: Reply, _: Reply) -> bool:
    """The answer was the predicted text, so usage counts predicted tokens as accepted."""
    details = reply.body["usage"].get("completion_tokens_details") or {}
    return details.get("accepted_prediction_tokens", 0) > 0


def stored(reply: Reply, _: Reply) -> bool:
    """The completion can be read back by its id."""
    return reply.probe.http.get(f"{reply.shape.path}/{reply.body['id']}").status_code == 200


def has_moderation(reply: Reply, _: Reply) -> bool:
    return reply.body.get("moderation") is not None


def echoes(name: str) -> Check:
    """The response body reports ``name`` as sent."""
    return lambda reply, _: reply.body.get(name) == reply.sent[name]


def reports_usage(name: str) -> Check:
    return lambda reply, _: reply.body["usage"].get(name) == reply.sent[name]


def first_token_banned(baseline: Reply) -> dict[str, int]:
    return {str(baseline.token_ids()[0]): -100}


def third_token(baseline: Reply) -> list[int]:
    return [baseline.token_ids()[2]]


def second_token_only(baseline: Reply) -> list[int]:
    return [baseline.token_ids()[1]]


def fourth_word(baseline: Reply) -> str:
    return " " + baseline.text.split()[3]


def first_word(baseline: Reply) -> list[str]:
    return [baseline.text.split()[0]]


def the_answer(baseline: Reply) -> dict[str, str]:
    return {"type": "content", "content": baseline.text}


# --- allow-list checks -----------------------------------------------------------------------


def model_is_echoed(probe: Probe) -> None:
    reply = probe.send({})
    assert reply.body["model"] == "default", reply.body
    unknown = probe.send({"model": "no-such-model"})
    assert unknown.status in (400, 404) and "model" in json.dumps(unknown.body), unknown.body


def streams_the_same_text(probe: Probe) -> None:
    whole = probe.send({})
    streamed = probe.send({"stream": True})
    assert streamed.content_type.startswith("text/event-stream"), streamed.content_type
    assert streamed.text == whole.text


def echoed(name: str, value: Any) -> Callable[[Probe], None]:
    def check(probe: Probe) -> None:
        reply = probe.send({name: value})
        assert reply.status == 200, reply.body
        assert reply.body.get(name) == value, f"{name} is not echoed: {reply.body.get(name)!r}"

    return check


def cached_on_repeat(name: str, value: Any) -> Callable[[Probe], None]:
    """A repeated request with ``name`` reads its prompt from the prefix cache."""

    def check(probe: Probe) -> None:
        first = probe.send({name: value})
        assert first.status == 200, first.body
        assert first.again(1).cached_tokens > 0

    return check


def anthropic_metadata_is_read(probe: Probe) -> None:
    assert probe.send({"metadata": {"user_id": "user-1"}}).status == 200
    assert probe.send({"metadata": {"user_id": 7}}).names("metadata")


def reports_standard_tier(probe: Probe) -> None:
    reply = probe.send({"service_tier": "standard_only"})
    assert reply.status == 200, reply.body
    assert reply.body["usage"].get("service_tier") == "standard", reply.body["usage"]


def not_stored(reply: Reply, _: Reply) -> bool:
    """Said to be unstored, and reading it back by its id is a 404."""
    path = f"{reply.shape.path}/{reply.body['id']}"
    return reply.body["store"] is False and reply.probe.http.get(path).status_code == 404


def queued(reply: Reply, _: Reply) -> bool:
    """Answered at once, queued, and read back later as the finished response."""
    path = f"{reply.shape.path}/{reply.body['id']}"
    return reply.body["status"] == "queued" and reply.probe.http.get(path).status_code == 200


def continues(reply: Reply, baseline: Reply) -> bool:
    """The baseline's conversation goes on: its prompt and answer are read from the cache."""
    return (
        reply.body["previous_response_id"] == baseline.body["id"]
        and reply.cached_tokens >= 16
        and reply.body["usage"]["input_tokens"] > baseline.body["usage"]["input_tokens"]
    )


def never_obfuscated(probe: Probe) -> None:
    reply = probe.send({"stream": True, "stream_options": {"include_obfuscation": False}})
    assert reply.status == 200 and reply.body
    assert not any("obfuscation" in event for event in reply.body)


# --- the tables ------------------------------------------------------------------------------

SEEDED = {"temperature": 1, "seed": 1}  # sampled, yet the same draw on every run
REPEATS = {"messages": user(REPEAT), "max_tokens": 12}
SHORT_ANSWER = {"messages": user(SHORT), "max_tokens": 10}  # the answer ends at 6
SPECIALS_SHOWN = {**SHORT_ANSWER, "ignore_eos": True}
PREFILLED = {"messages": [*user(SEA), {"role": "assistant", "content": PREFILL}]}
CONTINUED = {**PREFILLED, "continue_final_message": True}
CLOCK = {"name": "now", "description": "The current time", "strict": True}
CHAT_TOOLS = [{"type": "function", "function": {**CLOCK, "parameters": NO_ARGUMENTS}}]
CHAT_CLOCK = {"messages": user(TIME), "tools": CHAT_TOOLS}
CHAT_TOOL_CALL = {**CHAT_CLOCK, "tool_choice": "required", "max_tokens": TOOL_TOKENS}
PLAIN_TEMPLATE = "{% for message in messages %}{{ message['content'] }}\n{% endfor %}"

CHAT: list[Entry] = [
    Case("messages", user(MOON)),
    Allowed("model", "selects the served model; echoed, an unknown name is a 400", model_is_echoed),
    Refused("audio", {"voice": "alloy", "format": "wav"}),
    Case("frequency_penalty", 2.0, REPEATS),
    Refused("function_call", "auto"),
    Refused("functions", [{"name": "now", "parameters": NO_ARGUMENTS}]),
    Case("logit_bias", first_token_banned),
    Case("logprobs", True, honoured=has_logprobs),
    Case("max_completion_tokens", 3, honoured=tokens(3)),
    Case("max_tokens", 3, honoured=tokens(3)),
    Allowed(
        "metadata",
        "tags the completion; echoed in the completion's metadata",
        echoed("metadata", {"purpose": "probe"}),
    ),
    Refused("modalities", ["text", "audio"]),
    Case(
        "moderation", {"model": "omni-moderation-latest"}, may_refuse=True, honoured=has_moderation
    ),
    Case("n", 2, honoured=lambda reply, _: len(reply.body["choices"]) == 2),
    Case("parallel_tool_calls", False, CHAT_TOOL_CALL, one_call_then_ends),
    Case("prediction", the_answer, may_refuse=True, honoured=prediction_accepted),
    Case("presence_penalty", 2.0, REPEATS),
    Allowed(
        "prompt_cache_key",
        "routes to OpenAI's prompt cache; every prefix is cached here without one",
        cached_on_repeat("prompt_cache_key", "probe"),
    ),
    Case("prompt_cache_options", {"mode": "explicit"}, may_refuse=True, honoured=never_cached),
    Refused("prompt_cache_retention", "24h"),
    Case("reasoning_effort", "high", may_refuse=True),
    Case("response_format", {"type": "json_object"}, honoured=is_json, extra={"max_tokens": 12}),
    Allowed(
        "safety_identifier",
        "identifies the end user to OpenAI's abuse monitoring; no response field carries it",
    ),
    Case("seed", 2, SEEDED),
    Case("service_tier", "priority", may_refuse=True, honoured=echoes("service_tier")),
    Case("stop", fourth_word, honoured=shorter),
    Case("store", True, may_refuse=True, honoured=stored),
    Allowed(
        "stream",
        "changes the transport: the same text as server-sent events",
        streams_the_same_text,
    ),
    Case("stream_options", {"include_usage": True}, {"stream": True}, adds_usage_chunk),
    Allowed(
        "stream_options",
        "include_obfuscation false asks for what the server always does: no padding",
        never_obfuscated,
        label="no_obfuscation",
    ),
    Case(
        "stream_options",
        {"include_obfuscation": True},
        {"stream": True},
        obfuscated,
        may_refuse=True,
        label="obfuscation",
    ),
    Case("temperature", 1.5, extra={"seed": 1}),
    Case("tool_choice", "required", CHAT_CLOCK, calls_a_tool, extra={"max_tokens": TOOL_TOKENS}),
    Case("tools", CHAT_TOOLS, {"messages": user(TIME)}),
    Case("top_logprobs", 2, {"logprobs": True}, top_logprobs(2)),
    Case("top_p", 0.01, honoured=greedy, extra=SEEDED),
    Allowed(
        "user",
        "identifies the end user to OpenAI's abuse monitoring; no response field carries it",
    ),
    Case("verbosity", "low", may_refuse=True),
    Refused("web_search_options", {"search_context_size": "low"}),
    # vLLM's extensions
    Case("thinking_token_budget", 0, may_refuse=True),
    Case("include_reasoning", False, may_refuse=True),
    Refused("use_beam_search", True),
    Case("top_k", 1, honoured=greedy, extra=SEEDED),
    Case("min_p", 1.0, honoured=greedy, extra=SEEDED),
    Case("repetition_penalty", 2.0),
    Refused("watermarking", True),
    Refused("length_penalty", 2.0),
    Case("stop_token_ids", third_token, honoured=shorter),
    Case(
        "include_stop_str_in_output",
        True,
        {"stop": [" is"]},
        lambda reply, _: reply.text.endswith(" is"),
        may_refuse=True,
    ),
    Case("ignore_eos", True, SHORT_ANSWER, tokens(10)),
    Case("min_tokens", 8, SHORT_ANSWER, lambda reply, _: reply.output_tokens >= 8),
    Case(
        "skip_special_tokens",
        False,
        SPECIALS_SHOWN,
        lambda reply, _: "<|im_end|>" in reply.text,
        may_refuse=True,
    ),
    Case(
        "spaces_between_special_tokens",
        False,
        {**SPECIALS_SHOWN, "skip_special_tokens": False},
        may_refuse=True,
    ),
    Case(
        "truncate_prompt_tokens",
        4,
        may_refuse=True,
        honoured=lambda reply, _: reply.body["usage"]["prompt_tokens"] == 4,
    ),
    Case("truncation_side", "right", {"truncate_prompt_tokens": 8}, may_refuse=True),
    Case(
        "prompt_logprobs",
        1,
        may_refuse=True,
        honoured=lambda reply, _: bool(reply.body.get("prompt_logprobs")),
    ),
    Case("logprob_token_ids", [0], {"logprobs": True}, top_logprobs(1), may_refuse=True),
    Case("allowed_token_ids", second_token_only, may_refuse=True),
    Case("bad_words", first_word, may_refuse=True),
    Case("echo", True, CONTINUED, lambda r, _: r.text.startswith(PREFILL), may_refuse=True),
    Case("add_generation_prompt", False, may_refuse=True),
    Case("continue_final_message", True, PREFILLED),
    Case("add_special_tokens", True, may_refuse=True),
    Case("documents", [{"title": "Sea", "text": "The sea is green."}], may_refuse=True),
    Case("chat_template", PLAIN_TEMPLATE, may_refuse=True),
    Case("chat_template_kwargs", {"enable_thinking": True}, may_refuse=True),
    Refused("media_io_kwargs", {"image": {"mode": "RGB"}}),
    Refused("mm_processor_kwargs", {"do_resize": False}),
    Case("structured_outputs", {"choice": FRUIT}, honoured=one_of(FRUIT)),
    Allowed(
        "priority",
        "the engine's scheduling order (lower first, as vLLM); it shows only under contention,"
        " which tests/e2e/test_embedded_admission.py builds",
    ),
    Case(
        "request_id",
        "probe-request",
        may_refuse=True,
        honoured=lambda reply, _: "probe-request" in reply.body["id"],
    ),
    Refused("session_id", "probe-session"),
    Case(
        "return_tokens_as_token_ids",
        True,
        {"logprobs": True},
        lambda reply, _: reply.logprobs[0]["token"].startswith("token_id:"),
        may_refuse=True,
    ),
    Case(
        "return_token_ids",
        True,
        may_refuse=True,
        honoured=lambda reply, _: bool(reply.body["choices"][0].get("token_ids")),
    ),
    Refused("routed_experts_prompt_start", 1),
    Refused("return_token_offsets", True),
    Case(
        "return_prompt_text",
        True,
        may_refuse=True,
        honoured=lambda reply, _: bool(reply.body.get("prompt_text")),
    ),
    Refused("return_mm_kwargs", True),
    Case("cache_salt", "probe-salt", may_refuse=True, honoured=salted),
    Refused("kv_transfer_params", {"do_remote_decode": True}),
    Refused("ec_transfer_params", {"do_remote_encode": True}),
    Refused("vllm_xargs", {"probe": 1}),
    Case(
        "repetition_detection",
        {"max_pattern_size": 4, "min_count": 2},
        REPEATS,
        may_refuse=True,
    ),
    Case("stream_interval", 4, {"stream": True}, fewer_events, may_refuse=True),
    Case(
        "guided_json",
        {"type": "object"},
        honoured=is_json,
        may_refuse=True,
        extra={"max_tokens": 12},
    ),
    Case("guided_regex", "(yes|no)", honoured=one_of(["yes", "no"]), may_refuse=True),
    Case("guided_choice", FRUIT, honoured=one_of(FRUIT), may_refuse=True),
    Case(
        "guided_grammar", 'root ::= "yes" | "no"', honoured=one_of(["yes", "no"]), may_refuse=True
    ),
    # DeepSeek's switch, which this server reads too
    Case("thinking", {"type": "enabled"}, may_refuse=True),
]

RESPONSES_TOOLS = [{"type": "function", **CLOCK, "parameters": NO_ARGUMENTS}]
RESPONSES_CLOCK = {"input": TIME, "tools": RESPONSES_TOOLS}
RESPONSES_TOOL_CALL = {
    **RESPONSES_CLOCK,
    "tool_choice": "required",
    "max_output_tokens": TOOL_TOKENS,
}

RESPONSES: list[Entry] = [
    Refused("access_programs", {"cyber": "daybreak_blue"}),
    Case("background", True, honoured=queued),
    Refused("background_options", {"completion_window": "2h"}),
    Case(
        "context_management",
        [{"type": "compaction", "compact_threshold": 16}],
        may_refuse=True,
    ),
    Refused("conversation", "conv_earlier"),
    Refused("image", {"context_compression": "enabled"}),
    Case("include", [LOGPROBS_INCLUDE], honoured=has_logprobs),
    Refused("include", ["reasoning.encrypted_content"], label="encrypted_content"),
    Case("input", MOON),
    Case("instructions", "Answer in French."),
    Case("max_output_tokens", 3, honoured=tokens(3)),
    Case("max_tool_calls", 1, RESPONSES_TOOL_CALL, one_call_then_ends, may_refuse=True),
    Allowed(
        "metadata",
        "tags the response; echoed in the response",
        echoed("metadata", {"purpose": "probe"}),
    ),
    Allowed("model", "selects the served model; echoed, an unknown name is a 400", model_is_echoed),
    Case(
        "moderation", {"model": "omni-moderation-latest"}, may_refuse=True, honoured=has_moderation
    ),
    Case("parallel_tool_calls", False, RESPONSES_TOOL_CALL, one_call_then_ends),
    Case("previous_response_id", lambda baseline: baseline.body["id"], honoured=continues),
    Refused("prompt", {"id": "pmpt_earlier"}),
    Allowed(
        "prompt_cache_key",
        "routes to OpenAI's prompt cache; every prefix is cached here; echoed",
        echoed("prompt_cache_key", "probe"),
    ),
    Case("prompt_cache_options", {"mode": "explicit"}, may_refuse=True, honoured=never_cached),
    Refused("prompt_cache_retention", "24h"),
    Case("reasoning", {"effort": "high"}, may_refuse=True),
    Case("reasoning", {"summary": "detailed"}, may_refuse=True, label="summary"),
    Allowed(
        "safety_identifier",
        "identifies the end user to OpenAI's abuse monitoring; echoed",
        echoed("safety_identifier", "probe-user"),
    ),
    Case("service_tier", "priority", may_refuse=True, honoured=echoes("service_tier")),
    Case("store", True, honoured=stored),
    Case("store", False, honoured=not_stored, label="false"),
    Allowed(
        "stream",
        "changes the transport: the same text as server-sent events",
        streams_the_same_text,
    ),
    Allowed(
        "stream_options",
        "include_obfuscation false asks for what the server always does: no padding",
        never_obfuscated,
        label="no_obfuscation",
    ),
    Case(
        "stream_options",
        {"include_obfuscation": True},
        {"stream": True},
        obfuscated,
        may_refuse=True,
        label="obfuscation",
    ),
    Case("temperature", 1.5, {"max_output_tokens": 12}, sampled),
    Case(
        "text",
        {"format": {"type": "json_object"}},
        honoured=is_json,
        extra={"max_output_tokens": 12},
    ),
    Case("text", {"verbosity": "low"}, may_refuse=True, label="verbosity"),
    Case(
        "tool_choice",
        "required",
        RESPONSES_CLOCK,
        calls_a_tool,
        extra={"max_output_tokens": TOOL_TOKENS},
    ),
    Case("tools", RESPONSES_TOOLS, {"input": TIME}),
    Case("top_logprobs", 2, {"include": [LOGPROBS_INCLUDE]}, top_logprobs(2)),
    Case("top_p", 0.01, {"max_output_tokens": 12}, greedy, extra={"temperature": 1}),
    Case(
        "truncation",
        "auto",
        {"input": TOO_LONG},
        lambda reply, _: reply.status == 200,
        may_refuse=True,
    ),
    Allowed("user", "identifies the end user; echoed", echoed("user", "probe-user")),
    # vLLM's extension, which this server reads on every protocol
    Case("structured_outputs", {"choice": FRUIT}, honoured=one_of(FRUIT)),
]

MESSAGES_TOOLS = [{**CLOCK, "input_schema": NO_ARGUMENTS}]
MESSAGES_CLOCK = {"messages": user(TIME), "tools": MESSAGES_TOOLS}
SEA_COLOUR = {
    "type": "json_schema",
    "schema": {
        "type": "object",
        "properties": {"colour": {"type": "string", "enum": ["blue", "green"]}},
        "required": ["colour"],
        "additionalProperties": False,
    },
}

MESSAGES: list[Entry] = [
    Case("max_tokens", 3, honoured=tokens(3)),
    Case("messages", user(MOON)),
    Allowed("model", "selects the served model; echoed, an unknown name is a 400", model_is_echoed),
    Allowed(
        "cache_control",
        "prefix caching is automatic, so a breakpoint adds nothing; reads are reported",
        cached_on_repeat("cache_control", {"type": "ephemeral"}),
    ),
    Refused("container", "container_earlier"),
    Case(
        "diagnostics",
        {"previous_message_id": None},
        may_refuse=True,
        honoured=lambda reply, _: reply.body.get("diagnostics") is not None,
    ),
    Case("inference_geo", "us", may_refuse=True, honoured=reports_usage("inference_geo")),
    Allowed(
        "metadata",
        "user_id identifies the end user to abuse monitoring; validated, a Message has no echo",
        anthropic_metadata_is_read,
    ),
    Case("output_config", {"format": SEA_COLOUR}, honoured=is_json, extra={"max_tokens": 12}),
    Case("output_config", {"effort": "low"}, may_refuse=True, label="effort"),
    Allowed(
        "service_tier",
        "standard capacity is the only capacity here; usage.service_tier reports it",
        reports_standard_tier,
    ),
    Case("speed", "fast", may_refuse=True, honoured=reports_usage("speed")),
    Case(
        "stop_sequences",
        [" is"],
        honoured=lambda reply, _: (
            (reply.finish, reply.body["stop_sequence"]) == ("stop_sequence", " is")
        ),
    ),
    Allowed(
        "stream",
        "changes the transport: the same text as server-sent events",
        streams_the_same_text,
    ),
    Case("system", "Answer in French."),
    Case(
        "thinking",
        {"type": "enabled", "budget_tokens": 1024},
        {"messages": user(SHORT), "max_tokens": 1100},
        may_refuse=True,
    ),
    Case(
        "tool_choice",
        {"type": "any"},
        MESSAGES_CLOCK,
        calls_a_tool,
        extra={"max_tokens": TOOL_TOKENS},
    ),
    Case("tools", MESSAGES_TOOLS, {"messages": user(TIME)}),
    Allowed(
        "user_profile_id",
        "the anthropic-user-profile-id header attributes usage to an account; there are none",
    ),
    Allowed(
        "workspace_id",
        "the anthropic-workspace-id header picks an account's workspace; there are none",
    ),
    # Sampling fields the Messages API has had, and vLLM's extension: the server reads them.
    Case("temperature", 1.0, {"max_tokens": 12}, sampled),
    Case("top_k", 1, {"max_tokens": 12}, greedy, extra={"temperature": 1.0}),
    Case("top_p", 0.01, {"max_tokens": 12}, greedy, extra={"temperature": 1.0}),
    Case("structured_outputs", {"choice": FRUIT}, honoured=one_of(FRUIT)),
]


def legacy_logprobs(count: int) -> Check:
    """One entry per generated token, each top map holding the token and ``count`` more."""

    def check(reply: Reply, _: Reply) -> bool:
        entries = reply.logprobs
        tops_ok = all(count <= len(entry["top_logprobs"]) <= count + 1 for entry in entries)
        return len(entries) == reply.output_tokens > 0 and tops_ok

    return check


def raw_chat_ids(text: str) -> list[int]:
    """A one-turn ChatML prompt as token ids: a raw prompt that reaches the model's end of turn."""
    template = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
    return _tokenizer().encode(template.format(text), add_special_tokens=False).ids


RAW_REPEATS = {"prompt": RAW_REPEAT, "max_tokens": 12}
RAW_SHORT = {"prompt": raw_chat_ids(SHORT), "max_tokens": 10}

COMPLETIONS: list[Entry] = [
    Case("prompt", RAW_MOON),
    Allowed("model", "selects the served model; echoed, an unknown name is a 400", model_is_echoed),
    Case("best_of", 2, may_refuse=True),
    Case("echo", True, honoured=lambda reply, baseline: reply.text == RAW_SEA + baseline.text),
    Case("frequency_penalty", 2.0, RAW_REPEATS),
    Case("logit_bias", first_token_banned),
    Case("logprobs", 2, honoured=legacy_logprobs(2)),
    Case("max_tokens", 3, honoured=tokens(3)),
    Case("n", 2, honoured=lambda reply, _: len(reply.body["choices"]) == 2),
    Case("presence_penalty", 2.0, RAW_REPEATS),
    Case("seed", 2, SEEDED),
    Case("stop", fourth_word, honoured=shorter),
    Allowed(
        "stream",
        "changes the transport: the same text as server-sent events",
        streams_the_same_text,
    ),
    Case("stream_options", {"include_usage": True}, {"stream": True}, adds_usage_chunk),
    Case("suffix", " And so it ends.", may_refuse=True),
    Case("temperature", 1.5, extra={"seed": 1}),
    Case("top_p", 0.01, honoured=greedy, extra=SEEDED),
    Allowed(
        "user",
        "identifies the end user to OpenAI's abuse monitoring; no response field carries it",
    ),
    # vLLM's extensions
    Case("top_k", 1, honoured=greedy, extra=SEEDED),
    Case("min_p", 1.0, honoured=greedy, extra=SEEDED),
    Case("repetition_penalty", 2.0, RAW_REPEATS),
    Case("stop_token_ids", third_token, honoured=shorter),
    Case("ignore_eos", True, RAW_SHORT, tokens(10)),
    Case("min_tokens", 8, RAW_SHORT, lambda reply, _: reply.output_tokens >= 8),
    Case("structured_outputs", {"choice": FRUIT}, honoured=one_of(FRUIT)),
    Refused("use_beam_search", True),
    Refused("prompt_logprobs", 1),
    Refused("prompt_embeds", "AAAA"),
    Refused("response_format", {"type": "json_object"}),
]

TABLES: dict[str, list[Entry]] = {
    "chat": CHAT,
    "completions": COMPLETIONS,
    "responses": RESPONSES,
    "messages": MESSAGES,
}


def _params() -> list[Any]:
    return [
        pytest.param(route, entry, id=f"{route}-{entry.name}")
        for route, entries in TABLES.items()
        for entry in entries
    ]


PARAMS = _params()


# --- the tests -------------------------------------------------------------------------------


@pytest.mark.parametrize("route", list(TABLES))
def test_every_sdk_parameter_is_classified(route: str):
    module_name, class_name = SDK_CREATE[route]
    module = importlib.import_module(module_name)
    create = getattr(module, class_name).create
    parameters = set(inspect.signature(create).parameters) - TRANSPORT_PARAMETERS
    classified = {entry.field for entry in TABLES[route]}
    missing = sorted(parameters - classified)
    assert not missing, f"{class_name}.create has fields this test does not classify: {missing}"


def test_every_vllm_extension_is_classified():
    classified = {entry.field for entry in CHAT}
    assert not [name for name in VLLM_CHAT_EXTENSIONS if name not in classified]


def test_every_allowed_field_says_why():
    for entries in TABLES.values():
        for entry in entries:
            if isinstance(entry, Allowed):
                assert entry.reason and "\n" not in entry.reason, entry.name


@pytest.fixture(scope="module")
def verdicts(http: httpx.Client, request: pytest.FixtureRequest) -> dict[str, BaseException]:
    """The failure, if any, of every selected entry, judged ``CONCURRENCY`` at a time.

    Judged together they keep the server's batch full; each test then reports its own.
    """
    selected = [
        item.callspec
        for item in request.session.items
        if item.module is request.module
        and hasattr(item, "callspec")
        and "entry" in item.callspec.params
    ]
    probes = {route: Probe(http, route) for route in TABLES}

    def judge(callspec: Any) -> tuple[str, BaseException | None]:
        route, entry = callspec.params["route"], callspec.params["entry"]
        try:
            entry.judge(probes[route])
        except Exception as error:
            return callspec.id, error
        return callspec.id, None

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        outcomes = pool.map(judge, selected)
    return {name: error for name, error in outcomes if error is not None}


@pytest.mark.parametrize(("route", "entry"), PARAMS)
def test_field_is_honoured_or_refused(
    route: str, entry: Entry, verdicts: dict[str, BaseException], request: pytest.FixtureRequest
):
    error = verdicts.get(request.node.callspec.id)
    if error is not None:
        raise error
