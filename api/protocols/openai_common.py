"""What the OpenAI protocols share: images, effort, tool choice, choices, usage, logprobs,
errors.

Their bodies are validated by pydantic models (``openai_request_parts``,
``body_validation``), and a refusal says the same in one sentence for all of them:
the field (as a path like ``messages[1].content``), its value (``show``) and what
would be accepted; ``integer_range`` and ``number_range`` phrase the bounds. Past the
types, the protocols split data URLs, map ``reasoning_effort``, check a named tool
choice and split a body into its choices alike, report logprobs in the same token
shape and render errors in the same ``{"error": {...}}`` body.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from api.errors import ApiError, bad_request
from api.protocols.base import LogprobEntry, Usage
from shared.conversation import (
    Conversation,
    ConversationError,
    ImageDetail,
    ImageSource,
    Tool,
    ToolChoice,
)

# OpenAI reports -9999.0 for a token the model all but ruled out; JSON has no -inf.
_FLOOR_LOGPROB = -9999.0
LARGEST = 1e300  # numbers beyond are refused rather than overflowing a float
_MAX_SHOWN = 80
_DATA_URL = re.compile(r"data:(?P<media>[^;,]*)(?P<params>(?:;[^;,]*)*),(?P<data>.*)", re.DOTALL)
_LEADING_PATH = re.compile(r"[A-Za-z_][\w.\[\]]*")

# OpenAI effort names -> Conversation.reasoning_effort; "none" turns thinking off.
REASONING_EFFORTS: dict[str, str | None] = {
    "none": None,
    "minimal": "low",
    "low": "low",
    "medium": "medium",
    "high": "high",
    "xhigh": "xhigh",
    "max": "max",
}
MAX_STOP_SEQUENCES = 16
MAX_TOP_LOGPROBS = 20
MAX_CHOICES = 64  # generations one request may ask for: prompts times n


def show(value: Any) -> str:
    """A value as the client wrote it (JSON spelling), cut short for error messages."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= _MAX_SHOWN else text[: _MAX_SHOWN - 3] + "..."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def integer_range(low: int | None, high: int | None) -> str:
    if low is not None and high is not None:
        return f"an integer between {low} and {high}"
    return "an integer" if low is None else f"an integer >= {low}"


def number_range(low: float, high: float | None, low_open: bool) -> str:
    low_text, high_text = f"{low:g}", "" if high is None else f"{high:g}"
    if high is None:
        return f"a number {'>' if low_open else '>='} {low_text}"
    if low_open:
        return f"a number in ({low_text}, {high_text}]"
    return f"a number between {low_text} and {high_text}"


def copies(body: dict[str, Any]) -> list[dict[str, Any]]:
    """One body per choice of a body asking for ``n`` of them, each without ``n`` and, when
    the body has a seed, seeded ``seed + i``, as vLLM seeds a request's samples; ``[body]``
    when ``n`` is absent, 1, or not a count (its reader then names it)."""
    n = choices_per_prompt(body)
    if n == 1:
        return [body]
    if n > MAX_CHOICES:
        raise bad_request(f"n must be at most {MAX_CHOICES}, got {n}", "n", "limit_exceeded")
    seed = body.get("seed")
    one = {name: value for name, value in body.items() if name != "n"}
    return [one | ({"seed": seed + index} if _is_int(seed) else {}) for index in range(n)]


def choices_per_prompt(body: dict[str, Any]) -> int:
    """``n``, or 1 where it is absent or not a count."""
    n = body.get("n")
    return n if _is_int(n) and n > 1 else 1


def refuse_several_choices(n: int | None) -> None:
    """``n`` > 1 reaches a body's parser only where no route split it into choices (``copies``):
    in a job or a batch line."""
    if n is not None and n > 1:
        raise bad_request(
            f"n > 1 is only accepted by a synchronous request, not in a job or batch; got {n}",
            "n",
            "unsupported_parameter",
        )


