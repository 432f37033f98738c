"""Inference events as Redis Stream entries, and back.

An entry has four fields: ``a`` (the attempt that wrote it), ``s`` (its
sequence number within that attempt, from 1), ``k`` (the event kind) and
``d`` (compact JSON of the rest). The stream entry id orders events and is
what SSE ``Last-Event-ID`` resumes from; ``(a, s)`` names an event
independently of the entry, so a write repeated after a lost reply can be
recognised and skipped, by the writing script and by readers.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from shared.events import (
    Accepted,
    Error,
    Finish,
    FinishReason,
    InferenceEvent,
    Ready,
    Text,
    TokenLogprob,
)

_SEPARATORS = (",", ":")


class Entry(NamedTuple):
    """One decoded stream entry."""

    attempt: int
    seq: int
    event: InferenceEvent


def encode_event(event: InferenceEvent, attempt: int, seq: int) -> dict[str, str]:
    """Stream fields for ``event``, the ``seq``-th event written by ``attempt``."""
    match event:
        case Accepted():
            kind, body = "a", []
        case Ready():
            kind, body = "r", [event.prompt_tokens, event.cached_tokens]
            if event.prompt_logprobs is not None:
                body.append(_encode_logprobs(event.prompt_logprobs))
        case Text():
            kind, body = "t", [event.text, event.token_ids, _encode_logprobs(event.logprobs)]
        case Finish():
            kind, body = "f", [event.reason.value, event.completion_tokens, event.stop]
        case Error():
            kind, body = "e", [event.message, event.kind]
        case _:
            raise TypeError(f"not an inference event: {event!r}")
    data = json.dumps(body, separators=_SEPARATORS)
    return {"a": str(attempt), "s": str(seq), "k": kind, "d": data}


def decode_entry(request_id: str, fields: dict[Any, Any]) -> Entry:
    """An entry from its stream fields (bytes or str keys and values)."""
    get = _getter(fields)
    return Entry(int(get("a")), int(get("s")), _event(request_id, get("k"), json.loads(get("d"))))


def _event(request_id: str, kind: str, body: list[Any]) -> InferenceEvent:
    match kind:
        case "a":
            return Accepted(request_id)
        case "r":
            prompt_logprobs = _decode_logprobs(body[2]) if len(body) > 2 else None
            return Ready(request_id, body[0], body[1], prompt_logprobs)
        case "t":
            return Text(request_id, body[0], body[1], _decode_logprobs(body[2]) or None)
        case "f":
            return Finish(request_id, FinishReason(body[0]), body[1], body[2])
        case "e":
            return Error(request_id, body[0], body[1])
    raise ValueError(f"unknown event kind {kind!r} in stream of {request_id}")


def _encode_logprobs(logprobs: list[TokenLogprob] | None) -> list[list[Any]] | None:
    return [[lp.token_id, lp.logprob, lp.top] for lp in logprobs] if logprobs else None


def _decode_logprobs(body: list[list[Any]] | None) -> list[TokenLogprob]:
    return [TokenLogprob(t, lp, [tuple(x) for x in top]) for t, lp, top in body or []]


def _getter(fields: dict[Any, Any]):  # noqa: ANN202
    def get(key: str) -> str:
        value = fields[key] if key in fields else fields[key.encode()]
        return value.decode() if isinstance(value, bytes) else value

    return get
