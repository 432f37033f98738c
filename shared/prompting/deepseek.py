"""DeepSeek V4 and V4.1: the conversation rendered by deepseek-recipe's own encodings.

``deepseek_recipe`` is the reference implementation of these prompt formats: system block
with the reasoning effort and the tools, ``<｜User｜>`` / ``<｜Assistant｜>`` turns,
``<think>`` reasoning, DSML tool calls, ``<tool_result>`` blocks. A format here maps the
conversation onto its message types and returns its prompt and special ranges as they
are, so every control token sits where the reference puts it and user text that spells
one stays text. V4.1 opens its system block with ``<｜System｜>``; V4 has no such token.

Thinking is on unless the conversation turns it off, as DeepSeek's API has it. The
efforts a client can ask for map onto DeepSeek's as its API maps them (``medium`` is
``high``). Images do not reach these formats: a V4 model puts ``[Unsupported Image]`` in
their place before rendering.
"""

from __future__ import annotations

import deepseek_recipe as recipe

from shared.conversation import (
    AssistantMessage,
    ContentPart,
    Conversation,
    ConversationError,
    Message,
    ReasoningEffort,
    ReminderMessage,
    SystemMessage,
    TextPart,
    Tool,
    ToolMessage,
    UserMessage,
    has_images,
)
from shared.prompting.base import RenderedPrompt, RenderOptions

EFFORTS: dict[ReasoningEffort, str] = {
    "low": "low",
    "medium": "high",
    "high": "high",
    "xhigh": "xhigh",
    "max": "max",
}
"""Each reasoning effort as DeepSeek names it."""


class DeepseekFormat:
    """One DeepSeek encoding (``recipe.DeepseekV4Encoding`` or ``DeepseekV41Encoding``)."""

    def __init__(self, name: str, encoding: recipe.DeepseekV4Encoding | recipe.DeepseekV41Encoding):
        self.name = name
        self._encoding = encoding

    def render(self, conversation: Conversation, options: RenderOptions) -> RenderedPrompt:
        rendered = self._encoding.render_conversation(recipe_conversation(conversation))
        return RenderedPrompt(rendered.prompt, list(rendered.special_ranges))


def recipe_conversation(conversation: Conversation) -> recipe.Conversation:
    """``conversation`` in deepseek-recipe's types."""
    choice = conversation.tool_choice
    tools = conversation.tools
    if choice.mode == "function":  # one named tool, called: the only tool offered
        tools = [tool for tool in tools if tool.name == choice.name]
    effort = conversation.reasoning_effort
    thinking = conversation.thinking is not False
    messages = conversation.messages
    return recipe.Conversation(
        [_message(m, f"messages[{i}]", thinking) for i, m in enumerate(messages)],
        thinking_mode=thinking,
        tools=[_tool(tool) for tool in tools] if choice.mode != "none" else None,
        tool_choice=_tool_choice(choice.mode, thinking),
        reasoning_effort=EFFORTS[effort] if effort is not None else None,
    )


def _tool_choice(mode: str, thinking: bool) -> str:
    """A forced call opens its block in the prompt, as DeepSeek's API does; after reasoning
    (which DeepSeek's API refuses to combine with a forced call) the grammar opens it."""
    if mode in ("auto", "none"):
        return mode
    return "auto" if thinking else "required"


def _message(message: Message, where: str, thinking: bool) -> recipe.Message:
    """One message. As DeepSeek's API has it, an assistant turn without reasoning has an
    empty one in thinking mode, and outside it no turn has any."""
    if has_images(getattr(message, "content", [])):
        raise ConversationError(f"{where}.content: this model's prompt format takes no images")
    match message:
        case SystemMessage():
            return recipe.SystemMessage(_text(message.content))
        case UserMessage():
            return recipe.UserMessage(_text(message.content))
        case AssistantMessage():
            calls = [recipe.ToolCall(c.id, c.name, c.arguments) for c in message.tool_calls]
            return recipe.AssistantMessage(
                _text(message.content),
                reasoning_content=(message.reasoning or "") if thinking else None,
                tool_calls=calls or None,
                prefix=message.prefix,
            )
        case ToolMessage():
            return recipe.ToolMessage(_text(message.content), tool_call_id=message.tool_call_id)
        case ReminderMessage():
            return recipe.LatestReminderMessage(_text(message.content))
    raise ConversationError(f"{where}: not a message this format lays out")


def _text(content: list[ContentPart]) -> str:
    """A message's parts as one text: DeepSeek's API puts a blank line between parts."""
    return "\n\n".join(part.text for part in content if isinstance(part, TextPart))


def _tool(tool: Tool) -> recipe.ToolDefinition:
    return recipe.ToolDefinition(tool.name, tool.description, tool.parameters, tool.strict or None)


V4 = DeepseekFormat("deepseek_v4", recipe.DeepseekV4Encoding())
V41 = DeepseekFormat("deepseek_v4.1", recipe.DeepseekV41Encoding())
