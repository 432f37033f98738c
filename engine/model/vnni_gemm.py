"""``torch.ops.sluice.int4_gemm`` and ``int8_gemm``: low-bit weights times int8 activations
on AVX-512 VNNI.

``int4_gemm`` reads PyTorch's AVX-512 int4 pack as it is, so an int4 layer keeps one
copy of its weights whichever kernel runs. ``int8_gemm`` reads the codes in the order
its instructions take them, which ``int8_pack`` writes once; an int8 layer keeps that
pack in place of its rows; where the CPU has AMX, ``int8_gemm`` takes its tile instructions
from 32 rows up, for the same bits. They are compiled for this machine on first use
(``engine.native``).
Where the CPU lacks the instructions or the build fails, ``available()`` is
false and the layers keep PyTorch's kernels, whose arithmetic changes with the
number of rows. CPUs with AMX run these kernels too: inductor's AMX templates
run many rows faster, but a row's result would then depend on its batch.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch

from engine import native

SOURCE = Path(__file__).with_name("vnni_gemm.cpp")
NAME = "sluice_vnni_gemm"
FLAGS = (
    "-O3",
    "-march=x86-64-v4",
    "-mavx512vnni",
    "-mavx512vbmi",
    "-mamx-tile",
    "-mamx-int8",
    "-fopenmp",
)
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512vbmi")
"""What the kernels execute: x86-64-v4, VNNI's vpdpbusd and VBMI's vpermt2b."""


@cache
def available() -> bool:
    """Whether the kernels run here; builds and loads them on first call."""
    if not native.runs(NAME, SOURCE, FLAGS, CPU_FLAGS, "PyTorch's kernels"):
        return False
    torch.library.register_fake("sluice::int4_gemm")(_int4_shape)
    torch.library.register_fake("sluice::int8_pack")(_int8_pack_shape)
    torch.library.register_fake("sluice::int8_gemm")(_int8_shape)
    return True


def _int4_shape(
    x: torch.Tensor, pack: torch.Tensor, scales_and_zeros: torch.Tensor
) -> torch.Tensor:
    return x.new_empty((x.shape[0], scales_and_zeros.shape[1]), dtype=torch.float32)


def _int8_pack_shape(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, columns = weight.shape
    return (
        weight.new_empty((rows // 16, columns // 4, 64)),
        weight.new_empty((rows // 16, columns // 32, 16), dtype=torch.int32),
    )


def _int8_shape(
    x: torch.Tensor, pack: torch.Tensor, sums: torch.Tensor, scales: torch.Tensor
) -> torch.Tensor:
    return x.new_empty((x.shape[0], scales.shape[0]), dtype=torch.float32)
