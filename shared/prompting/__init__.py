"""Prompt formats: a Conversation in, prompt text and its control-token spans out.

``render`` is the one entry the request path calls; ``get_format`` finds a
format by the name the model registry gives (``chatml``, ``qwen3``,
``llama3``, ``deepseek_v4``, ``deepseek_v4.1``, or ``jinja`` for the model's
own chat template).
"""

from __future__ import annotations

from collections.abc import Mapping

from shared.conversation import Conversation, ConversationError, ReminderMessage
from shared.prompting import deepseek
from shared.prompting.base import (
    ContentFormat,
    PromptFormat,
    PromptFormatError,
    RenderedPrompt,
    RenderOptions,
)
from shared.prompting.chatml import ChatMLFormat
from shared.prompting.jinja import JinjaFormat
from shared.prompting.llama3 import Llama3Format
from shared.prompting.qwen3 import Qwen3Format

_FORMATS: dict[str, PromptFormat] = {
    format.name: format
    for format in (
        ChatMLFormat(),
        Qwen3Format(),
        Llama3Format(),
        JinjaFormat(),
        deepseek.V4,
        deepseek.V41,
    )
}

FORMAT_NAMES: tuple[str, ...] = tuple(_FORMATS)


def get_format(name: str) -> PromptFormat:
    try:
        return _FORMATS[name]
    except KeyError:
        raise PromptFormatError(
            f"unknown prompt format {name!r}; known formats: {', '.join(FORMAT_NAMES)}"
        ) from None


def render(
    conversation: Conversation,
    format_name: str,
    *,
    special_tokens: Mapping[str, int],
    chat_template: str | None = None,
    default_system_prompt: str | None = None,
    add_generation_prompt: bool = True,
    bos_token: str | None = None,
    eos_token: str | None = None,
    content_format: ContentFormat = "auto",
) -> RenderedPrompt:
    """Validate the conversation and lay it out in the named format.

    Raises ``ConversationError`` for a conversation the format cannot express
    (a 400) and ``PromptFormatError`` for a misconfigured model (a 500).
    """
    prompt_format = get_format(format_name)
    conversation.validate()
    if not isinstance(prompt_format, deepseek.DeepseekFormat):
        _refuse_reminders(conversation, format_name)
    options = RenderOptions(
        special_tokens=special_tokens,
        chat_template=chat_template,
        default_system_prompt=default_system_prompt,
        add_generation_prompt=add_generation_prompt,
        bos_token=bos_token,
        eos_token=eos_token,
        content_format=content_format,
    )
    return prompt_format.render(conversation, options)


def _refuse_reminders(conversation: Conversation, format_name: str) -> None:
    for index, message in enumerate(conversation.messages):
        if isinstance(message, ReminderMessage):
            raise ConversationError(
                f"messages[{index}].role: 'latest_reminder' is a DeepSeek role; the prompt "
                f"format {format_name!r} has none"
            )


__all__ = [
    "FORMAT_NAMES",
    "PromptFormat",
    "PromptFormatError",
    "RenderOptions",
    "RenderedPrompt",
    "get_format",
    "render",
]
