"""The Chat Completions request body as pydantic models, for ``/openapi.json``.

``chat_completions.parse`` reads and validates the body; these models describe it:
the OpenAI fields served, vLLM's extensions (``top_k``, ``structured_outputs``,
``chat_template_kwargs``, ...), DeepSeek's ``reasoning_content`` and ``prefix``
on assistant messages, and the ``latest_reminder`` role.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from api.protocols.openai_request_parts import (
    FunctionDefinition,
    ImageDetail,
    JsonObjectFormat,
    JsonSchemaSpec,
    Metadata,
    OpenBody,
    ReasoningEffort,
    SamplingFields,
    TextFormat,
    TopLogprobs,
)


class ChatTextPart(OpenBody):
    type: Literal["text"]
    text: str


class ChatImageUrl(OpenBody):
    url: str = Field(description="An http(s) URL or a data:image/...;base64 URL.")
    detail: ImageDetail | None = None


class ChatImagePart(OpenBody):
    type: Literal["image_url"]
    image_url: ChatImageUrl | str


class ChatRefusalPart(OpenBody):
    type: Literal["refusal"]
    refusal: str


_TextContent = str | list[ChatTextPart]
_UserPart = Annotated[ChatTextPart | ChatImagePart, Field(discriminator="type")]
_AssistantPart = Annotated[ChatTextPart | ChatRefusalPart, Field(discriminator="type")]


class ChatSystemMessage(OpenBody):
    role: Literal["system"]
    content: _TextContent


class ChatDeveloperMessage(OpenBody):
    role: Literal["developer"]
    content: _TextContent


class ChatUserMessage(OpenBody):
    role: Literal["user"]
    content: str | list[_UserPart]


class ChatFunctionCall(OpenBody):
    name: Annotated[str, Field(min_length=1)]
    arguments: str | dict[str, Any] = Field(description="The arguments as JSON text.")


class ChatToolCall(OpenBody):
    id: Annotated[str, Field(min_length=1)]
    type: Literal["function"] | None = None
    function: ChatFunctionCall


class ChatAssistantMessage(OpenBody):
    role: Literal["assistant"]
    content: str | list[_AssistantPart] | None = None
    tool_calls: list[ChatToolCall] | None = None
    reasoning_content: str | None = Field(None, description="This turn's reasoning (DeepSeek).")
    reasoning: str | None = Field(None, description="This turn's reasoning (vLLM's name).")
    prefix: bool | None = Field(None, description="Continue this final turn's text (DeepSeek).")


class ChatToolMessage(OpenBody):
    role: Literal["tool"]
    content: _TextContent
    tool_call_id: Annotated[str, Field(min_length=1)]
    name: str | None = None


class ChatReminderMessage(OpenBody):
    """A reminder placed after the last user turn, where the model's format has one."""

    role: Literal["latest_reminder"]
    content: _TextContent


ChatMessage = Annotated[
    ChatSystemMessage
    | ChatDeveloperMessage
    | ChatUserMessage
    | ChatAssistantMessage
    | ChatToolMessage
    | ChatReminderMessage,
    Field(discriminator="role"),
]


class ChatFunctionTool(OpenBody):
    type: Literal["function"]
    function: FunctionDefinition


class ChatFunctionName(OpenBody):
    name: Annotated[str, Field(min_length=1)]


class ChatNamedToolChoice(OpenBody):
    type: Literal["function"]
    function: ChatFunctionName


class ChatJsonSchemaFormat(OpenBody):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ChatResponseFormat = Annotated[
    TextFormat | JsonObjectFormat | ChatJsonSchemaFormat, Field(discriminator="type")
]


class ChatThinking(OpenBody):
    type: Literal["enabled", "disabled"]


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``: a conversation to answer."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [{"model": "default", "messages": [{"role": "user", "content": "Hi"}]}]
        }
    )

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: list[ChatFunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ChatNamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ChatResponseFormat | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = Field(None, description="Needs logprobs: true.")
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = Field(
        None, description="Wins over max_tokens when both are sent."
    )
    reasoning_effort: ReasoningEffort | None = Field(
        None, description="'none' turns thinking off; any other level turns it on."
    )
    metadata: Metadata | None = None
    # extensions
    thinking: ChatThinking | None = Field(None, description="Turns reasoning on or off.")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="vLLM's; enable_thinking (or thinking) turns reasoning on or off."
    )
    continue_final_message: bool | None = Field(
        None, description="vLLM's: continue the final assistant message's text."
    )
