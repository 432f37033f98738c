"""What the OpenAI protocols share: images, effort, tool choice, usage, logprobs, errors,
and ``Fields``, the reader of bodies no pydantic model validates.

Completions and Chat Completions validate their bodies with pydantic models
(``openai_request_parts``, ``body_validation``); Responses, ``/tokenize`` and
``/detokenize`` read theirs with ``Fields``. Both say a refusal the same way, in
one sentence naming the field (as a path like ``messages[1].content``), its value
and what would be accepted: ``integer_range`` and ``number_range`` phrase the
bounds for both. All of them split data URLs, map ``reasoning_effort`` and check a
named tool choice alike, report logprobs in the same token shape and render errors
in the same ``{"error": {...}}`` body.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from typing import Any

from api.errors import ApiError, bad_request
from api.protocols.base import LogprobEntry, Usage
from shared.conversation import (
    IMAGE_DETAILS,
    Conversation,
    ConversationError,
    ImageDetail,
    ImageSource,
    ResponseFormat,
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


class Fields:
    """Typed reads of one JSON object's fields; each failure is a 400 naming the path.

    ``null`` reads as absent, as the OpenAI API treats it for optional fields.
    """

    def __init__(self, body: Any, path: str = "") -> None:
        if not isinstance(body, dict):
            where = path or "the request body"
            raise bad_request(f"{where} must be a JSON object, got {show(body)}", path or None)
        self.body = body
        self.path = path
        self.read: set[str] = set()

    def where(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def get(self, name: str) -> Any:
        self.read.add(name)
        return self.body.get(name)

    def unread(self) -> list[str]:
        """The fields no reader asked for: a parser calls this last, to report them ignored."""
        return [name for name in self.body if name not in self.read]

    def has(self, name: str) -> bool:
        return self.body.get(name) is not None

    def error(self, name: str, accepted: str) -> ApiError:
        """The 400 for field ``name``: its path, its value, what would be accepted."""
        where = self.where(name)
        return bad_request(f"{where} must be {accepted}, got {show(self.get(name))}", where)

    def required(self, name: str) -> Any:
        value = self.get(name)
        if value is None:
            raise bad_request(f"{self.where(name)} is required", self.where(name))
        return value

    def string(self, name: str, *, required: bool = False, non_empty: bool = False) -> str | None:
        value = self.required(name) if required else self.get(name)
        if value is None:
            return None
        if not isinstance(value, str) or (non_empty and not value):
            raise self.error(name, "a non-empty string" if non_empty else "a string")
        return value

    def boolean(self, name: str) -> bool | None:
        value = self.get(name)
        if value is not None and not isinstance(value, bool):
            raise self.error(name, "true or false")
        return value

    def integer(self, name: str, low: int | None = None, high: int | None = None) -> int | None:
        value = self.get(name)
        if value is None:
            return None
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if (
            not _is_int(value)
            or (low is not None and value < low)
            or (high is not None and value > high)
        ):
            raise self.error(name, integer_range(low, high))
        return value

    def number(
        self, name: str, low: float, high: float | None = None, *, low_open: bool = False
    ) -> float | None:
        value = self.get(name)
        if value is None:
            return None
        ok = _is_number(value) and abs(value) <= LARGEST and math.isfinite(value)
        ok = ok and (value > low if low_open else value >= low)
        if not ok or (high is not None and value > high):
            raise self.error(name, number_range(low, high, low_open))
        return float(value)

    def choice(self, name: str, options: Any) -> str | None:
        value = self.get(name)
        if value is not None and value not in options:
            raise self.error(name, "one of " + ", ".join(repr(option) for option in options))
        return value

    def object(self, name: str) -> Fields | None:
        value = self.get(name)
        return None if value is None else Fields(value, self.where(name))

    def array(self, name: str, *, required: bool = False) -> list[Any] | None:
        value = self.required(name) if required else self.get(name)
        if value is not None and not isinstance(value, list):
            raise self.error(name, "an array")
        return value

    def objects(self, name: str) -> Iterator[Fields]:
        """Each element of the array ``name`` as ``Fields`` with its indexed path."""
        for index, item in enumerate(self.array(name) or []):
            yield Fields(item, f"{self.where(name)}[{index}]")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


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


def read_metadata(fields: Fields) -> dict[str, str]:
    """``metadata``: up to 16 string pairs, keys up to 64 and values up to 512 characters."""
    value = fields.get("metadata")
    if value is None:
        return {}
    ok = isinstance(value, dict) and len(value) <= 16
    ok = ok and all(
        isinstance(key, str) and len(key) <= 64 and isinstance(item, str) and len(item) <= 512
        for key, item in value.items()
    )
    if not ok:
        raise fields.error(
            "metadata",
            "an object of at most 16 string values (keys up to 64, values up to 512 characters)",
        )
    return dict(value)


def read_function(fields: Fields) -> Tool:
    """A function's name, description and JSON schema parameters (no parameters: no arguments)."""
    parameters = fields.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise fields.error("parameters", "a JSON schema object")
    tool = Tool(
        name=fields.string("name", required=True, non_empty=True) or "",
        description=fields.string("description"),
        strict=bool(fields.boolean("strict")),
    )
    if parameters is not None:
        tool.parameters = parameters
    return tool


