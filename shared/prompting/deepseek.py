"""DeepSeek V4 and V4.1: the conversation rendered by deepseek-recipe's own encodings.

``deepseek_recipe`` is the reference implementation of these prompt formats: system block
with the reasoning effort and the tools, ``<｜User｜>`` / ``<｜Assistant｜>`` turns,
``<think>`` reasoning, DSML tool calls, ``<tool_result>`` blocks. A format here maps the
conversation onto its message types and returns its prompt and special ranges as they
are, so every control token sits where the reference puts it and user text that spells
one stays text. V4.1 opens its system block with ``<｜System｜>``; V4 has no such token.

Thinking is on unless the conversation turns it off, as DeepSeek's API has it. The
efforts a client can ask for map onto DeepSeek's as its API maps them (``medium`` is
``high``). Images do not reach V4: a V4 model puts ``[Unsupported Image]`` in their place
before rendering. V4.1 puts ``<｜image｜>`` where each image is, among its message's parts,
which preparation then expands. The recipe takes a message's first occurrences of its image
token as the placeholders, so each message's images are spelled by a marker its text does not
hold, and the marker is put back as the image token in the rendered prompt: a user who types
``<｜image｜>`` gets text.
"""

from __future__ import annotations

import deepseek_recipe as recipe

from shared.conversation import (
    AssistantMessage,
    ContentPart,
    Conversation,
    ConversationError,
    ImagePart,
    ImageSource,
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
from shared.images.deepseek import IMAGE
from shared.prompting.base import RenderedPrompt, RenderOptions

EFFORTS: dict[ReasoningEffort, str] = {
    "low": "low",
    "medium": "high",
    "high": "high",
    "xhigh": "xhigh",
    "max": "max",
}
"""Each reasoning effort as DeepSeek names it."""


# Spellings as long as the image token that a message's text is checked not to hold: the
# marker keeps every offset of the rendered prompt where the image token puts it back.
_MARKERS = tuple(chr(0xE000 + i) * len(IMAGE) for i in range(64))


class DeepseekFormat:
    """One DeepSeek encoding (``recipe.DeepseekV4Encoding`` or ``DeepseekV41Encoding``);
    ``images`` when it lays images out (V4.1)."""

    def __init__(
        self,
        name: str,
        encoding: recipe.DeepseekV4Encoding | recipe.DeepseekV41Encoding,
        images: bool = False,
    ):
        self.name = name
        self._encoding = encoding
        self._images = images

    def render(self, conversation: Conversation, options: RenderOptions) -> RenderedPrompt:
        images = _Images() if self._images else None
        rendered = self._encoding.render_conversation(recipe_conversation(conversation, images))
        prompt, ranges = rendered.prompt, list(rendered.special_ranges)
        if images is None or not images.sources:
            return RenderedPrompt(prompt, ranges)
        return images.rendered(prompt, ranges, rendered.image_sources)


class _Images:
    """The images of one conversation as it is converted: each message's marker, and the
    sources in the order the recipe is given them."""

    def __init__(self) -> None:
        self.sources: list[ImageSource] = []
        self.markers: set[str] = set()

    def text(self, content: list[ContentPart]) -> tuple[str, list[recipe.ImageSource], str]:
        """A message's parts as one text, each image its marker; its sources; its marker."""
        texts = [part.text for part in content if isinstance(part, TextPart)]
        marker = next(m for m in _MARKERS if not any(m in text for text in texts))
        self.markers.add(marker)
        given: list[recipe.ImageSource] = []
        for part in content:
            if isinstance(part, ImagePart):
                given.append(recipe.BytesImageSource(b"", path=str(len(self.sources))))
                self.sources.append(part.source)
        return _text(content, marker), given, marker

    def rendered(
        self, prompt: str, ranges: list[tuple[int, int]], placed: list[recipe.ImageSource]
    ) -> RenderedPrompt:
        """The prompt with each placeholder's marker spelled as the image token, and the
        images in the order their placeholders appear."""
        pieces, end = [], 0
        for start, stop in ranges:
            if prompt[start:stop] in self.markers:
                pieces += [prompt[end:start], IMAGE]
                end = stop
        pieces.append(prompt[end:])
        sources = [self.sources[int(source.path)] for source in placed]
        return RenderedPrompt("".join(pieces), ranges, sources)


def recipe_conversation(
    conversation: Conversation, images: _Images | None = None
) -> recipe.Conversation:
    """``conversation`` in deepseek-recipe's types; with ``images``, its images are placed."""
    choice = conversation.tool_choice
    tools = conversation.tools
    if choice.mode == "function":  # one named tool, called: the only tool offered
        tools = [tool for tool in tools if tool.name == choice.name]
    effort = conversation.reasoning_effort
    thinking = conversation.thinking is not False
    messages = conversation.messages
    return recipe.Conversation(
        [_message(m, f"messages[{i}]", thinking, images) for i, m in enumerate(messages)],
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


def _message(
    message: Message, where: str, thinking: bool, images: _Images | None
) -> recipe.Message:
    """One message. As DeepSeek's API has it, an assistant turn without reasoning has an
    empty one in thinking mode, and outside it no turn has any."""
    seen = has_images(getattr(message, "content", []))
    if seen and images is None:
        raise ConversationError(f"{where}.content: this model's prompt format takes no images")
    match message:
        case SystemMessage() | UserMessage() | ToolMessage() if seen and images is not None:
            return _with_images(message, images)
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


def _with_images(
    message: SystemMessage | UserMessage | ToolMessage, images: _Images
) -> recipe.Message:
    """A message that may hold images, each a placeholder among its parts."""
    text, sources, marker = images.text(message.content)
    match message:
        case SystemMessage():
            return recipe.SystemMessage(text, sources, image_token=marker)
        case UserMessage():
            return recipe.UserMessage(text, sources, image_token=marker)
    return recipe.ToolMessage(text, message.tool_call_id, sources, image_token=marker)


def _text(content: list[ContentPart], image: str = "") -> str:
    """A message's parts as one text: DeepSeek's API puts a blank line between parts. With
    ``image``, each image part is that text; else images are left out."""
    return "\n\n".join(
        part.text if isinstance(part, TextPart) else image
        for part in content
        if isinstance(part, TextPart) or image
    )


def _tool(tool: Tool) -> recipe.ToolDefinition:
    return recipe.ToolDefinition(tool.name, tool.description, tool.parameters, tool.strict or None)


V4 = DeepseekFormat("deepseek_v4", recipe.DeepseekV4Encoding())
V41 = DeepseekFormat("deepseek_v4.1", recipe.DeepseekV41Encoding(), images=True)
