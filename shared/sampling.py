"""Sampling parameters: the part of a request the engine's sampler obeys.

They live in ``shared`` because the API resolves them and the workers receive
them over the wire; the engine only reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0
GREEDY_BELOW = 1e-5  # as vLLM: a temperature this small samples the argmax anyway


@dataclass(slots=True)
class StructuredOutputs:
    """What the output must match: exactly one of the fields, vLLM's names.

    ``json`` is a JSON schema (an object or its JSON text), ``json_object`` any
    JSON object, ``regex`` a full-match regular expression, ``choice`` one of
    the strings, ``grammar`` a grammar in llguidance's Lark syntax (or its JSON
    grammar form). ``shared.constraints`` turns it into the grammar the engine
    matches.
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in _STRUCTURED_KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of "
                f"{', '.join(_STRUCTURED_KINDS)}, got {', '.join(given) or 'none'}"
            )
        if self.choice is not None and (
            not isinstance(self.choice, list)
            or not self.choice
            or not all(isinstance(option, str) for option in self.choice)
        ):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.json is not None and not isinstance(self.json, dict | str):
            raise ValueError("structured_outputs.json must be a JSON schema object")

    def to_dict(self) -> dict[str, Any]:
        """The one field that is set, JSON-ready."""
        return {name: getattr(self, name) for name in _STRUCTURED_KINDS if getattr(self, name)}


_STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(slots=True)
class SamplingParams:
    """Everything that decides which token comes next and when to stop.

    ``temperature == 0`` means greedy. ``seed`` makes sampling reproducible and
    independent of whatever else shares the batch: each request draws from its
    own generator. ``prompt_logprobs`` asks for the log-probability of each
    prompt token after the first (computed in prefill, so the prompt is never
    read from the prefix cache); with it, ``max_tokens`` may be 0: prefill only.
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
    prompt_logprobs: int | None = None  # top alternatives per prompt token; None = none
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] = field(default_factory=dict)
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):  # as it crosses the wire
            self.structured_outputs = StructuredOutputs(**self.structured_outputs)
        self.logit_bias = {int(token): float(bias) for token, bias in self.logit_bias.items()}
        self.validate()

    @property
    def greedy(self) -> bool:
        """Temperatures below ``GREEDY_BELOW`` are greedy: dividing by them overflows."""
        return self.temperature < GREEDY_BELOW

    def validate(self) -> None:
        """Raise ValueError naming the field, the value and what is accepted."""
        checks: list[tuple[bool, str]] = [
            (
                self.max_tokens >= 1 or (self.max_tokens == 0 and self.prompt_logprobs is not None),
                f"max_tokens must be >= 1 (0 only with prompt_logprobs), got {self.max_tokens}",
            ),
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
            (
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS,
                f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs}",
            ),
            (
                all(abs(bias) <= MAX_LOGIT_BIAS for bias in self.logit_bias.values()),
                f"logit_bias values must be between -{MAX_LOGIT_BIAS:g} and {MAX_LOGIT_BIAS:g}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
