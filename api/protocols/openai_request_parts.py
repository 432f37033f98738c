"""Pieces the OpenAI request models share: the base, field types, formats, functions,
sampling fields.

A protocol's request model is what ``/openapi.json`` documents and what
``body_validation.validated`` checks a body against, with the ``openai_error``
phrasing. The field types here carry the phrase a 400 uses for what they accept
(``integer``, ``number``, ``one_of``, ``accepts``): ``temperature must be a number
between 0 and 2, got 7``. ``null`` is absent for every optional field, as the OpenAI
API treats it. The models follow the OpenAI API reference for names and types, and
list the values this server serves where it serves fewer (a custom tool, ``n`` beyond
a synchronous request). Unknown fields of a protocol body are allowed: the server
reports them as ignored (``model_extra``), or refuses them by name
(``api.protocols.unsupported``). An envelope whose reader refuses every field it
does not name (``/tokenize``, ``/v1/batches``) is a ``ClosedBody``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from api.protocols.body_validation import accepts
from api.protocols.openai_common import (
    LARGEST,
    MAX_CHOICES,
    MAX_STOP_SEQUENCES,
    MAX_TOP_LOGPROBS,
    REASONING_EFFORTS,
    integer_range,
    number_range,
)
from api.protocols.vllm_extensions import read_structured_outputs
from shared.conversation import IMAGE_DETAILS, ResponseFormat
from shared.sampling import MAX_LOGIT_BIAS, StructuredOutputs


class OpenBody(BaseModel):
    """A wire shape: unknown fields are allowed, values are never coerced."""

    model_config = ConfigDict(extra="allow", strict=True)


class ClosedBody(OpenBody):
    """A wire shape whose reader refuses the fields it does not name (an envelope)."""

    model_config = ConfigDict(extra="forbid")


def integer(low: int | None = None, high: int | None = None) -> Any:
    """An integer in ``[low, high]`` (a bound left out is open); ``16.0`` reads as 16."""
    return Annotated[int, Field(ge=low, le=high), accepts(integer_range(low, high), integral=True)]


def number(low: float, high: float | None = None, *, low_open: bool = False) -> Any:
    """A finite number from ``low`` (excluded with ``low_open``) up to ``high``."""
    bounds = Field(
        gt=low if low_open else None,
        ge=None if low_open else low,
        le=LARGEST if high is None else high,
        allow_inf_nan=False,
    )
    return Annotated[float, bounds, accepts(number_range(low, high, low_open))]


def one_of(*values: str) -> Any:
    """One of the strings ``values``."""
    return Annotated[
        Literal[values],  # type: ignore[valid-type]
        accepts("one of " + ", ".join(repr(value) for value in values)),
    ]


NonEmptyString = Annotated[str, Field(min_length=1), accepts("a non-empty string")]
ReasoningEffort = one_of(*REASONING_EFFORTS)
ImageDetail = one_of(*IMAGE_DETAILS)
Metadata = Annotated[
    dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
    Field(max_length=16, description="Up to 16 string pairs, echoed in the response."),
    accepts("an object of at most 16 string values (keys up to 64, values up to 512 characters)"),
]
TokenIds = Annotated[list[int], Field(min_length=1)]
_StopString = Annotated[str, Field(min_length=1)]
Stop = Annotated[
    _StopString | Annotated[list[_StopString], Field(max_length=MAX_STOP_SEQUENCES)],
    accepts(f"a non-empty string or a list of at most {MAX_STOP_SEQUENCES} non-empty strings"),
]
TopLogprobs = integer(0, MAX_TOP_LOGPROBS)
_TokenIdKey = Annotated[str, Field(pattern=r"^\s*-?[0-9]+\s*$")]
LogitBias = Annotated[
    dict[
        _TokenIdKey,
        Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS, allow_inf_nan=False)],
    ],
    accepts(
        f"an object mapping token ids to numbers between -{MAX_LOGIT_BIAS:g} and {MAX_LOGIT_BIAS:g}"
    ),
]
StopTokenIds = Annotated[list[int], accepts("an array of token ids (integers)")]


JsonSchemaObject = Annotated[dict[str, Any], accepts("a JSON schema object")]


class TextFormat(OpenBody):
    type: Literal["text"]


class JsonObjectFormat(OpenBody):
    type: Literal["json_object"]


class JsonSchemaSpec(OpenBody):
    """A JSON schema the answer must follow."""

    name: str | None = None
    description: str | None = None
    schema_: JsonSchemaObject = Field(alias="schema", description="The JSON schema.")
    strict: bool | None = None

    def response_format(self, param: str) -> ResponseFormat:
        """The format; ``param`` is the schema's path, cited when the schema is refused."""
        return ResponseFormat(
            "json_schema",
            schema=self.schema_,
            name=self.name,
            strict=bool(self.strict),
            param=param,
        )


