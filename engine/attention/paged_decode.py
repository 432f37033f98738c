"""``torch.ops.sluice.paged_decode``: attention read straight from the paged KV cache, for
every query row on a CPU.

A decode's token and each token of a prefill chunk are rows of one call, each
attending to its context where the cache holds it; a row's output is the same
bits whatever else the call holds, which the engine's batch invariance rests on
(``engine.precision``). The kernel (``paged_decode.cpp``) reads each key and
value once, from its block, for all the query heads that share its KV head, and
the rows of one prompt share each key and value they load. It is compiled for
this machine on first use (``engine.native``) and needs AVX-512; where the CPU
lacks it or the build fails, ``available()`` is false and decodes attend over
gathered blocks with ``scaled_dot_product_attention``.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch

from engine import native

SOURCE = Path(__file__).with_name("paged_decode.cpp")
NAME = "sluice_paged_decode"
FLAGS = ("-O3", "-march=x86-64-v4", "-fopenmp")
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq")
"""What the kernel executes: x86-64-v4."""

DTYPES = (torch.float32, torch.bfloat16)
"""The dtypes of queries and of the cache that the kernel reads."""

MAX_HEAD_DIM = 256
MAX_GROUP = 8
"""The most query heads that share one KV head."""


@cache
def available() -> bool:
    """Whether the kernel runs here; builds and loads it on first call."""
    if not native.runs(NAME, SOURCE, FLAGS, CPU_FLAGS, "SDPA"):
        return False
    torch.library.register_fake("sluice::paged_decode")(_shape)
    return True


def serves(q: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether the kernel attends queries like ``q`` ``[rows, heads, dim]`` over ``cache``
    ``[..., kv_heads, dim]``."""
    heads, dim = q.shape[1:]
    return (
        q.device.type == "cpu"
        and q.dtype in DTYPES
        and cache.dtype in DTYPES
        and serves_heads(heads, cache.shape[-2], dim)
    )


def serves_heads(heads: int, kv_heads: int, dim: int) -> bool:
    """Whether the kernel runs here for a model of these attention heads."""
    fits = dim % 16 == 0 and dim <= MAX_HEAD_DIM and heads % kv_heads == 0
    return fits and heads // kv_heads <= MAX_GROUP and available()


def attend(
    q: torch.Tensor,
    k_blocks: torch.Tensor,
    v_blocks: torch.Tensor,
    tables: torch.Tensor,
    mask: torch.Tensor,
    new: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """q ``[rows, heads, dim]`` attends to the blocks ``tables [rows, width]`` names in
    ``k_blocks`` / ``v_blocks`` ``[blocks, block_size, kv_heads, dim]`` and then, when
    given, to its row's ``new`` key and value ``[rows, kv_heads, dim]``; ``mask``
    ``[rows, 1, 1, context]`` is added to the scores, and a slot it sets to -inf is not read.
    Returns ``[rows, heads, dim]`` in q's dtype."""
    new_k, new_v = new if new is not None else (None, None)
    return torch.ops.sluice.paged_decode(q, k_blocks, v_blocks, tables, mask, new_k, new_v)


def _shape(
    q: torch.Tensor,
    k_blocks: torch.Tensor,
    v_blocks: torch.Tensor,
    tables: torch.Tensor,
    mask: torch.Tensor,
    new_k: torch.Tensor | None,
    new_v: torch.Tensor | None,
) -> torch.Tensor:
    return q.new_empty(q.shape)  # contiguous, whatever q's strides