def apply_effort(conversation: Conversation, effort: str | None) -> None:
    """Map an OpenAI effort name: ``none`` turns thinking off, any other turns it on.

    ``minimal`` becomes ``low``: the conversation knows five levels and each prompt
    format decides what they mean.
    """
    if effort is None:
        return
    conversation.thinking = effort != "none"
    conversation.reasoning_effort = REASONING_EFFORTS[effort]  # type: ignore[assignment]


def image_source(url: Any, where: str, detail: ImageDetail = "auto") -> ImageSource:
    """An ``http(s)`` URL is passed on for preparation to fetch; a data URL is split here."""
    if not isinstance(url, str):
        raise bad_request(f"{where} must be a URL string, got {show(url)}", where)
    if url.startswith(("http://", "https://")):
        return ImageSource(url=url, detail=detail)
    match = _DATA_URL.fullmatch(url)
    if match is None:
        raise bad_request(
            f"{where} must be an http(s) URL or a data:image/...;base64,... URL, got {show(url)}",
            where,
        )
    media_type, params = match["media"].lower(), match["params"].lower().split(";")
    if not media_type.startswith("image/") or "base64" not in params:
        raise bad_request(
            f"{where} must be a base64 image data URL (data:image/png;base64,...), got {show(url)}",
            where,
        )
    return ImageSource(data=match["data"], media_type=media_type, detail=detail)


def validated_conversation(
    conversation: Conversation, *, param_from_message: bool = True
) -> Conversation:
    """Run the conversation's own checks; their message already names the field.

    The parsers check what they can first, in the client's field names; this
    is the safety net. ``param_from_message`` is off when the conversation's
    paths (``messages[i]``) are not the protocol's.
    """
    try:
        return conversation.validate()
    except ConversationError as error:
        message = str(error)
        match = _LEADING_PATH.match(message) if param_from_message else None
        raise bad_request(message, match.group() if match else None) from None


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _FLOOR_LOGPROB


def token_logprob(entry: LogprobEntry) -> dict[str, Any]:
    """One token in the shape both protocols use: token, logprob, bytes and its top list."""
    return {
        "token": entry.token,
        "logprob": finite(entry.logprob),
        "bytes": list(entry.token_bytes),
        "top_logprobs": [
            {"token": token, "logprob": finite(logprob), "bytes": list(token_bytes)}
            for token, token_bytes, logprob in entry.top
        ],
    }


def chat_usage(usage: Usage) -> dict[str, Any]:
    """Chat Completions usage, with DeepSeek's cache hit/miss counts alongside OpenAI's."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "prompt_cache_hit_tokens": usage.cached_tokens,
        "prompt_cache_miss_tokens": usage.prompt_tokens - usage.cached_tokens,
    }


def responses_usage(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "total_tokens": usage.total_tokens,
    }


def error_body(error: ApiError) -> dict[str, Any]:
    """OpenAI's error shape; the SDKs read ``message``, ``type``, ``param`` and ``code``."""
    return {
        "error": {
            "message": error.message,
            "type": error.type,
            "param": error.param,
            "code": error.code,
        }
    }


def tool_choice(
    mode: str | None,
    name: str | None,
    tools: list[Tool],
    parallel: bool | None,
    where: str = "tool_choice",
) -> ToolChoice:
    """A tool choice ``mode`` (``function``: the one ``name``d, at ``where``, which must be
    among ``tools``); ``parallel`` false allows one call per turn."""
    parallel_calls = parallel is not False
    if mode is None:
        return ToolChoice(parallel=parallel_calls)
    if mode == "required" and not tools:
        raise bad_request("tool_choice 'required' needs at least one tool in tools", "tool_choice")
    if mode != "function":
        return ToolChoice(mode, parallel=parallel_calls)  # type: ignore[arg-type]
    names = [tool.name for tool in tools]
    if name not in names:
        accepted = f"the name of a function in tools ({', '.join(names)})"
        raise bad_request(f"{where} must be {accepted}, got {show(name)}", where)
    return ToolChoice("function", name, parallel_calls)
