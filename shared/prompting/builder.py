"""Assemble prompt text while keeping template markup apart from user data.

Hand-written formats append two kinds of text: ``markup`` (what the format
itself writes, such as ``<|im_start|>assistant\\n``) and ``data`` (anything
that came from the request). Only markup is searched for special-token
spellings, so a control token can never come out of a user's string.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache

from shared.conversation import ContentPart, ImagePart, ImageSource, TextPart
from shared.prompting.base import RenderedPrompt


def special_pattern(spellings: Iterable[str]) -> re.Pattern[str]:
    """A regex matching any of ``spellings``, leftmost-longest; compiled once per vocabulary.

    Leftmost-longest is how ``tokenizers`` matches its added vocabulary, so a
    spelling that contains a shorter one (``<|im_start|>`` vs ``<|im``) wins.
    """
    return _compiled(frozenset(spellings))


@lru_cache(maxsize=32)
def _compiled(spellings: frozenset[str]) -> re.Pattern[str]:
    longest_first = sorted((s for s in spellings if s), key=lambda s: (-len(s), s))
    return re.compile("|".join(map(re.escape, longest_first)) or "(?!)")  # (?!) never matches


@dataclass(slots=True)
class PromptBuilder:
    """Accumulates a prompt and the control-token spans inside it."""

    special_tokens: Mapping[str, int]
    image_placeholder: str = ""
    _pattern: re.Pattern[str] = field(init=False)
    _pieces: list[str] = field(default_factory=list)
    _length: int = 0
    _ranges: list[tuple[int, int]] = field(default_factory=list)
    _images: list[ImageSource] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._pattern = special_pattern(self.special_tokens)

    def markup(self, text: str) -> None:
        """Text the format writes: its special-token spellings become control spans."""
        for match in self._pattern.finditer(text):
            self._ranges.append((self._length + match.start(), self._length + match.end()))
        self._append(text)

    def data(self, text: str) -> None:
        """Text from the request: never a control token, whatever it spells."""
        self._append(text)

    def content(self, parts: list[ContentPart]) -> None:
        """A message's parts in order, each image replaced by the format's placeholder."""
        for part in parts:
            match part:
                case TextPart(text=text):
                    self.data(text)
                case ImagePart(source=source):
                    self._images.append(source)
                    self.markup(self.image_placeholder)

    def build(self) -> RenderedPrompt:
        return RenderedPrompt(
            prompt="".join(self._pieces),
            special_ranges=list(self._ranges),
            image_sources=list(self._images),
        )

    def _append(self, text: str) -> None:
        self._pieces.append(text)
        self._length += len(text)
