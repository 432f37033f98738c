"""What every prompt format takes and returns.

A format turns a ``Conversation`` into prompt text and says exactly which
characters of it are the model's control tokens (``special_ranges``). That
second half is the safety contract of the request path: only those spans may
become control-token ids; everything else, including any ``<|im_start|>`` a
user typed, is encoded as plain text.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol

from shared.conversation import Conversation, ImageSource

ContentFormat = Literal["auto", "string", "openai"]
CONTENT_FORMATS: tuple[ContentFormat, ...] = ("auto", "string", "openai")


class PromptFormatError(ValueError):
    """A format that cannot be used as configured (unknown name, missing template)."""


@dataclass(slots=True)
class RenderedPrompt:
    """Prompt text plus the [start, end) spans that are control tokens.

    Each span covers exactly one special-token spelling; ``image_sources`` are
    the conversation's images in the order their placeholders appear.
    """

    prompt: str
    special_ranges: list[tuple[int, int]] = field(default_factory=list)
    image_sources: list[ImageSource] = field(default_factory=list)

    def special_texts(self) -> list[str]:
        """The control-token spellings in prompt order: handy for checks and tests."""
        return [self.prompt[start:end] for start, end in self.special_ranges]


@dataclass(slots=True, frozen=True)
class RenderOptions:
    """Model facts a format needs besides the conversation.

    ``special_tokens`` is the tokenizer's spelling -> id map: only those
    spellings, and only where the template writes them, become control spans.
    ``default_system_prompt`` is used by the built-in formats when the
    conversation has no system message (a model's own Jinja template carries
    its default itself). ``bos_token``/``eos_token`` are the spellings chat
    templates read as variables. ``content_format`` is how a chat template
    receives message content: ``string`` (text-only content as one string),
    ``openai`` (always a list of typed parts) or ``auto`` (whichever the
    template reads, ``shared.prompting.jinja.content_format``).
    """

    special_tokens: Mapping[str, int]
    chat_template: str | None = None
    default_system_prompt: str | None = None
    add_generation_prompt: bool = True
    bos_token: str | None = None
    eos_token: str | None = None
    content_format: ContentFormat = "auto"


class PromptFormat(Protocol):
    """A named way to lay out a conversation as prompt text."""

    name: str

    def render(self, conversation: Conversation, options: RenderOptions) -> RenderedPrompt: ...
