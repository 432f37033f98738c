"""The Responses request body as pydantic models: documented and validated.

``responses.parse`` validates a body against ``ResponsesRequest`` and maps it; what
the types cannot say (a named tool choice among ``tools``, an image's URL syntax, an
``include`` value not served, ``background`` without ``store``) the mapping refuses.
The models hold the input items served (messages, function calls and their outputs,
reasoning), function tools, ``text.format``, ``reasoning``, the stored-response fields
(``store``, ``background``, ``previous_response_id``) and vLLM's
``structured_outputs``. Items are chosen by ``type`` (a message may leave it out: its
``role`` says what it is), messages by ``role`` and content parts by ``type``, so an
error names the field inside the item or part.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from api.protocols.body_validation import accepts, by_json_kind, tagged_union
from api.protocols.openai_request_parts import (
    ImageDetail,
    JsonObjectFormat,
    JsonSchemaObject,
    JsonSchemaSpec,
    Metadata,
    NonEmptyString,
    OpenBody,
    ReasoningEffort,
    TextFormat,
    TopLogprobs,
    VllmStructuredOutputs,
    integer,
    number,
)

LOGPROBS_INCLUDE = "message.output_text.logprobs"
_BUILT_IN = "'function' (built-in tools such as web_search are not supported)"
_URL = accepts("a URL string")


class InputText(OpenBody):
    type: Literal["input_text"]
    text: str


class OutputText(OpenBody):
    type: Literal["output_text"]
    text: str
    annotations: list[dict[str, Any]] | None = None


class InputImage(OpenBody):
    type: Literal["input_image"]
    image_url: Annotated[str, _URL] | None = Field(
        None, description="An http(s) URL or a data:image/...;base64 URL; required here."
    )
    file_id: str | None = Field(None, description="Not served: files are not stored here.")
    detail: ImageDetail | None = None


class InputFile(OpenBody):
    type: Literal["input_file"]
    file_data: Annotated[str, _URL] | None = Field(
        None, description="An image as a data:image/...;base64 URL; required here."
    )
    filename: str | None = None


class RefusalContent(OpenBody):
    type: Literal["refusal"]
    refusal: str


InputContent = InputText | OutputText | InputImage | InputFile | RefusalContent


def _content(*parts: type[OpenBody], speaker: str) -> Any:
    """A string, or an array of the content parts ``speaker`` may send."""
    part = tagged_union("type", *parts, where=f" in a {speaker}")
    return by_json_kind("a string or an array of content parts", string=str, array=list[part])


class _Message(OpenBody):
    type: Literal["message"] | None = Field(None, description="May be left out.")
    id: str | None = None
    status: str | None = None


class UserMessageItem(_Message):
    role: Literal["user"]
    content: _content(InputText, OutputText, InputImage, InputFile, speaker="user message")


class SystemMessageItem(_Message):
    role: Literal["system"]
    content: _content(InputText, OutputText, speaker="system message")


class DeveloperMessageItem(_Message):
    role: Literal["developer"]
    content: _content(InputText, OutputText, speaker="developer message")


class AssistantMessageItem(_Message):
    role: Literal["assistant"]
    content: _content(OutputText, InputText, RefusalContent, speaker="assistant message")


MessageItem = tagged_union(
    "role", UserMessageItem, SystemMessageItem, DeveloperMessageItem, AssistantMessageItem
)


class FunctionCallItem(OpenBody):
    type: Literal["function_call"]
    arguments: Annotated[str | dict[str, Any], accepts("a JSON string")] = Field(
        description="The arguments as JSON text."
    )
    call_id: NonEmptyString
    name: NonEmptyString
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(OpenBody):
    type: Literal["function_call_output"]
    call_id: NonEmptyString
    output: _content(InputText, OutputText, InputImage, InputFile, speaker="function_call_output")
    id: str | None = None
    status: str | None = None


class SummaryText(OpenBody):
    type: Literal["summary_text"]
    text: str


class ReasoningText(OpenBody):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(OpenBody):
    """An earlier turn's reasoning: its text, or else its summary, opens the next turn."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[SummaryText] | None = None
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = Field(None, description="Not readable here: skipped.")


def _a_message(item: dict[str, Any]) -> str | None:
    """An item without ``type`` is a message when it has a ``role``."""
    return "message" if item.get("role") is not None else None


InputItem = tagged_union(
    "type",
    ("message", MessageItem),
    FunctionCallItem,
    FunctionCallOutputItem,
    ReasoningItem,
    implied=_a_message,
    refused={"item_reference": "an inline item: item_reference needs stored items"},
)
INPUT_ACCEPTED = "a string or a non-empty array of input items"
# at least one item: the mapping refuses an empty array with its own message
_Input = by_json_kind(
    INPUT_ACCEPTED,
    string=str,
    array=Annotated[list[InputItem], Field(json_schema_extra={"minItems": 1})],
)


class ResponsesStreamOptions(OpenBody):
    include_obfuscation: Literal[False] | None = None


class ResponsesFunctionTool(OpenBody):
    type: Annotated[Literal["function"], accepts(_BUILT_IN)]
    name: NonEmptyString
    description: str | None = None
    parameters: JsonSchemaObject | None = Field(
        None, description="A JSON schema of the arguments; absent: no arguments."
    )
    strict: bool | None = None


class ResponsesNamedToolChoice(OpenBody):
    type: Annotated[Literal["function"], accepts(_BUILT_IN)]
    name: NonEmptyString


_TOOL_CHOICES = """'none', 'auto', 'required' or {"type": "function", "name": ...}"""
ResponsesToolChoice = by_json_kind(
    _TOOL_CHOICES,
    string=Annotated[Literal["none", "auto", "required"], accepts(_TOOL_CHOICES)],
    object=ResponsesNamedToolChoice,
)


class ResponsesJsonSchemaFormat(JsonSchemaSpec):
    type: Literal["json_schema"]


class TextConfig(OpenBody):
    format: tagged_union("type", TextFormat, JsonObjectFormat, ResponsesJsonSchemaFormat) | None = (
        None
    )


class ReasoningConfig(OpenBody):
    effort: ReasoningEffort | None = Field(
        None, description="'none' turns thinking off; any other level turns it on."
    )
    summary: Literal["auto"] | None = Field(None, description="Summaries are not served.")


# Only the logprobs are served; the mapping refuses another value with its own message.
_Include = Annotated[str, Field(json_schema_extra={"enum": [LOGPROBS_INCLUDE]})]


class ResponsesRequest(OpenBody):
    """``POST /v1/responses``: input to answer, optionally continuing a stored response."""

    model_config = ConfigDict(json_schema_extra={"examples": [{"model": "default", "input": "Hi"}]})

    model: NonEmptyString = Field(description="A served model's name or alias.")
    input: _Input
    instructions: str | None = Field(None, description="A leading system message.")
    tools: list[ResponsesFunctionTool] | None = None
    tool_choice: ResponsesToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    previous_response_id: NonEmptyString | None = Field(
        None, description="A stored response whose conversation comes before input."
    )
    store: bool | None = Field(None, description="Keep the response (default true).")
    background: bool | None = Field(None, description="Run as a job and answer at once.")
    max_output_tokens: integer(low=1) | None = None
    temperature: number(0, 2) | None = None
    top_p: number(0, 1, low_open=True) | None = None
    top_logprobs: TopLogprobs | None = None
    include: list[_Include] | None = None
    metadata: Metadata | None = None
    user: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    stream: bool | None = None
    stream_options: ResponsesStreamOptions | None = None
    structured_outputs: VllmStructuredOutputs | None = Field(None, description="vLLM's extension.")
