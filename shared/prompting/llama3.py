"""Llama 3: ``<|begin_of_text|>``, then per turn
``<|start_header_id|>role<|end_header_id|>\\n\\ncontent<|eot_id|>``.

Content is trimmed, as Meta's template does. Tools follow Llama 3.1's
JSON-calling convention: their signatures go at the top of the first user
turn (into the system turn when there is no user turn), a call is
``{"name": …, "parameters": {…}}`` in the assistant turn, one per line, and a
result is an ``ipython`` turn.
"""

from __future__ import annotations

from shared.conversation import (
    AssistantMessage,
    ContentPart,
    Conversation,
    SystemMessage,
    TextPart,
    Tool,
    ToolMessage,
    UserMessage,
    leading_system,
    text_of,
)
from shared.prompting.base import RenderedPrompt, RenderOptions
from shared.prompting.builder import PromptBuilder
from shared.prompting.tool_json import arguments_text, dumps, tool_signature

BEGIN_OF_TEXT = "<|begin_of_text|>"
START_HEADER = "<|start_header_id|>"
END_HEADER = "<|end_header_id|>"
EOT = "<|eot_id|>"
IMAGE_PLACEHOLDER = "<|image|>"

TOOLS_INTRO = (
    "Given the following functions, please respond with a JSON for a function call with its "
    "proper arguments that best answers the given prompt.\n\n"
    'Respond in the format {"name": function name, "parameters": dictionary of argument name '
    "and its value}.Do not use variables.\n\n"
)


class Llama3Format:
    name = "llama3"

    def render(self, conversation: Conversation, options: RenderOptions) -> RenderedPrompt:
        out = PromptBuilder(options.special_tokens, IMAGE_PLACEHOLDER)
        out.markup(BEGIN_OF_TEXT)
        system, messages = leading_system(conversation.messages)
        system_text = text_of(system.content) if system else options.default_system_prompt
        tools = conversation.tools
        has_user_turn = any(isinstance(message, UserMessage) for message in messages)
        if system_text is not None or (tools and not has_user_turn):
            _header(out, "system")
            _tools_block(out, tools if not has_user_turn else [])
            out.data((system_text or "").strip())
            out.markup(EOT)
        pending_tools = tools if has_user_turn else []
        for message in messages:
            match message:
                case UserMessage():
                    _header(out, "user")
                    _tools_block(out, pending_tools)
                    pending_tools = []
                    _content(out, message.content)
                    out.markup(EOT)
                case SystemMessage():
                    _turn(out, "system", message.content)
                case ToolMessage():
                    _turn(out, "ipython", message.content)
                case AssistantMessage():
                    _assistant_turn(out, message)
        if options.add_generation_prompt and not conversation.continues_last_message:
            _header(out, "assistant")
        return out.build()


def _header(out: PromptBuilder, role: str) -> None:
    out.markup(f"{START_HEADER}{role}{END_HEADER}\n\n")


def _turn(out: PromptBuilder, role: str, content: list[ContentPart]) -> None:
    _header(out, role)
    _content(out, content)
    out.markup(EOT)


def _content(out: PromptBuilder, parts: list[ContentPart], *, keep_end: bool = False) -> None:
    """Parts with the whole text trimmed; a continued turn keeps its trailing text."""
    out.content(_trimmed(parts, keep_end=keep_end))


def _trimmed(parts: list[ContentPart], *, keep_end: bool) -> list[ContentPart]:
    """Whitespace off the ends of the content; text next to an image is kept as is."""
    trimmed = list(parts)
    if trimmed and isinstance(trimmed[0], TextPart):
        trimmed[0] = TextPart(trimmed[0].text.lstrip())
    if trimmed and isinstance(trimmed[-1], TextPart) and not keep_end:
        trimmed[-1] = TextPart(trimmed[-1].text.rstrip())
    return trimmed


def _tools_block(out: PromptBuilder, tools: list[Tool]) -> None:
    if not tools:
        return
    out.markup(TOOLS_INTRO)
    for tool in tools:
        out.data(dumps(tool_signature(tool), indent=4))
        out.markup("\n\n")


def _assistant_turn(out: PromptBuilder, message: AssistantMessage) -> None:
    _header(out, "assistant")
    _content(out, message.content, keep_end=message.prefix)
    for index, call in enumerate(message.tool_calls):
        if index or text_of(message.content).strip():
            out.markup("\n")
        out.markup('{"name": ')
        out.data(dumps(call.name))
        out.markup(', "parameters": ')
        out.data(arguments_text(call.arguments))
        out.markup("}")
    if not message.prefix:
        out.markup(EOT)
