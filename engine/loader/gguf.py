"""GGUF checkpoints (llama.cpp's format): the header read by ``shared.gguf_file``, tensors
dequantized by the ``gguf`` package.

Three things differ from an HF checkpoint and are undone here:

- tensors may be block-quantized; they are dequantized to float32 one at a
  time, then cast, so peak memory stays near one copy of the model;
- llama.cpp names tensors its own way (``blk.0.attn_q.weight``);
- llama.cpp's converter permutes the rows of the Q and K projections so that
  its RoPE rotates adjacent pairs; HF's RoPE rotates the two halves of each
  head, so the permutation is inverted on load.

Only ``general.architecture == "llama"`` is supported, which also covers
Mistral-style models and SmolLM2 (the default model).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from engine.config import ModelConfig
from engine.loader import Checkpoint
from shared.gguf_file import GGUFFile, GGUFTensor

SUPPORTED_GGUF_ARCHITECTURES = ("llama",)

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_ROPE_FREQS = "rope_freqs.weight"
_FLOAT_TYPES = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}


def load_gguf(path: Path, dtype: torch.dtype) -> Checkpoint:
    """Read the metadata and tensor table now; dequantize tensors as they are iterated."""
    reader = GGUFFile(path)  # kept in the checkpoint: the tokenizer reads the same header
    meta = reader.metadata
    architecture = meta.get("general.architecture")
    if architecture not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(
            f"{path.name}: GGUF architecture {architecture!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    config = _hf_config(meta, reader)
    ModelConfig.from_hf(config)
    names = {tensor.name: hf_name(tensor.name) for tensor in reader.tensors}
    tensors = _iter_tensors(reader, names, config, dtype)
    stored_bits = {
        names[tensor.name]: bits_per_weight(tensor.tensor_type)
        for tensor in reader.tensors
        if names[tensor.name]
    }
    return Checkpoint(config=config, tensors=tensors, gguf=reader, stored_bits=stored_bits)


def bits_per_weight(kind: GGMLQuantizationType) -> float | None:
    """A block-quantized type's bits per weight, scales included; None for float types."""
    if kind in _FLOAT_TYPES:
        return None
    block_size, block_bytes = GGML_QUANT_SIZES[kind]
    return 8 * block_bytes / block_size


