"""ChatML, as SmolLM2 and Qwen2.5 use it, with Qwen2.5's tool-calling layout.

``<|im_start|>role\\ncontent<|im_end|>\\n`` per turn. Tools are described in
the system turn inside ``<tools></tools>``; the assistant calls them with
``<tool_call>`` JSON blocks; results come back as a user turn of
``<tool_response>`` blocks, consecutive results sharing one turn. Qwen3's
format is this one plus reasoning blocks (``qwen3.py``).
"""

from __future__ import annotations

from shared.conversation import (
    AssistantMessage,
    Conversation,
    Message,
    SystemMessage,
    Tool,
    ToolCall,
    ToolMessage,
    UserMessage,
    leading_system,
    text_of,
)
from shared.prompting.base import RenderedPrompt, RenderOptions
from shared.prompting.builder import PromptBuilder
from shared.prompting.tool_json import arguments_text, dumps, tool_signature

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
VISION_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"

TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_INSTRUCTIONS = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


class ChatMLFormat:
    """The ``chatml`` prompt format; subclasses change the assistant turn."""

    name = "chatml"
    image_placeholder = VISION_PLACEHOLDER

    def render(self, conversation: Conversation, options: RenderOptions) -> RenderedPrompt:
        out = PromptBuilder(options.special_tokens, self.image_placeholder)
        system, messages = leading_system(conversation.messages)
        system_text = text_of(system.content) if system else options.default_system_prompt
        self.system_turn(out, system_text, conversation.tools)
        last_query = _last_query_index(messages)
        for index, message in enumerate(messages):
            previous = messages[index - 1] if index else None
            following = messages[index + 1] if index + 1 < len(messages) else None
            match message:
                case UserMessage():
                    self.turn(out, "user", message)
                case SystemMessage():
                    self.turn(out, "system", message)
                case AssistantMessage():
                    self.assistant_turn(
                        out, message, after_last_query=index > last_query, is_last=following is None
                    )
                case ToolMessage():
                    self.tool_result(
                        out,
                        message,
                        opens_turn=not isinstance(previous, ToolMessage),
                        closes_turn=not isinstance(following, ToolMessage),
                    )
        if options.add_generation_prompt and not conversation.continues_last_message:
            self.generation_prompt(out, conversation)
        return out.build()

    def system_turn(self, out: PromptBuilder, text: str | None, tools: list[Tool]) -> None:
        """The system turn; with tools it always exists, the prompt text first."""
        if not tools:
            if text is not None:
                out.markup(f"{IM_START}system\n")
                out.data(text)
                out.markup(f"{IM_END}\n")
            return
        out.markup(f"{IM_START}system\n")
        if text is not None:
            out.data(text)
            out.markup("\n\n")
        out.markup(TOOLS_PREAMBLE)
        for tool in tools:
            out.markup("\n")
            out.data(dumps(tool_signature(tool)))
        out.markup(f"{TOOLS_INSTRUCTIONS}{IM_END}\n")

    def turn(self, out: PromptBuilder, role: str, message: SystemMessage | UserMessage) -> None:
        out.markup(f"{IM_START}{role}\n")
        out.content(message.content)
        out.markup(f"{IM_END}\n")

    def assistant_turn(
        self,
        out: PromptBuilder,
        message: AssistantMessage,
        *,
        after_last_query: bool,
        is_last: bool,
    ) -> None:
        """Content, then tool calls; a continued (prefix) turn is left open."""
        out.markup(f"{IM_START}assistant\n")
        content = text_of(message.content)
        out.data(content)
        self.tool_calls(out, message.tool_calls, after_content=bool(content))
        if not message.prefix:
            out.markup(f"{IM_END}\n")

    def tool_calls(self, out: PromptBuilder, calls: list[ToolCall], *, after_content: bool) -> None:
        for index, call in enumerate(calls):
            if index or after_content:
                out.markup("\n")
            out.markup('<tool_call>\n{"name": ')
            out.data(dumps(call.name))
            out.markup(', "arguments": ')
            out.data(arguments_text(call.arguments))
            out.markup("}\n</tool_call>")

    def tool_result(
        self, out: PromptBuilder, message: ToolMessage, *, opens_turn: bool, closes_turn: bool
    ) -> None:
        if opens_turn:
            out.markup(f"{IM_START}user")
        out.markup("\n<tool_response>\n")
        out.content(message.content)
        out.markup("\n</tool_response>")
        if closes_turn:
            out.markup(f"{IM_END}\n")

    def generation_prompt(self, out: PromptBuilder, conversation: Conversation) -> None:
        out.markup(f"{IM_START}assistant\n")


def _last_query_index(messages: list[Message]) -> int:
    """Index of the last real user question (Qwen3 shows reasoning only after it).

    A user message that is nothing but a ``<tool_response>`` block counts as a
    tool result, as in Qwen3's template; with no question at all, no turn
    comes after it.
    """
    for index in range(len(messages) - 1, -1, -1):
        message = messages[index]
        if isinstance(message, UserMessage):
            text = text_of(message.content)
            if not (text.startswith("<tool_response>") and text.endswith("</tool_response>")):
                return index
    return len(messages) - 1
