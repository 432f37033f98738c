"""``torch.ops.sluice.int4_dequantize``: an int4 layer's weight, dense and transposed, for the
GEMM that prefill chunks run (``engine.model.quantized``).

PyTorch's elementwise ops take the pack apart in several passes (nibbles,
a transposing copy, a float32 product and sum, a cast), which cost two to
five times the GEMM they feed. The kernel (``dequantize.cpp``) reads each
packed byte once and writes each weight once, in the same arithmetic, so its
result is bit for bit the same. It is compiled for this machine on first use
(``engine.native``) and needs AVX-512 and PyTorch's AVX-512 pack; elsewhere
the layers dequantize with PyTorch's ops.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch

from engine import native

SOURCE = Path(__file__).with_name("dequantize.cpp")
NAME = "sluice_dequantize"
FLAGS = ("-O3", "-march=x86-64-v4", "-ffp-contract=off", "-fopenmp")
"""No fused multiply-adds: each product and sum is rounded, as PyTorch's ops round them."""
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq")
"""What the kernel executes: x86-64-v4."""

DTYPES = (torch.float32, torch.bfloat16)
PACK_BLOCK = 64
"""The rows of a block of the pack the kernel reads: AVX-512's, with rows in lane order."""


@cache
def available() -> bool:
    """Whether the kernel runs here; builds and loads it on first call."""
    return native.runs(NAME, SOURCE, FLAGS, CPU_FLAGS, "PyTorch's ops")


def serves(block: int, in_order: bool, dtype: torch.dtype) -> bool:
    """Whether the kernel reads a pack of ``block``-row blocks (lanes in row order when
    ``in_order``) into ``dtype``."""
    return block == PACK_BLOCK and in_order and dtype in DTYPES and available()


def int4_transposed(
    pack: torch.Tensor, scales_and_zeros: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Wᵀ ``[in, out]`` in ``dtype`` from ``pack`` ``[out, in / 2]`` and ``scales_and_zeros``
    ``[in / 32, out, 2]``: w = q·s + (z - 8s)."""
    return torch.ops.sluice.int4_dequantize(pack, scales_and_zeros, dtype)
