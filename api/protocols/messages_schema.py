"""Anthropic Messages request bodies as pydantic models.

The models mirror the wire shapes: unknown fields are ignored and values are
never coerced. ``body_validation.validated`` checks a body against them with
the ``anthropic_error`` phrasing, whose 400 names the field path the way the
Anthropic API does (``messages.0.content.1.source.media_type: ...``). Block
unions are chosen by their ``type`` (turns by their ``role``). The same models
are the Messages bodies in ``/openapi.json`` (``api.openapi_bodies``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from api.protocols.body_validation import tagged_union


class Strict(BaseModel):
    """Wire shapes: unknown fields are ignored, values are never coerced."""

    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)


def _text_shorthand(value: Any) -> Any:
    """A plain string stands for one text block, everywhere the API accepts blocks."""
    return [{"type": "text", "text": value}] if isinstance(value, str) else value


def _blocks(block: Any) -> Any:
    """A list of ``block``, or a plain string for one text block (so the JSON schema says)."""
    return Annotated[
        list[block],
        BeforeValidator(_text_shorthand, json_schema_input_type=str | list[block]),
    ]


_NonEmptyStr = Annotated[str, Field(min_length=1)]


class TextBlock(Strict):
    type: Literal["text"]
    text: str


class Base64Source(Strict):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: _NonEmptyStr


class UrlSource(Strict):
    type: Literal["url"]
    url: _NonEmptyStr


_ImageSourceField = tagged_union("type", Base64Source, UrlSource)


class ImageBlock(Strict):
    type: Literal["image"]
    source: _ImageSourceField


_ResultBlocks = _blocks(tagged_union("type", TextBlock, ImageBlock))


class ToolResultBlock(Strict):
    type: Literal["tool_result"]
    tool_use_id: _NonEmptyStr
    content: _ResultBlocks = []
    is_error: bool = False


class ToolUseBlock(Strict):
    type: Literal["tool_use"]
    id: _NonEmptyStr
    name: _NonEmptyStr
    input: dict[str, Any]


class ThinkingBlock(Strict):
    type: Literal["thinking"]
    thinking: str
    signature: str = ""


class RedactedThinkingBlock(Strict):
    type: Literal["redacted_thinking"]
    data: str = ""


_UserBlock = tagged_union("type", TextBlock, ImageBlock, ToolResultBlock)
_AssistantBlock = tagged_union(
    "type", TextBlock, ToolUseBlock, ThinkingBlock, RedactedThinkingBlock
)


class UserTurn(Strict):
    role: Literal["user"]
    content: _blocks(_UserBlock)


class AssistantTurn(Strict):
    role: Literal["assistant"]
    content: _blocks(_AssistantBlock)


class ToolDefinition(Strict):
    name: _NonEmptyStr
    description: str | None = None
    input_schema: dict[str, Any]
    strict: bool | None = None
    type: Literal["custom"] | None = None  # server tools (bash, web search, …) are not served


class ToolChoiceAuto(Strict):
    type: Literal["auto"]
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(Strict):
    type: Literal["any"]
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(Strict):
    type: Literal["tool"]
    name: _NonEmptyStr
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(Strict):
    type: Literal["none"]


_ToolChoiceField = tagged_union(
    "type", ToolChoiceAuto, ToolChoiceAny, ToolChoiceTool, ToolChoiceNone
)


class ThinkingEnabled(Strict):
    type: Literal["enabled"]
    budget_tokens: Annotated[int, Field(ge=1024)]


class ThinkingDisabled(Strict):
    type: Literal["disabled"]


class ThinkingAdaptive(Strict):
    type: Literal["adaptive"]


ToolChoiceBody = ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone
ThinkingBody = ThinkingEnabled | ThinkingDisabled | ThinkingAdaptive
_ThinkingField = tagged_union("type", ThinkingEnabled, ThinkingDisabled, ThinkingAdaptive)
_TurnField = tagged_union("role", UserTurn, AssistantTurn)


class JsonFormat(Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Strict):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JsonFormat | None = None


class Metadata(Strict):
    user_id: str | None = None


_EXAMPLE = {"model": "default", "messages": [{"role": "user", "content": "Hi"}]}


class CountTokensBody(Strict):
    """The fields ``/v1/messages/count_tokens`` shares with message creation."""

    model_config = ConfigDict(json_schema_extra={"examples": [_EXAMPLE]})

    model: _NonEmptyStr
    messages: Annotated[list[_TurnField], Field(min_length=1)]
    system: _blocks(TextBlock) = []
    tools: list[ToolDefinition] = []
    tool_choice: _ToolChoiceField | None = None
    thinking: _ThinkingField | None = None
    output_config: OutputConfig | None = None


class CreateBody(CountTokensBody):
    """``POST /v1/messages``: a conversation to answer."""

    model_config = ConfigDict(json_schema_extra={"examples": [{**_EXAMPLE, "max_tokens": 256}]})

    max_tokens: Annotated[int, Field(ge=1)]
    stream: bool = False
    stop_sequences: list[_NonEmptyStr] = []
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None  # 0 turns it off
    metadata: Metadata | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's extension, read by its own reader
