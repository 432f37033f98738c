"""The Chat Completions request body as pydantic models: documented and validated.

``chat_completions.parse`` validates a body against ``ChatCompletionRequest`` and
maps it; what the types cannot say (a named tool choice among ``tools``,
``top_logprobs`` without ``logprobs``, image URL syntax) the mapping refuses. The
models hold the OpenAI fields served, vLLM's extensions (``top_k``,
``structured_outputs``, ``chat_template_kwargs``, ...), DeepSeek's
``reasoning_content`` and ``prefix`` on assistant messages, and the
``latest_reminder`` role. Messages are chosen by ``role`` and content parts by
``type``, so an error names the field inside the message or part.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from api.protocols.body_validation import accepts, by_json_kind, tagged_union
from api.protocols.openai_request_parts import (
    FunctionDefinition,
    ImageDetail,
    JsonObjectFormat,
    JsonSchemaSpec,
    Metadata,
    NonEmptyString,
    OpenBody,
    ReasoningEffort,
    SamplingFields,
    TextFormat,
    TopLogprobs,
    integer,
    one_of,
)


class ChatTextPart(OpenBody):
    type: Literal["text"]
    text: str


class ChatImageUrl(OpenBody):
    url: Annotated[str, accepts("a URL string")] = Field(
        description="An http(s) URL or a data:image/...;base64 URL."
    )
    detail: ImageDetail | None = None


class ChatImagePart(OpenBody):
    type: Literal["image_url"]
    image_url: by_json_kind("a URL string or a JSON object", string=str, object=ChatImageUrl)


class ChatRefusalPart(OpenBody):
    type: Literal["refusal"]
    refusal: str


def _content(*parts: type[OpenBody], role: str) -> Any:
    """A string, or an array of the content parts a ``role`` message may send."""
    part = tagged_union("type", *parts, where=f" in a {role} message")
    return by_json_kind("a string or an array of content parts", string=str, array=list[part])


class ChatSystemMessage(OpenBody):
    role: Literal["system"]
    content: _content(ChatTextPart, role="system")


class ChatDeveloperMessage(OpenBody):
    role: Literal["developer"]
    content: _content(ChatTextPart, role="developer")


class ChatUserMessage(OpenBody):
    role: Literal["user"]
    content: _content(ChatTextPart, ChatImagePart, role="user")


class ChatFunctionCall(OpenBody):
    name: NonEmptyString
    arguments: Annotated[str | dict[str, Any], accepts("a JSON string")] | None = Field(
        None, description="The arguments as JSON text; absent: no arguments."
    )


class ChatToolCall(OpenBody):
    id: NonEmptyString
    type: one_of("function") | None = None
    function: ChatFunctionCall


class ChatAssistantMessage(OpenBody):
    role: Literal["assistant"]
    content: _content(ChatTextPart, ChatRefusalPart, role="assistant") | None = None
    tool_calls: list[ChatToolCall] | None = None
    reasoning_content: str | None = Field(None, description="This turn's reasoning (DeepSeek).")
    reasoning: str | None = Field(None, description="This turn's reasoning (vLLM's name).")
    prefix: bool | None = Field(None, description="Continue this final turn's text (DeepSeek).")


class ChatToolMessage(OpenBody):
    role: Literal["tool"]
    content: _content(ChatTextPart, role="tool")
    tool_call_id: NonEmptyString
    name: str | None = None


class ChatReminderMessage(OpenBody):
    """A reminder placed after the last user turn, where the model's format has one."""

    role: Literal["latest_reminder"]
    content: _content(ChatTextPart, role="latest_reminder")


ChatMessage = tagged_union(
    "role",
    ChatSystemMessage,
    ChatDeveloperMessage,
    ChatUserMessage,
    ChatAssistantMessage,
    ChatToolMessage,
    ChatReminderMessage,
)


class ChatFunctionTool(OpenBody):
    type: Annotated[Literal["function"], accepts("'function' (custom tools are not supported)")]
    function: FunctionDefinition


class ChatFunctionName(OpenBody):
    name: NonEmptyString


class ChatNamedToolChoice(OpenBody):
    type: Literal["function"]
    function: ChatFunctionName


class ChatJsonSchemaFormat(OpenBody):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ChatResponseFormat = tagged_union("type", TextFormat, JsonObjectFormat, ChatJsonSchemaFormat)
_TOOL_CHOICES = """'none', 'auto', 'required' or {"type": "function", "function": {"name": ...}}"""
ChatToolChoice = by_json_kind(
    _TOOL_CHOICES,
    string=Annotated[Literal["none", "auto", "required"], accepts(_TOOL_CHOICES)],
    object=ChatNamedToolChoice,
)


class ChatThinking(OpenBody):
    type: one_of("enabled", "disabled")


class ChatTemplateKwargs(OpenBody):
    """vLLM's keywords for the chat template; ``enable_thinking`` (or ``thinking``) is read."""

    enable_thinking: bool | None = None
    thinking: bool | None = None


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``: a conversation to answer."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [{"model": "default", "messages": [{"role": "user", "content": "Hi"}]}]
        }
    )

    # at least one message: the mapping refuses an empty list with its own message
    messages: list[ChatMessage] = Field(json_schema_extra={"minItems": 1})
    tools: list[ChatFunctionTool] | None = None
    tool_choice: ChatToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ChatResponseFormat | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = Field(None, description="Needs logprobs: true.")
    max_tokens: integer(low=1) | None = None
    max_completion_tokens: integer(low=1) | None = Field(
        None, description="Wins over max_tokens when both are sent."
    )
    reasoning_effort: ReasoningEffort | None = Field(
        None, description="'none' turns thinking off; any other level turns it on."
    )
    metadata: Metadata | None = None
    # extensions
    thinking: ChatThinking | None = Field(None, description="Turns reasoning on or off.")
    chat_template_kwargs: ChatTemplateKwargs | None = Field(
        None, description="vLLM's; enable_thinking (or thinking) turns reasoning on or off."
    )
    continue_final_message: bool | None = Field(
        None, description="vLLM's: continue the final assistant message's text."
    )
