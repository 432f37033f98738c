"""``torch.ops.sluice.rms_norm``, ``silu_mul`` and ``dense_linear``: the per-row bfloat16
operations whose rounding the engine fixes.

Eager steps and the compiled decode graphs call the same kernels
(``rowwise.cpp``), so a row's hidden state does not depend on which of them ran it
or on the rows beside it; PyTorch's eager kernels and inductor's fused loops round
the same formulas differently. They are compiled for this machine on first use
(``engine.native``) and need AVX-512; elsewhere ``serves`` is false and the
layers compute with PyTorch's ops.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch

from engine import native

SOURCE = Path(__file__).with_name("rowwise.cpp")
NAME = "sluice_rowwise"
FLAGS = ("-O3", "-march=x86-64-v4", "-fopenmp")
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq")
"""What the kernels execute: x86-64-v4."""


@cache
def available() -> bool:
    """Whether the kernels run here; builds and loads them on first call."""
    if not native.runs(NAME, SOURCE, FLAGS, CPU_FLAGS, "PyTorch's ops"):
        return False
    torch.library.register_fake("sluice::rms_norm")(_norm_shape)
    torch.library.register_fake("sluice::silu_mul")(_silu_mul_shape)
    torch.library.register_fake("sluice::dense_linear")(_linear_shape)
    return True


def serves(x: torch.Tensor) -> bool:
    """Whether the kernels take ``x``: bfloat16 on a CPU where they run."""
    return x.dtype == torch.bfloat16 and x.device.type == "cpu" and available()


def _norm_shape(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x.new_empty(x.shape)


def _silu_mul_shape(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


def _linear_shape(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))
