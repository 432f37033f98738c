"""Strings that remember which of their characters a chat template wrote.

The Jinja format must know, after rendering a model's own template, which
``<|im_start|>`` in the output the template wrote and which one a user typed.
Marking the user's strings cannot be exact: templates strip, split and
re-join message content, and any operation that loses a mark would silently
promote user text to a control token. So the marks go the other way: every
string constant of the template (its text, its literals, the ``bos_token``
it is given) is a ``TemplateText`` whose ``spans`` cover template-written
characters. Concatenation, slicing, stripping and joining carry the spans
along; every other string operation returns a plain ``str``, which counts as
user data. A mark can therefore be lost (a control token rendered as text,
caught by tests) but never forged.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, SupportsIndex

Span = tuple[int, int]


class TemplateText(str):
    """A ``str`` whose ``spans`` are the [start, end) runs the template wrote.

    Built any other way than through ``literal``/``with_spans`` (the sandbox's
    ``format`` rebuilds strings as ``type(s)(result)``) it has no spans.
    """

    spans: tuple[Span, ...] = ()

    @classmethod
    def literal(cls, text: str) -> TemplateText:
        """Text written entirely by the template."""
        return cls.with_spans(str(text), [(0, len(text))] if text else [])

    @classmethod
    def with_spans(cls, text: str, spans: Iterable[Span]) -> TemplateText:
        made = cls(text)
        made.spans = _merged(spans)
        return made

    def __str__(self) -> str:
        # Jinja calls str() on everything it outputs; returning self keeps the spans.
        return self

    def __add__(self, other: object) -> Any:
        if not isinstance(other, str):
            return NotImplemented
        return join_text((self, other))

    def __radd__(self, other: object) -> Any:
        if not isinstance(other, str):
            return NotImplemented
        return join_text((other, self))

    def __getitem__(self, key: SupportsIndex | slice) -> str:
        if not isinstance(key, slice) or key.step not in (None, 1):
            return str.__getitem__(self, key)
        start, stop, _ = key.indices(len(self))
        stop = max(start, stop)
        clipped = [(max(s, start) - start, min(e, stop) - start) for s, e in self.spans]
        return TemplateText.with_spans(str.__getitem__(self, key), clipped)

    def strip(self, chars: str | None = None) -> str:
        return self.lstrip(chars).rstrip(chars)

    def lstrip(self, chars: str | None = None) -> str:
        removed = len(self) - len(str.lstrip(self, chars))
        return self[removed:]

    def rstrip(self, chars: str | None = None) -> str:
        return self[: len(str.rstrip(self, chars))]

    def join(self, iterable: Iterable[str]) -> str:
        pieces: list[str] = []
        for index, item in enumerate(iterable):
            if index:
                pieces.append(self)
            pieces.append(item)
        return join_text(pieces)


def spans_of(text: str) -> tuple[Span, ...]:
    """Template-written spans of any string: none for a plain ``str``."""
    return text.spans if isinstance(text, TemplateText) else ()


def join_text(pieces: Iterable[str]) -> TemplateText:
    """``"".join`` that keeps every piece's spans, shifted to its place."""
    texts: list[str] = []
    spans: list[Span] = []
    offset = 0
    for piece in pieces:
        spans.extend((offset + start, offset + end) for start, end in spans_of(piece))
        texts.append(piece)
        offset += len(piece)
    return TemplateText.with_spans("".join(texts), spans)


def mark_literal(value: Any) -> Any:
    """A template constant with every string inside it marked as template text."""
    if isinstance(value, str):
        return TemplateText.literal(value)
    if isinstance(value, list):
        return [mark_literal(item) for item in value]
    if isinstance(value, tuple):
        return tuple(mark_literal(item) for item in value)
    if isinstance(value, dict):
        return {mark_literal(key): mark_literal(item) for key, item in value.items()}
    return value


def _merged(spans: Iterable[Span]) -> tuple[Span, ...]:
    """Sorted, non-empty, with touching runs joined (so a token split across
    two literals, ``'<|im_' ~ 'start|>'``, is still found whole)."""
    merged: list[Span] = []
    for start, end in sorted(spans):
        if end <= start:
            continue
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return tuple(merged)