class FunctionDefinition(OpenBody):
    name: NonEmptyString
    description: str | None = None
    parameters: JsonSchemaObject | None = Field(
        None, description="A JSON schema of the arguments; absent: no arguments."
    )
    strict: bool | None = None


class StreamOptions(OpenBody):
    include_usage: bool | None = Field(None, description="End the stream with a usage chunk.")
    include_obfuscation: Literal[False] | None = None


_JsonSchemaOrText = Annotated[
    dict[str, Any] | str, accepts("a JSON schema object or its JSON text")
]


class VllmStructuredOutputs(OpenBody):
    """vLLM's constraint on the output: exactly one of the fields."""

    json_: _JsonSchemaOrText | None = Field(None, alias="json", description="A JSON schema.")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = Field(None, description="A context-free grammar (EBNF).")

    def constraint(self) -> StructuredOutputs | None:
        """The constraint, checked for exactly one known field (the fields sent, by their
        wire names)."""
        return read_structured_outputs(self.model_dump(by_alias=True, exclude_unset=True))


class SamplingFields(OpenBody):
    """What Chat Completions and Completions share, with vLLM's sampling extensions."""

    model: NonEmptyString = Field(description="A served model's name or alias.")
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    # ``choices.copies`` refuses more than MAX_CHOICES before a body is validated.
    n: integer(low=1) | None = Field(
        None,
        description="Choices to generate; above 1 only on the synchronous route.",
        json_schema_extra={"maximum": MAX_CHOICES},
    )
    temperature: number(0, 2) | None = None
    top_p: number(0, 1, low_open=True) | None = None
    seed: integer() | None = None
    presence_penalty: number(-2, 2) | None = None
    frequency_penalty: number(-2, 2) | None = None
    stop: Stop | None = Field(None, description="Strings that end the answer.")
    logit_bias: LogitBias | None = Field(
        None, description="Token ids (as strings) to a bias added to their logits."
    )
    user: str | None = None
    # vLLM's extensions
    top_k: integer(low=-1) | None = Field(None, description="-1 or 0: no top-k.")
    min_p: number(0, 1) | None = None
    repetition_penalty: number(0, low_open=True) | None = None
    min_tokens: integer(low=0) | None = None
    ignore_eos: bool | None = None
    stop_token_ids: StopTokenIds | None = None
    skip_special_tokens: bool | None = None
    priority: integer() | None = Field(None, description="Lower runs first.")
    structured_outputs: VllmStructuredOutputs | None = None

    def sampling(self) -> dict[str, Any]:
        """The sampling fields as ``GenerationRequest`` keywords: absent ones as its defaults,
        vLLM's "no top-k" (-1) as the sampler's (0)."""
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": 0 if self.top_k == -1 else self.top_k,
            "min_p": self.min_p,
            "seed": self.seed,
            "presence_penalty": self.presence_penalty or 0.0,
            "frequency_penalty": self.frequency_penalty or 0.0,
            "repetition_penalty": self.repetition_penalty,
            "stop": [self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            "skip_special_tokens": self.skip_special_tokens is not False,
            "priority": self.priority,
            "stop_token_ids": list(self.stop_token_ids or []),
            "min_tokens": self.min_tokens or 0,
            "ignore_eos": bool(self.ignore_eos),
            "logit_bias": {int(key): bias for key, bias in (self.logit_bias or {}).items()},
            "structured_outputs": self.structured(),
        }

    def include_usage(self) -> bool:
        """``stream_options.include_usage``, which only a stream honours."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def structured(self) -> StructuredOutputs | None:
        """``structured_outputs``, checked for exactly one known constraint."""
        return None if self.structured_outputs is None else self.structured_outputs.constraint()
