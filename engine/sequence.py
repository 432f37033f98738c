"""One request's tokens and its place in the KV cache."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import TYPE_CHECKING, Any

from engine.detokenizer import OutputText
from shared.events import FinishReason, TokenLogprob
from shared.prefix_hash import ImageSpan
from shared.sampling import SamplingParams

if TYPE_CHECKING:
    from engine.vision import SequenceVision

_arrival = itertools.count()


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass(slots=True, eq=False)
class Sequence:
    """A request as the engine sees it: token ids, progress and cache pages.

    ``token_ids`` holds prompt and generated tokens together. The first
    ``num_computed_tokens`` of them have their keys and values in the cache;
    a step computes the next chunk, and a chunk that reaches the end of
    ``token_ids`` yields one sampled token. Preemption resets the progress to
    zero and keeps the tokens, so recomputation reproduces the same state.
    """

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    arrival: int = field(default_factory=lambda: next(_arrival))
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # one per committed full block
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    announced: bool = False  # whether the Ready event went out
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    # With prompt logprobs asked for: those of prompt tokens 1, 2, … computed so far.
    prompt_logprobs: list[TokenLogprob] | None = None
    seed: int = 0  # resolved at admission when the request gave none
    stop_token_ids: frozenset[int] = frozenset()
    output: OutputText | None = None
    matcher: Any = None  # the llguidance matcher of a constrained sequence (engine.constraints)
    images: list[ImageSpan] = field(default_factory=list)  # where the prompt's images are
    vision: SequenceVision | None = None  # decoded pictures, then their features

    def __post_init__(self) -> None:
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.token_ids)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether prompt logprobs are still to compute (the prompt must not come from cache)."""
        done = self.prompt_logprobs
        return done is not None and len(done) < self.num_prompt_tokens - 1

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def sort_key(self) -> tuple[int, int]:
        """Lower priority value first, then first come first served."""
        return (self.priority, self.arrival)
