"""Inference events: what an engine step says about one request.

The engine emits them, the workers put them on the wire and the API turns them
into protocol chunks, so they are plain dataclasses with no torch inside.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class FinishReason(StrEnum):
    STOP = "stop"  # an eos / stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # cancelled by the caller


@dataclass(slots=True)
class TokenLogprob:
    """Log-probability of the chosen token and its top alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class Accepted:
    """Sent once, when an engine has taken the request in: it will run unless it is
    cancelled or misses a deadline, so a response's status is known before its prompt
    is computed."""

    request_id: str


@dataclass(slots=True)
class Ready:
    """Sent once, when the prompt has been scheduled: usage known up front.

    A request that asked for prompt logprobs gets its ``Ready`` once its
    prompt is computed, carrying one entry per prompt token after the first.
    """

    request_id: str
    prompt_tokens: int
    cached_tokens: int
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass(slots=True)
class Text:
    """Newly decoded text and the token ids that produced it.

    ``text`` may be empty while the detokenizer holds back half a UTF-8
    character or a possible stop string; the token ids are still reported so
    that usage and resumption stay exact.
    """

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None


@dataclass(slots=True)
class Finish:
    request_id: str
    reason: FinishReason
    completion_tokens: int
    stop: str | int | None = None  # the stop string or token id that ended it


@dataclass(slots=True)
class Error:
    request_id: str
    message: str
    kind: str = "internal_error"


InferenceEvent = Accepted | Ready | Text | Finish | Error
