"""Attention backends: the paged part of the model, one small file each.

PyTorch is the one backend built so far, on every device; the engine names
the backend it runs in its start line (``LLMEngine.description``).
"""

from __future__ import annotations

import torch

from engine.attention.base import AttentionBackend, BatchLayout, KVCache


def make_backend(kv_cache: KVCache, device: torch.device) -> AttentionBackend:
    """The attention backend for ``device``: PyTorch (the CPU path never imports flashinfer)."""
    from engine.attention.torch_backend import TorchBackend

    return TorchBackend(kv_cache)


__all__ = ["AttentionBackend", "BatchLayout", "KVCache", "make_backend"]
