"""Sampling parameters: the part of a request the engine's sampler obeys.

They live in ``shared`` because the API resolves them and the workers receive
them over the wire; the engine only reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_TOP_LOGPROBS = 20


@dataclass(slots=True)
class SamplingParams:
    """Everything that decides which token comes next and when to stop.

    ``temperature == 0`` means greedy. ``seed`` makes sampling reproducible and
    independent of whatever else shares the batch: each request draws from its
    own generator.
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def validate(self) -> None:
        """Raise ValueError naming the field, the value and what is accepted."""
        checks: list[tuple[bool, str]] = [
            (self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}"),
            (
                self.min_tokens <= self.max_tokens,
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
            ),
            (self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be >= 0 (0 disables it), got {self.top_k}"),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            (
                -2.0 <= self.presence_penalty <= 2.0,
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
            ),
            (
                -2.0 <= self.frequency_penalty <= 2.0,
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
            ),
            (
                self.repetition_penalty > 0.0,
                f"repetition_penalty must be > 0, got {self.repetition_penalty}",
            ),
            (
                self.logprobs is None or 0 <= self.logprobs <= MAX_TOP_LOGPROBS,
                f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
