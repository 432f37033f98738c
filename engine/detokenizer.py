"""Incremental detokenization with stop strings.

Text goes out only when it is final: ``DecodeStream`` holds back a token that
ends in half a UTF-8 character, and ``OutputText`` holds back the tail that
could still grow into a stop string. Each piece of text is decoded once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

_PROMPT_CONTEXT = (
    4  # prompt tokens that seed the stream, for tokenizers whose spacing depends on it
)


@dataclass(slots=True)
class OutputText:
    """Decoded output of one request and how much of it has been emitted."""

    tokenizer: Tokenizer
    stream: DecodeStream
    stop: list[str]
    text: str = ""
    emitted: int = 0
    matched_stop: str | None = None
    echo: str = ""  # prompt text the stream will repeat before the first new character
    _hold: int = field(init=False)

    def __post_init__(self) -> None:
        self._hold = max((len(s) for s in self.stop), default=1) - 1

    @classmethod
    def start(
        cls,
        tokenizer: Tokenizer,
        prompt_ids: list[int],
        stop: list[str],
        skip_special_tokens: bool = True,
        resumed: tuple[list[int], int] = ([], 0),
    ) -> OutputText:
        """Start decoding after ``prompt_ids``.

        ``resumed`` is ``(generated ids, characters already emitted)`` when the
        prompt ends with output an earlier attempt produced: that output's text
        is restored so the part it still held back is emitted now.
        """
        seed, pending = _split_incomplete_tail(tokenizer, prompt_ids[-2 * _PROMPT_CONTEXT :])
        stream = DecodeStream(seed[-_PROMPT_CONTEXT:], skip_special_tokens)
        for token_id in pending:  # a character the prompt began and the output will finish
            stream.step(tokenizer, token_id)
        echo = ""
        if pending:
            before = tokenizer.decode(seed, skip_special_tokens=skip_special_tokens)
            whole = tokenizer.decode(seed + pending, skip_special_tokens=skip_special_tokens)
            echo = whole.rstrip("\ufffd")[len(before) :]
        output = cls(tokenizer, stream, [s for s in stop if s], echo=echo)
        generated, emitted = resumed
        if generated:
            decoded = tokenizer.decode(generated, skip_special_tokens=skip_special_tokens)
            output.text = decoded.rstrip("\ufffd")
            output.emitted = min(emitted, len(output.text))
        return output

    def append(self, token_id: int, stops: bool = True) -> bool:
        """Decode one token; True when a stop string now ends the output. Without ``stops``
        (before ``min_tokens``) nothing is searched and the text keeps every stop string."""
        piece = self.stream.step(self.tokenizer, token_id)
        if not piece:
            return False
        if self.echo:
            piece, self.echo = piece.removeprefix(self.echo), ""
        searched_from = max(0, len(self.text) - self._hold)
        self.text += piece
        return stops and self._find_stop(searched_from)

    def take(self, final: bool) -> str:
        """The text that is now safe to emit; everything once finished."""
        end = len(self.text) if final or self.matched_stop else len(self.text) - self._hold
        if end <= self.emitted:
            return ""
        chunk = self.text[self.emitted : end]
        self.emitted = end
        return chunk

    def _find_stop(self, searched_from: int) -> bool:
        best: tuple[int, str] | None = None
        for stop in self.stop:
            index = self.text.find(stop, searched_from)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return False
        self.text = self.text[: best[0]]
        self.matched_stop = best[1]
        return True


def _split_incomplete_tail(tokenizer: Tokenizer, tail: list[int]) -> tuple[list[int], list[int]]:
    """Split off the trailing tokens that end inside a UTF-8 character.

    Seeding the stream with them would make its first output repeat prompt
    text; stepping them through instead lets the first output token complete
    the character.
    """
    cut = len(tail)
    while cut and tokenizer.decode(tail[:cut], skip_special_tokens=False).endswith("\ufffd"):
        cut -= 1
    return tail[:cut], tail[cut:]
