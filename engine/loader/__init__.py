"""Checkpoint loading: one entry for GGUF files and HF safetensors directories.

Whatever the file format, a checkpoint comes out the same way: an HF
``config.json``-style dict (``ModelConfig.from_hf`` accepts it) and a lazy
stream of tensors under HF parameter names, already dequantized and cast. The
model code therefore knows one naming scheme and one layout; the quirks of
each format (llama.cpp's Q/K row order, shards) stay in its own module here.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from shared.gguf_file import GGUFFile


@dataclass
class Checkpoint:
    """A model's architecture and weights, ready for ``ModelConfig.from_hf``.

    ``tensors`` yields one ``(hf_name, tensor)`` at a time so that peak memory
    stays near one copy of the model; it can be consumed once. ``lm_head.weight``
    is absent when the embeddings are tied.
    """

    config: dict[str, Any]
    tensors: Iterator[tuple[str, torch.Tensor]]
    gguf: GGUFFile | None = None  # a GGUF file's header, for its tokenizer
    stored_bits: dict[str, float | None] = field(default_factory=dict)
    """Bits per weight of each GGUF tensor, by HF name, scales included; None for float ones."""


def load_checkpoint(path: str | Path, dtype: torch.dtype = torch.float32) -> Checkpoint:
    """Open a ``.gguf`` file or an HF directory (``config.json`` + ``*.safetensors``).

    The config is read and validated now, so a bad or unsupported checkpoint
    fails here rather than halfway through building the model.
    """
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        from engine.loader.gguf import load_gguf

        return load_gguf(path, dtype)
    if path.is_dir():
        from engine.loader.hf import load_hf_dir

        return load_hf_dir(path, dtype)
    if not path.exists():
        raise FileNotFoundError(f"model weights not found: {path}")
    raise ValueError(
        f"cannot load weights from {path}: expected a .gguf file or a directory "
        "with config.json and *.safetensors"
    )


__all__ = ["Checkpoint", "load_checkpoint"]
