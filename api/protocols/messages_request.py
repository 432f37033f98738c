"""Anthropic Messages requests converted to a protocol-free ``GenerationRequest``.

A body is validated against the ``messages_schema`` models (``body_validation``,
with the ``anthropic_error`` phrasing); this module only maps valid bodies.

Mapping choices:

- A ``tool_result`` block becomes a ``ToolMessage`` (named after the matching
  ``tool_use`` when the history has it); text and images around it stay in a
  user message, in their order. ``is_error`` is kept as a leading "Error: "
  text part, since the conversation has no error flag and the model should
  still learn that the call failed.
- A final assistant turn is a prefill: the prompt ends inside it and the answer
  continues its text, as the Anthropic API does. It may not hold ``tool_use``.
- ``thinking`` blocks of earlier turns become the turn's reasoning;
  ``redacted_thinking`` blocks and signatures are dropped (nothing can read them).
- ``thinking``: enabled → on, disabled → off, adaptive → the model's default.
  The budget is checked (≥ 1024, < max_tokens) but not enforced on generation.
  ``output_config.effort`` becomes the reasoning effort,
  ``output_config.format`` a JSON schema response format.
- ``metadata.user_id`` travels in ``GenerationRequest.metadata``.
- ``disable_parallel_tool_use`` ends the answer after its first tool call.
  ``cache_control`` is accepted and has no effect (prefix caching is automatic).
"""

from __future__ import annotations

import json
from typing import Any

from api.errors import bad_request
from api.protocols import unsupported
from api.protocols.base import GenerationRequest
from api.protocols.body_validation import anthropic_error, validated
from api.protocols.messages_schema import (
    AssistantTurn,
    CountTokensBody,
    CreateBody,
    ImageBlock,
    OutputConfig,
    TextBlock,
    ThinkingBlock,
    ThinkingBody,
    ThinkingDisabled,
    ThinkingEnabled,
    ToolChoiceAny,
    ToolChoiceAuto,
    ToolChoiceBody,
    ToolChoiceNone,
    ToolResultBlock,
    ToolUseBlock,
    UrlSource,
    UserTurn,
)
from api.protocols.unsupported import refuse
from api.protocols.vllm_extensions import read_structured_outputs
from shared.conversation import (
    AssistantMessage,
    ContentPart,
    Conversation,
    ConversationError,
    ImagePart,
    ImageSource,
    Message,
    ResponseFormat,
    SystemMessage,
    TextPart,
    Tool,
    ToolCall,
    ToolChoice,
    ToolMessage,
    UserMessage,
)


def parse(body: dict[str, Any]) -> GenerationRequest:
    """Validate a ``POST /v1/messages`` body; raise a 400 naming the first bad field."""
    request = validated(CreateBody, body, anthropic_error)
    thinking = request.thinking
    if isinstance(thinking, ThinkingEnabled) and thinking.budget_tokens >= request.max_tokens:
        raise bad_request(
            f"thinking.budget_tokens: must be less than max_tokens ({request.max_tokens}), "
            f"got {thinking.budget_tokens}",
            "thinking.budget_tokens",
        )
    user_id = request.metadata.user_id if request.metadata else None
    known = {info.alias or name for name, info in CreateBody.model_fields.items()}
    known |= refuse(body, unsupported.MESSAGES)
    return GenerationRequest(
        model=request.model,
        conversation=_conversation(request),
        stream=request.stream,
        max_tokens=request.max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        stop=list(request.stop_sequences),
        structured_outputs=read_structured_outputs(request.structured_outputs),
        thinking_param="thinking" if request.thinking is not None else "output_config.effort",
        metadata={"user_id": user_id} if user_id is not None else {},
        ignored_fields=[name for name in body if name not in known],
    )


def parse_count_tokens(body: dict[str, Any]) -> GenerationRequest:
    """Validate a ``POST /v1/messages/count_tokens`` body (no max_tokens, no stream)."""
    request = validated(CountTokensBody, body, anthropic_error)
    return GenerationRequest(model=request.model, conversation=_conversation(request))


