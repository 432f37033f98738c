"""Load a model's tokenizer, from a GGUF file or an HF ``tokenizer.json`` directory.

Both the API (to encode prompts) and the engine (to detokenize) need the same
tokenizer, so loads are cached per path. The result bundles what the rest of
the system needs besides the ``tokenizers.Tokenizer`` itself: BOS/EOS, the ids
that end a turn, the special-token spellings (for safe encoding of prompts)
and the chat template.

The returned ``Tokenizer`` never adds BOS for a GGUF and keeps any
post-processor a ``tokenizer.json`` declares; callers that control BOS
themselves should encode with ``add_special_tokens=False`` and prepend
``bos_token_id`` when ``add_bos_token`` is set.

GGUF files describe the tokenizer in metadata rather than ship a
``tokenizer.json``; only byte-level BPE (``tokenizer.ggml.model == "gpt2"``,
the kind SmolLM2, Llama 3 and most recent models use) is rebuilt here.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from shared.gguf_file import GGUFFile

log = logging.getLogger(__name__)

# Spellings that end an assistant turn in the chat formats we serve.
END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|endoftext|>",
    "<|end_of_text|>",
)

SUPPORTED_GGUF_TOKENIZERS = ("gpt2",)

# llama.cpp token types (gguf.TokenType); CONTROL and USER_DEFINED are matched whole.
_CONTROL = 3
_USER_DEFINED = 4

# Pre-tokenizers llama.cpp runs for a ``tokenizer.ggml.pre`` value. The HF
# originals of these models split every digit on its own before the GPT-2
# regex (llama.cpp: a "\p{N}" pass first), so "x  12" is "x", "  ", "1", "2".
_DIGITS_FIRST = frozenset(
    {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Llama 3's family also matches whole vocabulary entries before merging and adds BOS.
_LLAMA3_FAMILY = frozenset({"llama-bpe", "llama3", "llama-v3", "smaug-bpe"})
_GPT2_FAMILY = frozenset({"default", "gpt2", "gpt-2", "mpt", "olmo", "jais"})


@dataclass(frozen=True)
class LoadedTokenizer:
    """A tokenizer plus the facts about it the serving path relies on.

    ``special_tokens`` maps every added-vocabulary spelling (control tokens
    such as ``<|im_start|>`` and user-defined ones such as ``<think>``) to its
    id, so renderers can turn template control spans into ids while user text
    is encoded without them. Shared through a cache: do not mutate.
    """

    tokenizer: Tokenizer
    bos_token_id: int | None
    eos_token_id: int | None
    stop_token_ids: tuple[int, ...]
    special_tokens: dict[str, int]
    chat_template: str | None
    add_bos_token: bool


_LOADED: dict[Path, LoadedTokenizer] = {}  # by path, at most MAX_LOADED: loaded once
MAX_LOADED = 8


def load_tokenizer(path: str | Path, reader: GGUFFile | None = None) -> LoadedTokenizer:
    """A ``.gguf`` file, or a directory with ``tokenizer.json`` (+ ``tokenizer_config.json``).

    ``reader``: the GGUF file already open (the weights' loader has it), so its
    header is not read twice.
    """
    resolved = Path(path).expanduser().resolve()
    loaded = _LOADED.get(resolved)
    if loaded is None:
        loaded = _load(resolved, reader)
        if len(_LOADED) >= MAX_LOADED:
            del _LOADED[next(iter(_LOADED))]  # the oldest
        _LOADED[resolved] = loaded
    return loaded


def _load(path: Path, reader: GGUFFile | None) -> LoadedTokenizer:
    if path.is_file() and path.suffix == ".gguf":
        return _from_gguf(path, reader or GGUFFile(path))
    if (path / "tokenizer.json").is_file():
        return _from_dir(path)
    raise FileNotFoundError(
        f"no tokenizer at {path}: expected a .gguf file or a directory with tokenizer.json"
    )


# --- GGUF ------------------------------------------------------------------


def _from_gguf(path: Path, reader: GGUFFile) -> LoadedTokenizer:
    meta = reader.metadata
    kind = meta.get("tokenizer.ggml.model")
    if kind not in SUPPORTED_GGUF_TOKENIZERS:
        raise ValueError(
            f"{path.name}: GGUF tokenizer model {kind!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_GGUF_TOKENIZERS)}"
        )
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    pre = meta.get("tokenizer.ggml.pre", "default")
    tokenizer = byte_level_bpe(tokens, types, meta.get("tokenizer.ggml.merges") or [], pre)
    special = {
        token: index
        for index, (token, kind) in enumerate(zip(tokens, types, strict=True))
        if kind in (_CONTROL, _USER_DEFINED)
    }
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    extra_stops = [meta.get(f"tokenizer.ggml.{key}_token_id") for key in ("eot", "eom")]
    return LoadedTokenizer(
        tokenizer=tokenizer,
        bos_token_id=bos,
        eos_token_id=eos,
        stop_token_ids=_stop_ids(tokenizer, eos, extra_stops),
        special_tokens=special,
        chat_template=meta.get("tokenizer.chat_template"),
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", pre in _LLAMA3_FAMILY)),
    )


def byte_level_bpe(tokens: list[str], types: list[int], merges: list[str], pre: str) -> Tokenizer:
    """Rebuild a byte-level BPE tokenizer from llama.cpp's vocabulary arrays.

    Control and user-defined tokens keep their spelling and become added
    tokens (special for control), so they match whole and decode verbatim.
    Normal tokens are spelled in GPT-2's byte alphabet; the rare one that is
    not (a converter quirk) is respelled from its UTF-8 bytes.
    """
    alphabet = _bytes_to_unicode()
    spelling = set(alphabet.values())
    vocab: dict[str, int] = {}
    for index, (token, kind) in enumerate(zip(tokens, types, strict=True)):
        if kind not in (_CONTROL, _USER_DEFINED) and not set(token) <= spelling:
            token = "".join(alphabet[byte] for byte in token.encode("utf-8"))
        vocab.setdefault(token, index)
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=pairs,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            ignore_merges=pre in _LLAMA3_FAMILY,
        )
    )
    tokenizer.pre_tokenizer = _pre_tokenizer(pre)
    tokenizer.decoder = decoders.ByteLevel()
    kinds = list(zip(tokens, types, strict=True))
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in kinds if k == _CONTROL]
    )
    tokenizer.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, k in kinds if k == _USER_DEFINED]
    )
    return tokenizer


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The split llama.cpp applies for ``tokenizer.ggml.pre``, as an HF pre-tokenizer."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_FIRST:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _LLAMA3_FAMILY:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if pre not in _GPT2_FAMILY:
        log.warning("GGUF pre-tokenizer %r is not known; splitting text like GPT-2", pre)
    return byte_level


@lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to a printable character (printable bytes map to themselves)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {byte: chr(byte) for byte in printable}
    shifted = 0
    for byte in range(256):
        if byte not in mapping:
            mapping[byte] = chr(256 + shifted)
            shifted += 1
    return mapping


# --- tokenizer.json directories ----------------------------------------------


def _from_dir(path: Path) -> LoadedTokenizer:
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    config = _read_json(path / "tokenizer_config.json")
    generation = _read_json(path / "generation_config.json")
    bos = _token_id(tokenizer, config.get("bos_token"))
    eos = _token_id(tokenizer, config.get("eos_token"))
    generation_eos = generation.get("eos_token_id")
    if isinstance(generation_eos, int):
        generation_eos = [generation_eos]
    if eos is None and generation_eos:
        eos = generation_eos[0]
    special = {
        added.content: index for index, added in tokenizer.get_added_tokens_decoder().items()
    }
    return LoadedTokenizer(
        tokenizer=tokenizer,
        bos_token_id=bos,
        eos_token_id=eos,
        stop_token_ids=_stop_ids(tokenizer, eos, generation_eos or []),
        special_tokens=special,
        chat_template=_chat_template(path, config),
        add_bos_token=_adds_bos(tokenizer, config, bos),
    )


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_id(tokenizer: Tokenizer, token: str | dict[str, Any] | None) -> int | None:
    """``tokenizer_config.json`` spells tokens as a string or as an AddedToken dict."""
    if isinstance(token, dict):
        token = token.get("content")
    return tokenizer.token_to_id(token) if token else None


def _chat_template(path: Path, config: dict[str, Any]) -> str | None:
    """Newer HF repos keep the template in ``chat_template.jinja``; processors saved by
    transformers 4 in ``chat_template.json``; older repos in the tokenizer's config,
    sometimes as a list of named templates of which "default" is the chat one."""
    standalone = path / "chat_template.jinja"
    if standalone.is_file():
        return standalone.read_text()
    template = _read_json(path / "chat_template.json").get("chat_template")
    if isinstance(template, str):
        return template
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template}
        return named.get("default") or next(iter(named.values()), None)
    return template


def _adds_bos(tokenizer: Tokenizer, config: dict[str, Any], bos: int | None) -> bool:
    """Trust the config's flag; otherwise ask the post-processor (Llama 3 declares BOS there)."""
    if "add_bos_token" in config:
        return bool(config["add_bos_token"])
    ids = tokenizer.encode("", add_special_tokens=True).ids
    return bos is not None and bool(ids) and ids[0] == bos


def _stop_ids(tokenizer: Tokenizer, eos: int | None, extra: list[int | None]) -> tuple[int, ...]:
    """EOS first, then the model's other end-of-turn ids, without duplicates."""
    candidates = [eos, *extra, *(tokenizer.token_to_id(t) for t in END_OF_TURN_TOKENS)]
    return tuple(dict.fromkeys(int(i) for i in candidates if i is not None))


__all__ = [
    "END_OF_TURN_TOKENS",
    "SUPPORTED_GGUF_TOKENIZERS",
    "LoadedTokenizer",
    "byte_level_bpe",
    "load_tokenizer",
]