def hf_name(gguf_name: str) -> str | None:
    """The HF parameter name for a llama.cpp tensor name; None for tensors HF has no parameter for.

    ``rope_freqs.weight`` is the only such tensor: it is folded into the
    config's ``rope_scaling`` instead.
    """
    if gguf_name == _ROPE_FREQS:
        return None
    stem, _, kind = gguf_name.rpartition(".")
    if stem in _GLOBAL_NAMES and kind == "weight":
        return f"{_GLOBAL_NAMES[stem]}.weight"
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
    raise ValueError(
        f"GGUF tensor {gguf_name!r} has no counterpart in a dense Llama model "
        "(mixture-of-experts and multimodal GGUFs are not supported)"
    )


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Invert llama.cpp's ``permute(w, n_head, n_head_kv)`` on a Q or K projection.

    The converter reshapes the rows to ``(heads, 2, head_dim // 2)`` and swaps
    the last two axes, interleaving each head's two halves. Reshaping to
    ``(heads, head_dim // 2, 2)`` and swapping back restores HF's order. Pass
    the query head count for Q and the key/value head count for K.
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return (
        weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def dequantize_tensor(tensor: GGUFTensor) -> np.ndarray:
    """A tensor's values as float32 in HF's (out_features, in_features) layout.

    GGUF lists dimensions innermost first; reversed, they are the row-major shape, so the
    result needs no transpose.
    """
    try:
        values = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise ValueError(
            f"GGUF tensor {tensor.name!r} has type {tensor.tensor_type.name}, "
            "which cannot be dequantized"
        ) from exc
    shape = tuple(reversed(tensor.shape))
    return values.astype(np.float32, copy=False).reshape(shape)


def _iter_tensors(
    reader: GGUFFile, names: dict[str, str | None], config: dict[str, Any], dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    heads = {
        "q_proj": config["num_attention_heads"],
        "k_proj": config["num_key_value_heads"],
    }
    for tensor in reader.tensors:
        name = names[tensor.name]
        if name is None:
            continue
        values = dequantize_tensor(tensor)
        projection = name.split(".")[-2]
        if projection in heads:
            values = unpermute_rows(values, heads[projection])
        yield name, _to_torch(values, dtype)


def _to_torch(values: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    # F32 tensors come back as read-only views of the memory-mapped file.
    if not values.flags.writeable:
        values = values.copy()
    return torch.from_numpy(values).to(dtype).contiguous()


def _require(meta: dict[str, Any], key: str) -> Any:
    value = meta.get(key)
    if value is None:
        raise ValueError(f"GGUF metadata is missing {key!r}")
    return value


def _hf_config(meta: dict[str, Any], reader: GGUFFile) -> dict[str, Any]:
    arch = _require(meta, "general.architecture")
    num_heads = int(_require(meta, f"{arch}.attention.head_count"))
    hidden_size = int(_require(meta, f"{arch}.embedding_length"))
    head_dim = int(
        meta.get(f"{arch}.attention.key_length")
        or meta.get(f"{arch}.rope.dimension_count")
        or hidden_size // num_heads
    )
    rope_theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    tensor_names = {tensor.name for tensor in reader.tensors}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": _vocab_size(meta, reader),
        "hidden_size": hidden_size,
        "intermediate_size": int(_require(meta, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_require(meta, f"{arch}.block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv") or num_heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": rope_theta,
        "max_position_embeddings": int(meta.get(f"{arch}.context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "rope_scaling": _rope_scaling(meta, reader, head_dim, rope_theta),
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }


def _vocab_size(meta: dict[str, Any], reader: GGUFFile) -> int:
    arch = _require(meta, "general.architecture")
    if size := meta.get(f"{arch}.vocab_size"):
        return int(size)
    if tokens := meta.get("tokenizer.ggml.tokens"):
        return len(tokens)
    embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
    return int(embedding.shape[-1])


def _rope_scaling(
    meta: dict[str, Any], reader: GGUFFile, head_dim: int, rope_theta: float
) -> dict[str, Any] | None:
    """HF's ``rope_scaling`` from the ``rope.scaling.*`` keys or a ``rope_freqs`` tensor.

    Llama 3.1+ GGUFs carry no scaling keys: the converter bakes the "llama3"
    scaling into per-frequency factors (``rope_freqs.weight``).
    """
    arch = _require(meta, "general.architecture")
    original = meta.get(f"{arch}.rope.scaling.original_context_length")
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind not in (None, "none"):
        scaling = {"rope_type": kind, "factor": float(meta.get(f"{arch}.rope.scaling.factor", 1))}
        if original:
            scaling["original_max_position_embeddings"] = int(original)
        return scaling
    freqs = next((t for t in reader.tensors if t.name == _ROPE_FREQS), None)
    if freqs is None:
        return None
    factors = dequantize_tensor(freqs).reshape(-1)
    return llama3_scaling_from_factors(factors, head_dim, rope_theta, int(original or 8192))


def llama3_scaling_from_factors(
    factors: np.ndarray, head_dim: int, rope_theta: float, original_context: int = 8192
) -> dict[str, Any] | None:
    """Recover the "llama3" ``rope_scaling`` that produced llama.cpp's ``rope_freqs`` factors.

    The factors only determine ``factor`` directly (their maximum); the
    frequency cut-offs are assumed to be Meta's published 1 and 4 and then
    checked by recomputing every factor, so a file scaled some other way is
    rejected instead of being run with the wrong positions.
    """
    if np.allclose(factors, 1.0):
        return None
    scaling = {
        "rope_type": "llama3",
        "factor": float(factors.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": original_context,
    }
    expected = _llama3_factors(head_dim, rope_theta, scaling)
    if expected.shape != factors.shape or not np.allclose(factors, expected, rtol=1e-4):
        raise ValueError(
            "GGUF tensor 'rope_freqs.weight' does not match llama3 rope scaling with "
            f"factor={scaling['factor']}, low_freq_factor=1, high_freq_factor=4, "
            f"original_max_position_embeddings={original_context}; other scalings are not supported"
        )
    return scaling


def _llama3_factors(head_dim: int, rope_theta: float, scaling: dict[str, Any]) -> np.ndarray:
    """llama.cpp's converter: how much each RoPE wavelength is stretched."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    freqs = 1.0 / (rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    factors = []
    for wavelength in 2 * math.pi / freqs:
        if wavelength < original / high:
            factors.append(1.0)
        elif wavelength > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, dtype=np.float32)


__all__ = [
    "SUPPORTED_GGUF_ARCHITECTURES",
    "bits_per_weight",
    "dequantize_tensor",
    "hf_name",
    "llama3_scaling_from_factors",
    "load_gguf",
    "unpermute_rows",
]
