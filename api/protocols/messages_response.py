"""Anthropic Messages responses: the SSE event stream and the final ``Message``.

One builder produces both. Each delta extends the content block that is open
or closes it and opens the next one, so the stream events and ``response()``
come from the same state and always agree:
``message_start`` · ``ping`` · (``content_block_start`` · ``content_block_delta``… ·
``content_block_stop``)… · ``message_delta`` · ``message_stop``.

Mapping choices:

- Finish kinds: stop → ``end_turn`` (``tool_use`` when the answer holds tool
  calls, since clients run tools on that reason), stop_sequence →
  ``stop_sequence`` with the matched string, length → ``max_tokens``,
  tool_calls → ``tool_use``, abort → ``pause_turn``: the server stopped the
  turn, not the model, and a client may send the partial turn back to continue.
- Tool call ids become ``toolu_`` ids (``call_x`` → ``toolu_x``). Conversation
  ids are opaque, so the id a client echoes in ``tool_result`` still matches
  the ``tool_use`` it sends back in the history.
- Thinking blocks carry an empty signature (start and ``signature_delta``):
  there is nothing to sign, and the parser ignores signatures sent back.
- ``tool_use.input`` in ``response()`` is read from the streamed arguments the
  way the SDK's stream accumulator reads them (partial JSON allowed, so
  arguments cut short by max_tokens keep their complete members); anything that
  is still not a JSON object becomes ``{}``.
- Usage: ``input_tokens`` excludes prompt tokens served from the prefix cache,
  which are ``cache_read_input_tokens`` (the API's total input is their sum);
  nothing is ever written to a cache, so ``cache_creation_input_tokens`` is 0.
"""

from __future__ import annotations

from typing import Any

from pydantic_core import from_json