def read_json_schema(spec: Fields) -> ResponseFormat:
    """A ``json_schema`` response format: ``schema`` is required, ``name`` is only echoed."""
    schema = spec.required("schema")
    if not isinstance(schema, dict):
        raise spec.error("schema", "a JSON schema object")
    return ResponseFormat(
        "json_schema",
        schema=schema,
        name=spec.string("name"),
        strict=bool(spec.boolean("strict")),
        param=spec.where("schema"),
    )


def read_effort(fields: Fields, name: str) -> str | None:
    return fields.choice(name, tuple(REASONING_EFFORTS))


def apply_effort(conversation: Conversation, effort: str | None) -> None:
    """Map an OpenAI effort name: ``none`` turns thinking off, any other turns it on.

    ``minimal`` becomes ``low``: the conversation knows five levels and each prompt
    format decides what they mean.
    """
    if effort is None:
        return
    conversation.thinking = effort != "none"
    conversation.reasoning_effort = REASONING_EFFORTS[effort]  # type: ignore[assignment]


def image_detail(part: Fields) -> ImageDetail:
    """``detail``: how closely the model reads the image; preparation refuses a level the
    model's image processing does not serve."""
    detail = part.get("detail")
    if detail is None:
        return "auto"
    if detail not in IMAGE_DETAILS:
        raise part.error("detail", "one of " + ", ".join(repr(d) for d in IMAGE_DETAILS))
    return detail


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


def read_tool_choice(fields: Fields, tools: list[Tool], *, nested: bool) -> ToolChoice:
    """``tool_choice``: a mode, or a named function that must be among ``tools``.

    ``parallel_tool_calls`` false allows one call per turn.

    Chat Completions nests the name (``{"type": "function", "function":
    {"name": ...}}``); Responses does not (``{"type": "function", "name": ...}``).
    """
    value = fields.get("tool_choice")
    parallel = fields.boolean("parallel_tool_calls")
    if value is None or (isinstance(value, str) and value in ("none", "auto", "required")):
        return tool_choice(value, None, tools, parallel)
    if not isinstance(value, dict) or value.get("type") != "function":
        named = '"function": {"name": ...}' if nested else '"name": ...'
        accepted = f"'none', 'auto', 'required' or {{\"type\": \"function\", {named}}}"
        raise fields.error("tool_choice", accepted)
    choice = Fields(value, "tool_choice")
    if nested:
        choice = Fields(choice.required("function"), "tool_choice.function")
    name = choice.string("name", required=True, non_empty=True)
    return tool_choice("function", name, tools, parallel, choice.where("name"))


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
