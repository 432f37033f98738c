"""The (legacy) Completions request body as a pydantic model: documented and validated.

``completions.parse`` validates a body against ``CompletionRequest`` and maps it;
what the types cannot say (a prompt list holding several prompts outside the
synchronous route, ``max_tokens: 0`` without ``echo``, ``best_of`` or ``n`` above
1) the mapping refuses. The sampling fields and vLLM's extensions are those Chat
Completions takes.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import ConfigDict, Field

from api.protocols.body_validation import accepts
from api.protocols.openai_request_parts import SamplingFields, TokenIds, TopLogprobs, integer

# What a Completions body (and ``/tokenize``) takes: several prompts (text and token ids
# mixed) are one choice each.
Prompts = Annotated[
    str | TokenIds | list[str | TokenIds],
    accepts("a string, an array of token ids, or an array holding one of either"),
]


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: a prompt to continue, taken as it is (no chat template)."""

    model_config = ConfigDict(
        json_schema_extra={"examples": [{"model": "default", "prompt": "Once upon a time"}]}
    )

    prompt: Prompts = Field(
        description="A string, token ids, or a list of either: one choice per prompt."
    )
    echo: bool | None = Field(None, description="Start the text with the prompt.")
    suffix: str | None = Field(None, description="Not served: only an empty suffix is accepted.")
    best_of: integer(low=1) | None = Field(None, description="Only 1 is served.")
    logprobs: TopLogprobs | None = Field(
        None, description="Alternatives to report per token; with echo, for the prompt too."
    )
    max_tokens: integer(low=0) | None = Field(
        None, description="Default 16; 0 with echo scores the prompt and generates nothing."
    )
