"""Attention backends: the paged part of the model, one small file each."""

from __future__ import annotations

import torch

from engine.attention.base import AttentionBackend, BatchLayout, KVCache


def make_backend(kv_cache: KVCache, device: torch.device) -> AttentionBackend:
    """flashinfer on CUDA when installed; PyTorch everywhere else.

    The CPU path never imports flashinfer.
    """
    if device.type == "cuda":
        try:
            from engine.attention.flashinfer_backend import FlashInferBackend
        except ImportError:
            pass
        else:
            return FlashInferBackend(kv_cache, device)
    from engine.attention.torch_backend import TorchBackend

    return TorchBackend(kv_cache)


__all__ = ["AttentionBackend", "BatchLayout", "KVCache", "make_backend"]
