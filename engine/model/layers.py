"""Building blocks of the Llama family.

``Linear`` is the one place weights meet activations, so a faster variant
(weight-only int8, a fused GPU kernel) replaces it without touching the model.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import RopeScaling
from engine.model import rowwise

GEMM_ROW_STEP = 256
"""Above this many rows, half-precision CPU GEMMs run on a multiple of it; see ``gemm_rows``."""


def gemm_rows(rows: int) -> int:
    """The rows a half-precision CPU GEMM with ``rows`` input rows runs on.

    oneDNN, which runs PyTorch's bfloat16 and float16 GEMMs on a CPU, compiles
    kernels for every shape it meets and keeps the last 1024 (in its primitive
    cache and in ideep's), about 1.2 MiB for each shape of the default model's
    layers. Prefill chunks come in every length, so a server grew by a few MiB
    with each new prompt length, towards a gigabyte. Padded to a power of two up
    to ``GEMM_ROW_STEP`` rows and to a multiple of it above, a weight meets at
    most 8 + max_num_batched_tokens / ``GEMM_ROW_STEP`` shapes (16 for 2048).
    """
    if rows <= GEMM_ROW_STEP:
        return 1 << (rows - 1).bit_length()
    return -(-rows // GEMM_ROW_STEP) * GEMM_ROW_STEP


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` on ``x`` ``[rows, in]``, padded to ``gemm_rows`` where oneDNN runs it.

    A graph being exported has symbolic rows: it computes unpadded. In bfloat16 on a CPU the
    product runs as ``rowwise``'s op, the same GEMM in eager steps and compiled graphs.
    """
    rows = x.shape[0]
    half = x.dtype in (torch.bfloat16, torch.float16)
    if half and x.device.type == "cpu" and isinstance(rows, int):
        x = F.pad(x, (0, 0, 0, gemm_rows(rows) - rows)) if gemm_rows(rows) > rows else x
    if rowwise.serves(x) and weight.dtype == x.dtype:
        return torch.ops.sluice.dense_linear(x, weight, bias)[:rows]
    return F.linear(x, weight, bias)[:rows]


class Linear(nn.Module):
    """y = x Wᵀ (+ b) on dense weights in the engine dtype."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if rowwise.serves(x) and self.weight.dtype == x.dtype:
            return torch.ops.sluice.rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up of ``x`` = [gate, up] along its last dimension."""
    if rowwise.serves(x):
        return torch.ops.sluice.silu_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE (the Hugging Face layout) with precomputed tables.

    ``lookup`` runs once per forward pass; every layer then applies the same
    rows with one ``rotate`` of its concatenated query and key heads.
    """

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: RopeScaling | None = None,
    ):
        super().__init__()
        # float32 throughout, as the reference implementation computes it, so
        # greedy outputs agree token for token.
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        inv_freq = _scale_inv_freq(1.0 / (theta**exponents), scaling)
        angles = torch.outer(torch.arange(max_positions).float(), inv_freq)
        cos, sin = angles.cos(), angles.sin()
        self.register_buffer("cos", torch.cat((cos, cos), -1), persistent=False)
        self.register_buffer("sin", torch.cat((-sin, sin), -1), persistent=False)

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202
        """Moves with the model but stays float32 when the model is cast."""
        cos, sin = self.cos, self.sin
        super()._apply(fn, recurse)
        self.cos = cos.to(self.cos.device)
        self.sin = sin.to(self.sin.device)
        return self

    def lookup(
        self, positions: torch.Tensor, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows for these positions in ``dtype``, shaped to broadcast over heads."""
        return (
            self.cos[positions].unsqueeze(1).to(dtype),
            self.sin[positions].unsqueeze(1).to(dtype),
        )


def rotate(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x ``[tokens, heads, head_dim]`` rotated: x·cos + rotate_half(x)·sin.

    Computed in the dtype of the tables, which is the model's: transformers
    casts its float32 tables to a half-precision model's dtype too.
    """
    cos, sin = rope
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return x * cos + swapped * sin


def _scale_inv_freq(inv_freq: torch.Tensor, scaling: RopeScaling | None) -> torch.Tensor:
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    # llama3: keep high frequencies, divide low ones by factor, blend in between.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    middle = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(middle, blended, scaled)