def _conversation(request: CountTokensBody) -> Conversation:
    tools = [Tool(t.name, t.description, t.input_schema, bool(t.strict)) for t in request.tools]
    _check_tools(tools)
    system = [SystemMessage([TextPart(block.text) for block in request.system])]
    config = request.output_config or OutputConfig()
    conversation = Conversation(
        messages=(system if request.system else []) + _turns(request.messages),
        tools=tools,
        tool_choice=_tool_choice(request.tool_choice, tools),
        thinking=_thinking(request.thinking),
        reasoning_effort=config.effort,
        response_format=(
            ResponseFormat(
                "json_schema", config.format.schema_, param="output_config.format.schema"
            )
            if config.format
            else ResponseFormat()
        ),
    )
    try:
        return conversation.validate()
    except ConversationError as exc:
        raise bad_request(str(exc)) from None


def _check_tools(tools: list[Tool]) -> None:
    seen: set[str] = set()
    for index, tool in enumerate(tools):
        if tool.name in seen:
            raise bad_request(
                f"tools.{index}.name: tool names must be unique, got {tool.name!r} twice",
                f"tools.{index}.name",
            )
        seen.add(tool.name)


def _tool_choice(choice: ToolChoiceBody | None, tools: list[Tool]) -> ToolChoice:
    match choice:
        case None:
            return ToolChoice("auto")
        case ToolChoiceAuto():
            return ToolChoice("auto", parallel=not choice.disable_parallel_tool_use)
        case ToolChoiceNone():
            return ToolChoice("none")
    if not tools:
        raise bad_request(f"tool_choice: {choice.type!r} needs at least one tool", "tool_choice")
    parallel = not choice.disable_parallel_tool_use
    if isinstance(choice, ToolChoiceAny):
        return ToolChoice("required", parallel=parallel)
    names = [tool.name for tool in tools]
    if choice.name not in names:
        raise bad_request(
            f"tool_choice.name: must name one of the tools ({', '.join(names)}), "
            f"got {choice.name!r}",
            "tool_choice.name",
        )
    return ToolChoice("function", choice.name, parallel)


def _thinking(config: ThinkingBody | None) -> bool | None:
    match config:
        case ThinkingEnabled():
            return True
        case ThinkingDisabled():
            return False
    return None


def _turns(turns: list[UserTurn | AssistantTurn]) -> list[Message]:
    tool_names: dict[str, str] = {}  # tool_use id → name, so results can be named
    messages: list[Message] = []
    for index, turn in enumerate(turns):
        if isinstance(turn, UserTurn):
            messages.extend(_user_messages(turn, tool_names))
            continue
        is_last = index == len(turns) - 1
        messages.append(_assistant_message(turn, tool_names, is_last, f"messages.{index}"))
    return messages


def _user_messages(turn: UserTurn, tool_names: dict[str, str]) -> list[Message]:
    """Tool results become tool messages; the text and images between them, user ones."""
    messages: list[Message] = []
    parts: list[ContentPart] = []
    for block in turn.content:
        if not isinstance(block, ToolResultBlock):
            parts.append(_part(block))
            continue
        if parts:
            messages.append(UserMessage(parts))
            parts = []
        content = [_part(item) for item in block.content]
        if block.is_error:
            content.insert(0, TextPart("Error: "))
        messages.append(ToolMessage(block.tool_use_id, content, tool_names.get(block.tool_use_id)))
    if parts or not messages:
        messages.append(UserMessage(parts))
    return messages


def _assistant_message(
    turn: AssistantTurn, tool_names: dict[str, str], is_last: bool, where: str
) -> AssistantMessage:
    message = AssistantMessage(prefix=is_last)
    reasoning: list[str] = []
    for index, block in enumerate(turn.content):
        match block:
            case TextBlock():
                message.content.append(TextPart(block.text))
            case ThinkingBlock():
                reasoning.append(block.thinking)
            case ToolUseBlock() if is_last:
                raise bad_request(
                    f"{where}.content.{index}: the final assistant turn is continued as a "
                    "prefill and may not hold tool_use blocks",
                    f"{where}.content.{index}",
                )
            case ToolUseBlock():
                arguments = json.dumps(block.input, ensure_ascii=False)
                message.tool_calls.append(ToolCall(block.id, block.name, arguments))
                tool_names[block.id] = block.name
    message.reasoning = "".join(reasoning) if reasoning else None
    return message


def _part(block: TextBlock | ImageBlock) -> ContentPart:
    if isinstance(block, TextBlock):
        return TextPart(block.text)
    source = block.source
    if isinstance(source, UrlSource):
        return ImagePart(ImageSource(url=source.url))
    return ImagePart(ImageSource(data=source.data, media_type=source.media_type))