from api.errors import ApiError
from api.output_parser import (
    ContentDelta,
    Delta,
    ReasoningDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from api.protocols.base import (
    FinishKind,
    GenerationRequest,
    LogprobEntry,
    ResponseBuilder,
    ResponseContext,
    SSEChunk,
    Usage,
)

STOP_REASONS: dict[str, str] = {
    "stop": "end_turn",
    "stop_sequence": "stop_sequence",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "abort": "pause_turn",
}

# Error types the Anthropic API and SDK know; anything else is named from the status.
ERROR_TYPES: frozenset[str] = frozenset(
    {
        "invalid_request_error",
        "authentication_error",
        "billing_error",
        "permission_error",
        "not_found_error",
        "request_too_large",
        "rate_limit_error",
        "timeout_error",
        "api_error",
        "overloaded_error",
    }
)
_ERROR_TYPE_BY_STATUS = {
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def error_body(error: ApiError) -> dict[str, Any]:
    """``{"type": "error", "error": {"type", "message"}}`` with an error type the SDK knows."""
    kind = error.type if error.type in ERROR_TYPES else _error_type(error.status)
    if kind == "invalid_request_error":  # the OpenAI-style default: Anthropic names 401s, 413s
        kind = _error_type(error.status)
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def _error_type(status: int) -> str:
    fallback = "api_error" if status >= 500 else "invalid_request_error"
    return _ERROR_TYPE_BY_STATUS.get(status, fallback)


def tool_use_id(call_id: str) -> str:
    """The ``toolu_`` spelling of a parser's tool call id."""
    return "toolu_" + call_id.removeprefix("call_")


def usage_body(usage: Usage) -> dict[str, int | str]:
    return {
        "input_tokens": max(usage.prompt_tokens - usage.cached_tokens, 0),
        "output_tokens": usage.completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": usage.cached_tokens,
        "service_tier": "standard",  # the one tier served
    }


def _event(data: dict[str, Any]) -> SSEChunk:
    """Anthropic names every event after its ``type``."""
    return SSEChunk(data, data["type"])


class MessagesResponseBuilder(ResponseBuilder):
    """Content blocks built from deltas, streamed as events and kept for ``response()``."""

    def __init__(self, request: GenerationRequest, context: ResponseContext):
        super().__init__(request, context)
        self._blocks: list[dict[str, Any]] = []
        self._open: int | None = None  # index of the block still receiving deltas
        self._arguments: dict[int, list[str]] = {}  # tool_use block index → JSON pieces
        self._tool_blocks: dict[int, int] = {}  # parser's tool call index → block index
        self._usage = Usage()
        self._stop_reason: str | None = None
        self._stop_sequence: str | None = None

    def start(self, usage: Usage) -> list[SSEChunk]:
        self._usage = usage
        message = self._message(content=[])
        return [_event({"type": "message_start", "message": message}), _event({"type": "ping"})]

    def delta(self, delta: Delta, logprobs: list[LogprobEntry] | None = None) -> list[SSEChunk]:
        """One parsed delta as events; logprobs have no place in this protocol."""
        match delta:
            case ContentDelta(text=text):
                return self._append_text("text", text)
            case ReasoningDelta(text=text):
                return self._append_text("thinking", text)
            case ToolCallStart():
                return self._start_tool_use(delta)
            case ToolCallArgsDelta():
                return self._append_arguments(delta)
            case ToolCallEnd():
                return self._close_block()
        return []

    def finish(self, kind: FinishKind, usage: Usage, stop_sequence: str | None) -> list[SSEChunk]:
        self._usage = usage
        self._stop_reason, self._stop_sequence = self._stop(kind, stop_sequence)
        message_delta = {
            "type": "message_delta",
            "delta": {"stop_reason": self._stop_reason, "stop_sequence": self._stop_sequence},
            "usage": usage_body(usage),
        }
        return [*self._close_block(), _event(message_delta), _event({"type": "message_stop"})]

    def response(self) -> dict[str, Any]:
        content = [self._final_block(index, block) for index, block in enumerate(self._blocks)]
        return self._message(content)

    def stream_error(self, error: ApiError) -> list[SSEChunk]:
        return [SSEChunk(error_body(error), "error")]

    def _message(self, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.context.request_id,
            "type": "message",
            "role": "assistant",
            "model": self.context.model,
            "content": content,
            "stop_reason": self._stop_reason,
            "stop_sequence": self._stop_sequence,
            "usage": usage_body(self._usage),
        }

    def _stop(self, kind: FinishKind, stop_sequence: str | None) -> tuple[str, str | None]:
        if kind in ("stop", "stop_sequence") and stop_sequence is not None:
            return "stop_sequence", stop_sequence
        if kind == "stop" and any(block["type"] == "tool_use" for block in self._blocks):
            return "tool_use", None
        return STOP_REASONS[kind], None

    def _append_text(self, kind: str, text: str) -> list[SSEChunk]:
        """Text or thinking: extend the open block of that kind, or open a new one."""
        if not text:
            return []
        events: list[SSEChunk] = []
        if self._open is None or self._blocks[self._open]["type"] != kind:
            empty = {"type": "text", "text": ""} if kind == "text" else _empty_thinking()
            events += self._close_block() + self._open_block(empty)
        index = self._open
        assert index is not None
        self._blocks[index][kind] += text
        delta = {"type": f"{kind}_delta", kind: text}
        events.append(_event({"type": "content_block_delta", "index": index, "delta": delta}))
        return events

    def _start_tool_use(self, start: ToolCallStart) -> list[SSEChunk]:
        block = {"type": "tool_use", "id": tool_use_id(start.id), "name": start.name, "input": {}}
        events = self._close_block() + self._open_block(block)
        self._tool_blocks[start.index] = len(self._blocks) - 1
        self._arguments[len(self._blocks) - 1] = []
        return events

    def _append_arguments(self, delta: ToolCallArgsDelta) -> list[SSEChunk]:
        index = self._tool_blocks.get(delta.index)
        if index is None or index != self._open:  # no open block to attach them to
            return []
        self._arguments[index].append(delta.text)
        json_delta = {"type": "input_json_delta", "partial_json": delta.text}
        return [_event({"type": "content_block_delta", "index": index, "delta": json_delta})]

    def _open_block(self, block: dict[str, Any]) -> list[SSEChunk]:
        self._blocks.append(block)
        self._open = len(self._blocks) - 1
        start = {"type": "content_block_start", "index": self._open, "content_block": dict(block)}
        return [_event(start)]  # a copy: the block itself keeps growing

    def _close_block(self) -> list[SSEChunk]:
        """Stop the open block; a thinking block gets its (empty) signature first."""
        index, self._open = self._open, None
        if index is None:
            return []
        events: list[SSEChunk] = []
        if self._blocks[index]["type"] == "thinking":
            signature = {"type": "signature_delta", "signature": ""}
            events.append(
                _event({"type": "content_block_delta", "index": index, "delta": signature})
            )
        events.append(_event({"type": "content_block_stop", "index": index}))
        return events

    def _final_block(self, index: int, block: dict[str, Any]) -> dict[str, Any]:
        if block["type"] != "tool_use":
            return dict(block)
        return {**block, "input": _arguments_object("".join(self._arguments[index]))}


def _empty_thinking() -> dict[str, Any]:
    return {"type": "thinking", "thinking": "", "signature": ""}


def _arguments_object(text: str) -> dict[str, Any]:
    """The arguments as an object; partial JSON keeps its complete members, like the SDK."""
    if not text:
        return {}
    try:
        value = from_json(text, allow_partial=True)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
