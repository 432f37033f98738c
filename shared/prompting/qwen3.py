"""Qwen3: ChatML plus ``<think>`` reasoning blocks, as Qwen3's own template lays them out.

Reasoning is shown only in assistant turns after the last user question
(earlier turns' reasoning is dropped, which keeps long conversations short);
the last such turn always gets a block, empty if need be. With thinking
switched off the generation prompt ends with an empty block, which is how
Qwen3 is told not to think (``enable_thinking=False``).
"""

from __future__ import annotations

from shared.conversation import AssistantMessage, Conversation, text_of
from shared.prompting.builder import PromptBuilder
from shared.prompting.chatml import IM_END, IM_START, ChatMLFormat

THINK_OPEN = "<think>\n"
THINK_CLOSE = "\n</think>\n\n"
EMPTY_THINK = "<think>\n\n</think>\n\n"


class Qwen3Format(ChatMLFormat):
    name = "qwen3"

    def assistant_turn(
        self,
        out: PromptBuilder,
        message: AssistantMessage,
        *,
        after_last_query: bool,
        is_last: bool,
    ) -> None:
        reasoning, content = _split_reasoning(message)
        out.markup(f"{IM_START}assistant\n")
        if message.prefix and reasoning and not content and not message.tool_calls:
            # Continuing a turn that has only reasoning so far: stay inside the block.
            out.markup(THINK_OPEN)
            out.data(reasoning.lstrip("\n"))
            return
        if after_last_query and (is_last or reasoning):
            out.markup(THINK_OPEN)
            out.data(reasoning.strip("\n"))
            out.markup(THINK_CLOSE)
            out.data(content.lstrip("\n"))
        else:
            out.data(content)
        self.tool_calls(out, message.tool_calls, after_content=bool(content))
        if not message.prefix:
            out.markup(f"{IM_END}\n")

    def generation_prompt(self, out: PromptBuilder, conversation: Conversation) -> None:
        out.markup(f"{IM_START}assistant\n")
        if conversation.thinking is False:
            out.markup(EMPTY_THINK)


def _split_reasoning(message: AssistantMessage) -> tuple[str, str]:
    """Reasoning and answer; like Qwen3's template, a ``</think>`` left inside the
    content (a client echoing raw model output) is split out when no separate
    reasoning was given."""
    content = text_of(message.content)
    if message.reasoning is not None:
        return message.reasoning, content
    if "</think>" not in content:
        return "", content
    before, _, after = content.partition("</think>")
    reasoning = before.rstrip("\n").split("<think>")[-1].lstrip("\n")
    return reasoning, content.split("</think>")[-1].lstrip("\n")
