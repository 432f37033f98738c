"""Inference events as Redis Stream entries, and back.

An entry has three fields: ``a`` (the attempt that wrote it), ``k`` (the
event kind) and ``d`` (compact JSON of the rest). The stream entry id orders
events and is what SSE ``Last-Event-ID`` resumes from.
"""

from __future__ import annotations

import json
from typing import Any

from shared.events import Error, Finish, FinishReason, InferenceEvent, Ready, Text, TokenLogprob

_SEPARATORS = (",", ":")


def encode_event(event: InferenceEvent, attempt: int) -> dict[str, str]:
    """Stream fields for ``event`` written by ``attempt``."""
    match event:
        case Ready():
            kind, body = "r", [event.prompt_tokens, event.cached_tokens]
        case Text():
            logprobs = (
                [[lp.token_id, lp.logprob, lp.top] for lp in event.logprobs]
                if event.logprobs
                else None
            )
            kind, body = "t", [event.text, event.token_ids, logprobs]
        case Finish():
            kind, body = "f", [event.reason.value, event.completion_tokens, event.stop]
        case Error():
            kind, body = "e", [event.message, event.kind]
        case _:
            raise TypeError(f"not an inference event: {event!r}")
    return {"a": str(attempt), "k": kind, "d": json.dumps(body, separators=_SEPARATORS)}


def decode_event(request_id: str, fields: dict[Any, Any]) -> tuple[int, InferenceEvent]:
    """``(attempt, event)`` from stream fields (bytes or str keys and values)."""
    get = _getter(fields)
    attempt, kind, body = int(get("a")), get("k"), json.loads(get("d"))
    match kind:
        case "r":
            return attempt, Ready(request_id, body[0], body[1])
        case "t":
            logprobs = (
                [TokenLogprob(t, lp, [tuple(x) for x in top]) for t, lp, top in body[2]]
                if body[2]
                else None
            )
            return attempt, Text(request_id, body[0], body[1], logprobs)
        case "f":
            return attempt, Finish(request_id, FinishReason(body[0]), body[1], body[2])
        case "e":
            return attempt, Error(request_id, body[0], body[1])
    raise ValueError(f"unknown event kind {kind!r} in stream of {request_id}")


def _getter(fields: dict[Any, Any]):  # noqa: ANN202
    def get(key: str) -> str:
        value = fields[key] if key in fields else fields[key.encode()]
        return value.decode() if isinstance(value, bytes) else value

    return get
