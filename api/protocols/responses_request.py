"""The Responses request body as pydantic models, for ``/openapi.json``.

``responses.parse`` reads and validates the body; these models describe it: the
input items served (messages, function calls and their outputs, reasoning),
function tools, ``text.format``, ``reasoning``, and the stored-response fields
(``store``, ``background``, ``previous_response_id``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from api.protocols.openai_request_parts import (
    ImageDetail,
    JsonObjectFormat,
    JsonSchemaSpec,
    Metadata,
    OpenBody,
    ReasoningEffort,
    TextFormat,
    TopLogprobs,
    VllmStructuredOutputs,
)

_NonEmpty = Annotated[str, Field(min_length=1)]


class InputText(OpenBody):
    type: Literal["input_text"]
    text: str


class OutputText(OpenBody):
    type: Literal["output_text"]
    text: str
    annotations: list[dict[str, Any]] | None = None


class InputImage(OpenBody):
    type: Literal["input_image"]
    image_url: str | None = Field(
        None, description="An http(s) URL or a data:image/...;base64 URL; required here."
    )
    detail: ImageDetail | None = None


class InputFile(OpenBody):
    type: Literal["input_file"]
    file_data: str | None = Field(
        None, description="An image as a data:image/...;base64 URL; required here."
    )
    filename: str | None = None


class RefusalContent(OpenBody):
    type: Literal["refusal"]
    refusal: str


ResponsesContent = Annotated[
    InputText | OutputText | InputImage | InputFile | RefusalContent,
    Field(discriminator="type"),
]


class MessageItem(OpenBody):
    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ResponsesContent]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(OpenBody):
    type: Literal["function_call"]
    call_id: _NonEmpty
    name: _NonEmpty
    arguments: str | dict[str, Any] = Field(description="The arguments as JSON text.")
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(OpenBody):
    type: Literal["function_call_output"]
    call_id: _NonEmpty
    output: str | list[ResponsesContent]
    id: str | None = None
    status: str | None = None


class SummaryText(OpenBody):
    type: Literal["summary_text"]
    text: str


class ReasoningText(OpenBody):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(OpenBody):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[SummaryText] | None = None
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = Field(None, description="Not readable here: skipped.")


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


class ResponsesStreamOptions(OpenBody):
    include_obfuscation: Literal[False] | None = None


class ResponsesFunctionTool(OpenBody):
    type: Literal["function"]
    name: _NonEmpty
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        None, description="A JSON schema of the arguments; absent: no arguments."
    )
    strict: bool | None = None


class ResponsesNamedToolChoice(OpenBody):
    type: Literal["function"]
    name: _NonEmpty


class ResponsesJsonSchemaFormat(JsonSchemaSpec):
    type: Literal["json_schema"]


class TextConfig(OpenBody):
    format: (
        Annotated[
            TextFormat | JsonObjectFormat | ResponsesJsonSchemaFormat,
            Field(discriminator="type"),
        ]
        | None
    ) = None


class ReasoningConfig(OpenBody):
    effort: ReasoningEffort | None = Field(
        None, description="'none' turns thinking off; any other level turns it on."
    )
    summary: Literal["auto"] | None = Field(None, description="Summaries are not served.")


class ResponsesRequest(OpenBody):
    """``POST /v1/responses``: input to answer, optionally continuing a stored response."""

    model_config = ConfigDict(json_schema_extra={"examples": [{"model": "default", "input": "Hi"}]})

    model: Annotated[str, Field(min_length=1, description="A served model's name or alias.")]
    input: str | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = Field(None, description="A leading system message.")
    tools: list[ResponsesFunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesNamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    previous_response_id: _NonEmpty | None = Field(
        None, description="A stored response whose conversation comes before input."
    )
    store: bool | None = Field(None, description="Keep the response (default true).")
    background: bool | None = Field(None, description="Run as a job and answer at once.")
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_logprobs: TopLogprobs | None = None
    include: list[Literal["message.output_text.logprobs"]] | None = None
    metadata: Metadata | None = None
    user: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    stream: bool | None = None
    stream_options: ResponsesStreamOptions | None = None
    structured_outputs: VllmStructuredOutputs | None = Field(None, description="vLLM's extension.")
