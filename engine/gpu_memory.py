"""The KV cache's share of a CUDA device under ``--gpu-memory-utilization``.

The fraction is of the whole device, counting what is already in use on it:
the weights, the CUDA context, other processes. What is left after those and
after the largest step's activations is the KV cache's. The activations are
measured, not estimated: one prefill of ``max_num_batched_tokens`` tokens runs
on a cache just large enough for it, and the allocator's peak above the
weights is what any step may add on top of the cache.
"""

from __future__ import annotations

import torch

from engine.attention import BatchLayout, KVCache, make_backend
from engine.config import EngineArgs, ModelConfig

MiB = 2**20


def check_utilization(args: EngineArgs, device: torch.device) -> None:
    """Refuse a fraction outside (0, 1], one beside another size, or one for a CPU."""
    fraction = args.gpu_memory_utilization
    if fraction is None:
        return
    if not 0 < fraction <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {fraction:g}")
    if args.kv_cache_bytes is not None or args.num_kv_blocks is not None:
        raise ValueError(
            "gpu_memory_utilization and a KV cache size (kv_cache_memory, num_kv_blocks) "
            "both size the KV cache: give one"
        )
    if device.type != "cuda":
        raise ValueError(
            f"gpu_memory_utilization sizes the KV cache on a CUDA device, and this engine "
            f"runs on {device.type}: size it with kv_cache_memory (--kv-cache-memory)"
        )


def kv_cache_bytes(fraction: float, peak: int, device: torch.device) -> int:
    """Bytes the KV cache may take so that the device stays within ``fraction`` of it,
    given a step's activation ``peak`` (``activation_peak``)."""
    free, total = torch.cuda.mem_get_info(device)
    budget = int(fraction * total) - (total - free) - peak
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization {fraction:g} allows {fraction * total / MiB:.0f} MiB of "
            f"this device's {total / MiB:.0f} MiB, but {(total - free) / MiB:.0f} MiB are in "
            f"use (weights, CUDA context, other processes) and a step's activations take "
            f"{peak / MiB:.0f} MiB more: no room is left for the KV cache"
        )
    return budget


@torch.inference_mode()
def activation_peak(
    model: torch.nn.Module,
    cfg: ModelConfig,
    args: EngineArgs,
    kv_dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
) -> int:
    """Bytes one full prefill chunk allocates above the weights and its KV cache at its peak.

    The chunk is one sequence of ``max_num_batched_tokens`` (or the context
    length, if shorter) whose last ``max_num_seqs`` positions are read out
    and turned into logits, as when that many sequences sample at once.
    """
    tokens = min(args.max_num_batched_tokens, max_model_len)
    blocks = -(-tokens // args.block_size)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    cache = KVCache.allocate(
        cfg.num_layers, blocks, args.block_size, cfg.num_kv_heads, cfg.head_dim, kv_dtype, device
    )
    attention = make_backend(cache, device)
    positions = torch.arange(tokens, device=device)
    attention.plan(
        BatchLayout(
            query_lens=[tokens],
            context_lens=[tokens],
            block_tables=[list(range(blocks))],
            slot_mapping=positions,
        )
    )
    input_ids = torch.zeros(tokens, dtype=torch.long, device=device)
    rows = positions[-min(args.max_num_seqs, tokens) :]
    hidden = model(input_ids, positions, attention, rows)
    logits = model.compute_logits(hidden)
    torch.softmax(logits, dim=-1)  # as sampling does, once per row
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before - cache.k.nbytes - cache.v.nbytes
    del cache, attention, hidden, logits
    torch.cuda.empty_cache()
    return peak
