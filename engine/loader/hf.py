"""HF checkpoints: a directory with ``config.json`` and ``*.safetensors``.

Names already match what the model code expects, so the work is finding the
shards (one file, or several listed in ``model.safetensors.index.json``) and
streaming tensors out of them one at a time through safetensors' memory map.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from engine.config import ModelConfig
from engine.loader import Checkpoint

_INDEX = "model.safetensors.index.json"
# Buffers some exporters save next to the parameters; the model recomputes them.
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_hf_dir(path: Path, dtype: torch.dtype) -> Checkpoint:
    """Validate ``config.json`` now (``UnsupportedArchitecture`` if unknown); stream later."""
    config_path = path / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{path} has no config.json; is it an HF model directory?")
    config = json.loads(config_path.read_text())
    model_config = ModelConfig.from_hf(config)
    shards = safetensors_files(path)
    tensors = _iter_tensors(shards, dtype, skip_lm_head=model_config.tie_word_embeddings)
    return Checkpoint(config=config, tensors=tensors)


def safetensors_files(path: Path) -> list[Path]:
    """The weight files of a directory, in the order they should be read."""
    index = path / _INDEX
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{path} has no *.safetensors weights (other formats such as pytorch_model.bin "
            "are not supported)"
        )
    return files


def _iter_tensors(
    shards: list[Path], dtype: torch.dtype, *, skip_lm_head: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    for shard in shards:
        with safe_open(str(shard), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                if _skipped(name, skip_lm_head):
                    continue
                yield name, handle.get_tensor(name).to(dtype)


def _skipped(name: str, skip_lm_head: bool) -> bool:
    """Tied checkpoints sometimes store ``lm_head.weight`` anyway; the contract is to omit it."""
    return name.endswith(_SKIPPED_SUFFIXES) or (skip_lm_head and name == "lm_head.weight")


__all__ = ["load_hf_dir", "safetensors_files"]
