"""The (legacy) Completions request body as a pydantic model, for ``/openapi.json``.

``completions.parse`` reads and validates the body; this model describes it. The
sampling fields and vLLM's extensions are those Chat Completions takes.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import ConfigDict, Field

from api.protocols.openai_request_parts import SamplingFields, TokenIds, TopLogprobs

CompletionPrompt = str | list[str] | TokenIds | list[TokenIds]


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: a prompt to continue, taken as it is (no chat template)."""

    model_config = ConfigDict(
        json_schema_extra={"examples": [{"model": "default", "prompt": "Once upon a time"}]}
    )

    prompt: CompletionPrompt = Field(
        description="A string, token ids, or a list of either: one choice per prompt."
    )
    echo: bool | None = Field(None, description="Start the text with the prompt.")
    suffix: str | None = Field(None, description="Not served: only an empty suffix is accepted.")
    best_of: Annotated[int, Field(ge=1)] | None = Field(None, description="Only 1 is served.")
    logprobs: TopLogprobs | None = Field(
        None, description="Alternatives to report per token; with echo, for the prompt too."
    )
    max_tokens: Annotated[int, Field(ge=0)] | None = Field(
        None, description="Default 16; 0 with echo scores the prompt and generates nothing."
    )
