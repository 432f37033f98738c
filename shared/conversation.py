"""One protocol-free conversation that every API protocol converts into.

OpenAI Chat Completions, OpenAI Responses and Anthropic Messages each spell
roles, tool calls, images and reasoning their own way; the parsers translate
them into these types once, so prompt formats and preparation never learn a
protocol's field names. The types stay plain dataclasses: validation happens in
``Conversation.validate`` and raises ``ConversationError`` naming the field, so
a parser can turn it into a 400 unchanged.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

SystemRole = Literal["system", "developer"]
ToolChoiceMode = Literal["none", "auto", "required", "function"]
ReasoningEffort = Literal["low", "medium", "high", "xhigh", "max"]
ResponseFormatType = Literal["text", "json_object", "json_schema"]
ImageDetail = Literal["auto", "low", "high", "original"]

REASONING_EFFORTS: tuple[str, ...] = ("low", "medium", "high", "xhigh", "max")
TOOL_CHOICE_MODES: tuple[str, ...] = ("none", "auto", "required", "function")
RESPONSE_FORMAT_TYPES: tuple[str, ...] = ("text", "json_object", "json_schema")
IMAGE_DETAILS: tuple[str, ...] = ("auto", "low", "high", "original")


class ConversationError(ValueError):
    """A conversation that cannot be rendered; the message names the field."""


@dataclass(slots=True)
class TextPart:
    text: str


@dataclass(slots=True)
class ImageSource:
    """Where an image comes from: a URL, or base64 ``data`` with its media type, and the
    ``detail`` it is read at (OpenAI's: ``low`` asks for fewer image tokens).

    Prompt formats only place a placeholder for it; fetching and decoding is
    the preparation step's job, which is why the source travels unchanged.
    """

    url: str | None = None
    data: str | None = None
    media_type: str | None = None
    detail: ImageDetail = "auto"


@dataclass(slots=True)
class ImagePart:
    source: ImageSource


ContentPart = TextPart | ImagePart


@dataclass(slots=True)
class ToolCall:
    """A call the assistant made; ``arguments`` is the JSON text the model wrote."""

    id: str
    name: str
    arguments: str = "{}"


@dataclass(slots=True)
class SystemMessage:
    """Instructions from the operator; ``developer`` is OpenAI's newer name for it."""

    content: list[ContentPart]
    role: SystemRole = "system"


@dataclass(slots=True)
class UserMessage:
    content: list[ContentPart]


@dataclass(slots=True)
class AssistantMessage:
    """An earlier assistant turn, or with ``prefix`` the start of the one to continue.

    ``prefix`` is only meaningful on the last message: the prompt then ends
    inside this turn so the model continues the text instead of starting anew.
    """

    content: list[ContentPart] = field(default_factory=list)
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    prefix: bool = False


@dataclass(slots=True)
class ToolMessage:
    """The result of one tool call, answered by ``tool_call_id``."""

    tool_call_id: str
    content: list[ContentPart]
    name: str | None = None


@dataclass(slots=True)
class ReminderMessage:
    """DeepSeek's ``latest_reminder`` turn: instructions placed where the model reads them
    last. Only the DeepSeek prompt formats lay it out."""

    content: list[ContentPart]


Message = SystemMessage | UserMessage | AssistantMessage | ToolMessage | ReminderMessage


@dataclass(slots=True)
class Tool:
    """A function the model may call; ``parameters`` is a JSON schema object.

    ``strict`` asks that forced calls' arguments match ``parameters`` exactly;
    without it they are at least a JSON object.
    """

    name: str
    description: str | None = None
    parameters: dict = field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool = False


@dataclass(slots=True)
class ToolChoice:
    """Whether the model may, must or must not call tools; ``function`` names one.

    ``parallel`` False allows at most one call per turn (OpenAI's
    ``parallel_tool_calls``, Anthropic's ``disable_parallel_tool_use``).
    """

    mode: ToolChoiceMode = "auto"
    name: str | None = None
    parallel: bool = True


@dataclass(slots=True)
class ResponseFormat:
    """The shape the answer must take; ``schema`` is required for ``json_schema``.

    ``param`` is where the client wrote the schema, for the 400 that refuses it.
    """

    type: ResponseFormatType = "text"
    schema: dict | None = None
    name: str | None = None
    strict: bool = False
    param: str = "response_format"


@dataclass(slots=True)
class Conversation:
    """Everything a prompt format and the constraint builder need from a request.

    ``thinking`` None means "the model's default" (Qwen3 thinks unless told
    not to); True or False is an explicit request from the client.
    """

    messages: list[Message]
    tools: list[Tool] = field(default_factory=list)
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    thinking: bool | None = None
    reasoning_effort: ReasoningEffort | None = None
    response_format: ResponseFormat = field(default_factory=ResponseFormat)

    def validate(self) -> Conversation:
        """Raise ``ConversationError`` for the first invalid field; return self to chain."""
        if not self.messages:
            raise ConversationError("messages must contain at least one message")
        for index, message in enumerate(self.messages):
            _validate_message(message, f"messages[{index}]", index == len(self.messages) - 1)
        for index, tool in enumerate(self.tools):
            _validate_tool(tool, f"tools[{index}]")
        _validate_tool_choice(self.tool_choice, self.tools)
        _validate_options(self)
        return self

    @property
    def continues_last_message(self) -> bool:
        """True when the prompt must end inside the last (assistant, prefix) turn."""
        last = self.messages[-1] if self.messages else None
        return isinstance(last, AssistantMessage) and last.prefix


def text_of(content: list[ContentPart]) -> str:
    """The text parts joined, images left out: for roles that cannot hold images."""
    return "".join(part.text for part in content if isinstance(part, TextPart))


def has_images(content: list[ContentPart]) -> bool:
    return any(isinstance(part, ImagePart) for part in content)


def images_as_text(conversation: Conversation, text: str) -> Conversation:
    """A copy in which every image part is the text part ``text``: for models that cannot see."""
    messages = [
        dataclasses.replace(message, content=[_as_text(part, text) for part in message.content])
        if has_images(getattr(message, "content", []))
        else message
        for message in conversation.messages
    ]
    return dataclasses.replace(conversation, messages=messages)


def _as_text(part: ContentPart, text: str) -> ContentPart:
    return TextPart(text) if isinstance(part, ImagePart) else part


def leading_system(messages: list[Message]) -> tuple[SystemMessage | None, list[Message]]:
    """The first message when it is a system one, and the messages after it.

    Chat formats treat that message as *the* system prompt (tools are added to
    it, a default replaces it when missing); later system messages are turns.
    """
    if messages and isinstance(messages[0], SystemMessage):
        return messages[0], list(messages[1:])
    return None, list(messages)


def _validate_message(message: object, where: str, is_last: bool) -> None:
    match message:
        case SystemMessage():
            if message.role not in ("system", "developer"):
                raise ConversationError(
                    f"{where}.role must be 'system' or 'developer', got {message.role!r}"
                )
            _validate_content(message.content, where, images=False)
        case UserMessage():
            _validate_content(message.content, where, images=True)
        case AssistantMessage():
            _validate_assistant(message, where, is_last)
        case ReminderMessage():
            _validate_content(message.content, where, images=False)
        case ToolMessage():
            if not isinstance(message.tool_call_id, str) or not message.tool_call_id:
                raise ConversationError(f"{where}.tool_call_id is required")
            if message.name is not None and not isinstance(message.name, str):
                raise ConversationError(f"{where}.name must be a string, got {message.name!r}")
            _validate_content(message.content, where, images=True)
        case _:
            raise ConversationError(
                f"{where} must be a system, user, assistant, tool or latest_reminder message, "
                f"got {type(message).__name__}"
            )


def _validate_assistant(message: AssistantMessage, where: str, is_last: bool) -> None:
    _validate_content(message.content, where, images=False)
    if message.reasoning is not None and not isinstance(message.reasoning, str):
        raise ConversationError(f"{where}.reasoning must be a string, got {message.reasoning!r}")
    if message.prefix and not is_last:
        raise ConversationError(f"{where}.prefix is only allowed on the last message")
    if message.prefix and message.tool_calls:
        raise ConversationError(
            f"{where}.prefix cannot be combined with tool_calls: only text can be continued"
        )
    for index, call in enumerate(message.tool_calls):
        call_where = f"{where}.tool_calls[{index}]"
        if not isinstance(call, ToolCall):
            raise ConversationError(f"{call_where} must be a ToolCall, got {type(call).__name__}")
        for name in ("id", "name"):
            value = getattr(call, name)
            if not isinstance(value, str) or not value:
                raise ConversationError(f"{call_where}.{name} is required")
        if not isinstance(call.arguments, str):
            raise ConversationError(
                f"{call_where}.arguments must be a JSON string, got {type(call.arguments).__name__}"
            )


def _validate_content(content: object, where: str, *, images: bool) -> None:
    if not isinstance(content, list):
        raise ConversationError(
            f"{where}.content must be a list of parts, got {type(content).__name__}"
        )
    for index, part in enumerate(content):
        part_where = f"{where}.content[{index}]"
        match part:
            case TextPart(text=str()):
                continue
            case TextPart():
                raise ConversationError(f"{part_where}.text must be a string")
            case ImagePart() if not images:
                raise ConversationError(
                    f"{part_where}: images are only accepted in user and tool messages"
                )
            case ImagePart(source=ImageSource() as source):
                _validate_image_source(source, f"{part_where}.source")
            case _:
                raise ConversationError(
                    f"{part_where} must be a text or image part, got {type(part).__name__}"
                )


def _validate_image_source(source: ImageSource, where: str) -> None:
    if (source.url is None) == (source.data is None):
        raise ConversationError(f"{where} needs exactly one of url or data")
    if source.data is not None and not source.media_type:
        raise ConversationError(f"{where}.media_type is required with base64 data")


def _validate_tool(tool: object, where: str) -> None:
    if not isinstance(tool, Tool):
        raise ConversationError(f"{where} must be a Tool, got {type(tool).__name__}")
    if not isinstance(tool.name, str) or not tool.name:
        raise ConversationError(f"{where}.name is required")
    if tool.description is not None and not isinstance(tool.description, str):
        raise ConversationError(f"{where}.description must be a string, got {tool.description!r}")
    if not isinstance(tool.parameters, dict):
        raise ConversationError(
            f"{where}.parameters must be a JSON schema object, got {type(tool.parameters).__name__}"
        )


def _validate_tool_choice(choice: ToolChoice, tools: list[Tool]) -> None:
    if choice.mode not in TOOL_CHOICE_MODES:
        raise ConversationError(
            f"tool_choice.mode must be one of {', '.join(TOOL_CHOICE_MODES)}, got {choice.mode!r}"
        )
    if choice.mode in ("required", "function") and not tools:
        raise ConversationError(f"tool_choice {choice.mode!r} needs at least one tool in tools")
    if choice.mode != "function":
        return
    names = [tool.name for tool in tools]
    if choice.name not in names:
        raise ConversationError(
            f"tool_choice.name must name one of the tools ({', '.join(names)}), got {choice.name!r}"
        )


def _validate_options(conversation: Conversation) -> None:
    if conversation.thinking is not None and not isinstance(conversation.thinking, bool):
        raise ConversationError(f"thinking must be true or false, got {conversation.thinking!r}")
    effort = conversation.reasoning_effort
    if effort is not None and effort not in REASONING_EFFORTS:
        raise ConversationError(
            f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}"
        )
    response = conversation.response_format
    if response.type not in RESPONSE_FORMAT_TYPES:
        raise ConversationError(
            f"response_format.type must be one of {', '.join(RESPONSE_FORMAT_TYPES)}, "
            f"got {response.type!r}"
        )
    if response.type == "json_schema" and not isinstance(response.schema, dict):
        raise ConversationError("response_format.schema is required for type 'json_schema'")


__all__ = [
    "AssistantMessage",
    "ContentPart",
    "Conversation",
    "ConversationError",
    "ImagePart",
    "ImageSource",
    "Message",
    "ReasoningEffort",
    "ResponseFormat",
    "SystemMessage",
    "TextPart",
    "Tool",
    "ToolCall",
    "ToolChoice",
    "ToolMessage",
    "UserMessage",
    "has_images",
    "images_as_text",
    "leading_system",
    "text_of",
]
