"""Conversation validation: every error names the field that is wrong."""

from __future__ import annotations

import re

import pytest

from shared.conversation import (
    AssistantMessage,
    Conversation,
    ConversationError,
    ImagePart,
    ImageSource,
    ResponseFormat,
    SystemMessage,
    TextPart,
    Tool,
    ToolCall,
    ToolChoice,
    ToolMessage,
    UserMessage,
    has_images,
    leading_system,
    text_of,
)


def user(text: str) -> UserMessage:
    return UserMessage([TextPart(text)])


def full_conversation() -> Conversation:
    return Conversation(
        messages=[
            SystemMessage([TextPart("Be brief.")], role="developer"),
            UserMessage(
                [TextPart("What is this? "), ImagePart(ImageSource(url="https://x/y.png"))]
            ),
            AssistantMessage(
                content=[TextPart("Let me look.")],
                reasoning="The user wants a description.",
                tool_calls=[ToolCall(id="call_1", name="lookup", arguments='{"q": "y.png"}')],
            ),
            ToolMessage(tool_call_id="call_1", name="lookup", content=[TextPart("a cat")]),
            AssistantMessage(content=[TextPart("It is a")], prefix=True),
        ],
        tools=[Tool(name="lookup", description="Look things up", parameters={"type": "object"})],
        tool_choice=ToolChoice(mode="function", name="lookup"),
        thinking=True,
        reasoning_effort="high",
        response_format=ResponseFormat(type="json_schema", schema={"type": "object"}),
    )


def test_a_full_conversation_is_valid_and_continues_its_last_message():
    conversation = full_conversation()
    assert conversation.validate() is conversation
    assert conversation.continues_last_message


def test_conversation_error_is_a_value_error():
    assert issubclass(ConversationError, ValueError)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: c.messages.clear(), "messages must contain at least one message"),
        (
            lambda c: setattr(c.messages[3], "tool_call_id", ""),
            "messages[3].tool_call_id is required",
        ),
        (
            lambda c: setattr(c.messages[2].tool_calls[0], "name", ""),
            "messages[2].tool_calls[0].name is required",
        ),
        (
            lambda c: setattr(c.messages[2].tool_calls[0], "arguments", {"q": 1}),
            "messages[2].tool_calls[0].arguments must be a JSON string",
        ),
        (
            lambda c: setattr(c.messages[2], "prefix", True),
            "messages[2].prefix is only allowed on the last message",
        ),
        (
            lambda c: c.messages[4].tool_calls.append(ToolCall(id="c", name="f")),
            "messages[4].prefix cannot be combined with tool_calls",
        ),
        (
            lambda c: c.messages[0].content.append(ImagePart(ImageSource(url="u"))),
            "messages[0].content[1]: images are only accepted in user and tool messages",
        ),
        (
            lambda c: setattr(c.messages[1].content[1], "source", ImageSource()),
            "messages[1].content[1].source needs exactly one of url or data",
        ),
        (
            lambda c: setattr(c.messages[1].content[1], "source", ImageSource(data="AAAA")),
            "messages[1].content[1].source.media_type is required with base64 data",
        ),
        (
            lambda c: c.messages[1].content.append("plain string"),
            "messages[1].content[2] must be a text or image part, got str",
        ),
        (lambda c: setattr(c.messages[1], "content", "hi"), "messages[1].content must be a list"),
        (lambda c: setattr(c.messages[0], "role", "admin"), "messages[0].role must be 'system'"),
        (lambda c: c.messages.insert(1, "hi"), "messages[1] must be a system, user, assistant"),
        (lambda c: setattr(c.tools[0], "name", ""), "tools[0].name is required"),
        (
            lambda c: setattr(c.tools[0], "parameters", "{}"),
            "tools[0].parameters must be a JSON schema object",
        ),
        (
            lambda c: setattr(c.tool_choice, "name", "other"),
            "tool_choice.name must name one of the tools (lookup), got 'other'",
        ),
        (lambda c: setattr(c.tool_choice, "mode", "any"), "tool_choice.mode must be one of"),
        (lambda c: setattr(c, "reasoning_effort", "extreme"), "reasoning_effort must be one of"),
        (lambda c: setattr(c, "thinking", "yes"), "thinking must be true or false"),
        (
            lambda c: setattr(c.response_format, "schema", None),
            "response_format.schema is required for type 'json_schema'",
        ),
        (lambda c: setattr(c.response_format, "type", "xml"), "response_format.type must be"),
    ],
)
def test_validation_names_the_field(change, message):
    conversation = full_conversation()
    change(conversation)
    with pytest.raises(ConversationError, match=re.escape(message)):
        conversation.validate()


def test_required_tool_choice_needs_tools():
    conversation = Conversation(messages=[user("hi")], tool_choice=ToolChoice(mode="required"))
    with pytest.raises(ConversationError, match="tool_choice 'required' needs at least one tool"):
        conversation.validate()


def test_minimal_conversation_defaults():
    conversation = Conversation(messages=[user("hi")]).validate()
    assert conversation.tool_choice.mode == "auto"
    assert conversation.response_format.type == "text"
    assert conversation.thinking is None
    assert not conversation.continues_last_message


def test_content_helpers():
    parts = [TextPart("a"), ImagePart(ImageSource(url="u")), TextPart("b")]
    assert text_of(parts) == "ab"
    assert has_images(parts)
    assert not has_images([TextPart("a")])


def test_leading_system_splits_only_a_first_system_message():
    system = SystemMessage([TextPart("s")])
    later = SystemMessage([TextPart("t")])
    assert leading_system([system, user("u"), later]) == (system, [user("u"), later])
    assert leading_system([user("u"), later]) == (None, [user("u"), later])
