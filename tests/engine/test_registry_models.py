"""A model added by a TOML registry runs end to end: HF weights, its own tokenizer files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import transformers

from engine import LLM, SamplingParams
from shared.registry import default_registry
from shared.tokenizer_loader import load_tokenizer


def make_tiny_model(path: Path, **config: Any) -> Path:
    """A random-weight Llama with the default model's tokenizer, saved as an HF directory.

    ``config`` overrides the ``LlamaConfig`` fields.
    """
    tokenizer = load_tokenizer(default_registry().resolve("default").weights)
    fields = dict(
        vocab_size=tokenizer.tokenizer.get_vocab_size(),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    config = transformers.LlamaConfig(**(fields | config))
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    tokenizer.tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "chat_template": tokenizer.chat_template})
    )
    return path


def test_toml_registry_model_generates(tmp_path: Path) -> None:
    weights = make_tiny_model(tmp_path / "tiny")
    registry = tmp_path / "models.toml"
    registry.write_text(
        '[models.tiny-llama]\naliases = ["tiny"]\nweights = "tiny"\n'
        'prompt_format = "chatml"\ncontext_length = 256\n'
    )
    llm = LLM("tiny", registry_file=str(registry), max_num_seqs=4)
    assert llm.engine.max_model_len == 256
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    by_name = llm.generate(["hello there"], params)[0]
    by_path = LLM(str(weights), max_num_seqs=4).generate(["hello there"], params)[0]
    assert len(by_name.token_ids) == 12
    assert by_name.token_ids == by_path.token_ids


def test_an_hf_checkpoint_in_bfloat16_keeps_its_weights_dense(tmp_path: Path) -> None:
    """With dtype bfloat16 a GGUF's quantized layers stay quantized; an HF checkpoint has none."""
    weights = make_tiny_model(tmp_path / "tiny")
    llm = LLM(str(weights), dtype="bfloat16", max_num_seqs=4)
    assert "weights dense" in llm.engine.description
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    assert len(llm.generate(["hello there"], params)[0].token_ids) == 4
