"""Encode a rendered prompt so that only the template's control spans become control ids.

``tokenizers`` matches its added vocabulary (``<|im_start|>``, ``<think>``, …)
anywhere in the text it is given, and has no per-call switch to stop that. So
each tokenizer gets a twin built from the same model, normalizer,
pre-tokenizer and decoder but with no added tokens; everything outside
``special_ranges`` is encoded with the twin, in one ``encode_batch_fast`` call,
and the ranges themselves are looked up in ``special_tokens``. A user who
types ``<|im_end|>`` gets the ids of the characters ``<|im_end|>``.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenizers import Tokenizer

from shared.prompting.base import RenderedPrompt

if TYPE_CHECKING:
    from shared.tokenizer_loader import LoadedTokenizer


class PromptEncodingError(RuntimeError):
    """A rendered prompt that cannot be encoded safely: a bug, never the user's fault."""


@dataclass(slots=True, frozen=True)
class _PlainTwin:
    """The added-vocabulary-free twin of one tokenizer and its control ids."""

    source: Tokenizer  # held so the id() key cannot be reused while cached
    plain: Tokenizer
    control_ids: frozenset[int]


_twins: dict[int, _PlainTwin] = {}
_twins_lock = threading.Lock()


def encode_prompt(rendered: RenderedPrompt, tok: LoadedTokenizer) -> list[int]:
    """Token ids for ``rendered``: control spans as control ids, all else as plain text.

    BOS is prepended when the tokenizer wants it and the prompt does not
    already start with it (templates such as Llama 3's write it themselves).
    """
    pieces = _pieces(rendered, tok.special_tokens)
    texts = [piece for piece in pieces if isinstance(piece, str)]
    twin = plain_twin(tok.tokenizer)
    # the fast variant skips offsets, which nothing here reads
    encodings = twin.plain.encode_batch_fast(texts, add_special_tokens=False) if texts else []
    plain_ids = iter(encoding.ids for encoding in encodings)
    ids: list[int] = []
    for piece in pieces:
        if isinstance(piece, int):
            ids.append(piece)
            continue
        piece_ids = next(plain_ids)
        if not twin.control_ids.isdisjoint(piece_ids):
            raise PromptEncodingError(
                f"plain text {piece[:40]!r}… encoded to a control token id: this tokenizer "
                "can produce control tokens from text and cannot be served safely"
            )
        ids.extend(piece_ids)
    return with_bos(ids, tok)


def encode_text(text: str, tok: LoadedTokenizer, *, control_tokens: bool = False) -> list[int]:
    """A prompt given as text, with no template: BOS when the tokenizer wants it.

    Control-token spellings in ``text`` are plain text unless ``control_tokens``.
    """
    if not control_tokens:
        return encode_prompt(RenderedPrompt(text), tok)
    return with_bos(tok.tokenizer.encode(text, add_special_tokens=False).ids, tok)


def with_bos(ids: list[int], tok: LoadedTokenizer) -> list[int]:
    """``ids`` with BOS first when the tokenizer wants it and they do not start with it."""
    bos = tok.bos_token_id
    if tok.add_bos_token and bos is not None and (not ids or ids[0] != bos):
        ids.insert(0, bos)
    return ids


def plain_twin(tokenizer: Tokenizer) -> _PlainTwin:
    """The cached twin of ``tokenizer``; built once (a JSON round trip) per tokenizer."""
    key = id(tokenizer)
    twin = _twins.get(key)
    if twin is not None and twin.source is tokenizer:
        return twin
    with _twins_lock:
        twin = _twins.get(key)
        if twin is None or twin.source is not tokenizer:
            twin = _build_twin(tokenizer)
            _twins[key] = twin
    return twin


def _build_twin(tokenizer: Tokenizer) -> _PlainTwin:
    spec = json.loads(tokenizer.to_str())
    spec["added_tokens"] = []
    control_ids = frozenset(
        index for index, added in tokenizer.get_added_tokens_decoder().items() if added.special
    )
    return _PlainTwin(tokenizer, Tokenizer.from_str(json.dumps(spec)), control_ids)


def _pieces(rendered: RenderedPrompt, special_tokens: dict[str, int]) -> list[str | int]:
    """The prompt as alternating plain text (str) and control ids (int), in order."""
    prompt = rendered.prompt
    pieces: list[str | int] = []
    position = 0
    for start, end in rendered.special_ranges:
        if not position <= start < end <= len(prompt):
            raise PromptEncodingError(
                f"special range ({start}, {end}) is out of order, empty or outside the "
                f"prompt of {len(prompt)} characters"
            )
        spelling = prompt[start:end]
        token_id = special_tokens.get(spelling)
        if token_id is None:
            raise PromptEncodingError(
                f"special range ({start}, {end}) spells {spelling!r}, "
                "which is not one special token of this tokenizer"
            )
        if start > position:
            pieces.append(prompt[position:start])
        pieces.append(token_id)
        position = end
    if position < len(prompt):
        pieces.append(prompt[position:])
    return pieces


__all__ = ["PromptEncodingError", "encode_prompt", "plain_twin"]
