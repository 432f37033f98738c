"""Pieces the OpenAI request models share: the base, formats, functions, sampling fields.

The request models document bodies in ``/openapi.json``; the protocols' own readers
(``openai_common.Fields``) still validate every body and name the field of a 400.
The models follow the OpenAI API reference for names and types, and list the values
this server serves where it serves fewer (a custom tool, ``n`` beyond a synchronous
request). Unknown fields of a protocol body are allowed: the server reports them as
ignored, or refuses them by name (``api.protocols.unsupported``). An envelope whose
reader refuses every field it does not name (``/tokenize``, ``/v1/batches``) is a
``ClosedBody``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from api.protocols.openai_common import MAX_CHOICES, MAX_STOP_SEQUENCES, MAX_TOP_LOGPROBS
from shared.sampling import MAX_LOGIT_BIAS


class OpenBody(BaseModel):
    """A wire shape: unknown fields are allowed, values are never coerced."""

    model_config = ConfigDict(extra="allow", strict=True)


class ClosedBody(OpenBody):
    """A wire shape whose reader refuses the fields it does not name (an envelope)."""

    model_config = ConfigDict(extra="forbid")


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
ImageDetail = Literal["auto", "low", "high", "original"]
Metadata = Annotated[
    dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
    Field(max_length=16, description="Up to 16 string pairs, echoed in the response."),
]
TokenIds = Annotated[list[int], Field(min_length=1)]
_StopString = Annotated[str, Field(min_length=1)]
Stop = _StopString | Annotated[list[_StopString], Field(max_length=MAX_STOP_SEQUENCES)]
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]


class TextFormat(OpenBody):
    type: Literal["text"]


class JsonObjectFormat(OpenBody):
    type: Literal["json_object"]


class JsonSchemaSpec(OpenBody):
    """A JSON schema the answer must follow."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema", description="The JSON schema.")
    strict: bool | None = None


class FunctionDefinition(OpenBody):
    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        None, description="A JSON schema of the arguments; absent: no arguments."
    )
    strict: bool | None = None


class StreamOptions(OpenBody):
    include_usage: bool | None = Field(None, description="End the stream with a usage chunk.")
    include_obfuscation: Literal[False] | None = None


class VllmStructuredOutputs(OpenBody):
    """vLLM's constraint on the output: exactly one of the fields."""

    json_: dict[str, Any] | str | None = Field(None, alias="json", description="A JSON schema.")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = Field(None, description="A context-free grammar (EBNF).")


class SamplingFields(OpenBody):
    """What Chat Completions and Completions share, with vLLM's sampling extensions."""

    model: Annotated[str, Field(min_length=1, description="A served model's name or alias.")]
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = Field(
        None, description="Choices to generate; above 1 only on the synchronous route."
    )
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    seed: int | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    stop: Stop | None = Field(None, description="Strings that end the answer.")
    logit_bias: dict[str, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]] | None = (
        Field(None, description="Token ids (as strings) to a bias added to their logits.")
    )
    user: str | None = None
    # vLLM's extensions
    top_k: Annotated[int, Field(ge=-1)] | None = Field(None, description="-1 or 0: no top-k.")
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    priority: int | None = Field(None, description="Lower runs first.")
    structured_outputs: VllmStructuredOutputs | None = None
