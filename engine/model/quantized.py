"""Weight-only int8 and int4 linear layers for CPU decoding.

Single-stream decode reads every weight once per token, so its speed is the
memory bandwidth divided by the model's bytes. Low-bit weights with bfloat16
scales cut those bytes:

- ``Int8Linear``: int8 with one scale per output row (PyTorch's
  ``_weight_int8pack_mm``);
- ``Int4Linear``: 4-bit codes in groups of 32 inputs, each group with its own
  scale and minimum (``_weight_int4pack_mm_for_cpu``). This is GGUF's Q4_1
  layout, and Q4_0 and Q4_K blocks are expressible in it too, so a 4-bit GGUF
  keeps its codes up to the rounding of its scales to bfloat16.

Both kernels work like matrix-vector products: their cost grows with every row
of input. They are vectorized for bfloat16 inputs only (with float32 inputs
they run 5-15x slower, measured on AVX2), so a layer hands them its input in
bfloat16 whatever the model computes in, and returns the model's dtype. Prefill
chunks of ``DENSE_FROM_ROWS`` rows or more dequantize the weight and run the
dense GEMM in the model's dtype instead; decode batches stay on the low-bit
kernel, because dequantizing every weight on every step costs more than it
saves below that size.

Where the CPU has AVX-512 VNNI, the layers run ``vnni_gemm``'s kernels instead (an
int4 layer on the same pack, an int8 layer on its codes in ``int8_pack``'s order), at
every number of rows: they multiply the weights with
int8 activations quantized per row and accumulate in int32, which is exact, so a
row's output is the same bits whatever other rows share its step (a decode batch
of any size, a prefill chunk of any length). ``int4_gemm`` beats PyTorch's int4
kernel at every size; many rows share each weight vector it unpacks.

A tied embedding reads its rows from the quantized head (``QuantizedEmbedding``)
instead of keeping a dense copy of the largest matrix.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
from torch import nn

from engine.model import dequantize, vnni_gemm
from engine.model.layers import Linear, linear
from shared.versions import require

require("torch")  # aten._weight_int8pack_mm and the int4 pack layout are private

DENSE_FROM_ROWS = 96
"""Input rows from which dequantize-then-GEMM beats the low-bit kernels.

Prefill of the default model in float32 on AVX-512 without native bfloat16
costs the same both ways at 96 rows; the kernel wins below (129 vs 170 ms at
64), the GEMM above (224 vs 248 ms at 128). Where bfloat16 is native its GEMM
is faster and the crossover lies lower, at 64 rows or fewer.
"""

AMX_INT4_DENSE_FROM_ROWS = 32
"""``DENSE_FROM_ROWS`` of int4 layers where AMX runs the bfloat16 GEMM and the int4 pack is
dequantized by ``engine.model.dequantize``'s kernel (CPUs with AMX whose VNNI kernels do not
build): a layer of the default model takes 1.11 against 1.47 ms at 32 rows, 1.35 against
2.88 at 64, and 1.04 against 0.75 at 16."""

GROUP_SIZE = 32
"""Inputs sharing one int4 scale and minimum: GGUF's block size."""

_PACK_ROWS = 64
"""Output rows an int4 weight holds in multiples of: every CPU's pack block divides it."""

QUANTIZATIONS = ("int8", "int4")

KERNEL_DTYPE = torch.bfloat16
"""The activations and the scales the low-bit kernels take."""

_CHUNK_ROWS = 4096
"""Rows quantized at a time: a whole 49152-row head in float32 would cost ~450 MB of temporaries."""


class Int8Linear(nn.Module):
    """y = x (s ⊙ W_int8)ᵀ (+ b), with symmetric per-output-row scales s."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        """Quantize ``weight``; its dtype is the one the layer takes and returns."""
        super().__init__()
        self.dtype = weight.dtype
        rows, scales = [], []
        for chunk in weight.split(_CHUNK_ROWS):
            chunk = chunk.float()
            scale = (chunk.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
            rows.append((chunk / scale[:, None]).round().clamp(-127, 127).to(torch.int8))
            scales.append(scale.to(KERNEL_DTYPE))
        codes = torch.cat(rows)
        self.out_features, self.in_features = codes.shape
        # where int8_gemm runs, the layer keeps the codes in its order (and their sums) only
        packs = self.out_features % 16 == 0 and self.in_features % 64 == 0
        packs = packs and vnni_gemm.available()
        pack, sums = torch.ops.sluice.int8_pack(codes) if packs else (None, None)
        self.register_buffer("weight", None if packs else codes)
        self.register_buffer("pack", pack)
        self.register_buffer("sums", sums)
        self.register_buffer("scale", torch.cat(scales))
        self.register_buffer("bias", None if bias is None else bias.to(self.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pack is not None:
            y = torch.ops.sluice.int8_gemm(x.to(KERNEL_DTYPE), self.pack, self.sums, self.scale)
        elif x.shape[0] < DENSE_FROM_ROWS:
            y = torch.ops.aten._weight_int8pack_mm(x.to(KERNEL_DTYPE), self.weight, self.scale)
        else:
            return linear(x, self.dequantized(), self.bias)
        y = y.to(self.dtype)
        return y if self.bias is None else y + self.bias

    def codes(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        """The int8 codes ``[out, in]``, or rows ``ids`` of them."""
        if self.pack is None:
            return self.weight if ids is None else self.weight[ids]
        by_lane = self.pack.view(self.out_features // 16, self.in_features // 4, 16, 4)
        if ids is None:
            return by_lane.transpose(1, 2).reshape(self.out_features, self.in_features)
        return by_lane[ids // 16, :, ids % 16].reshape(*ids.shape, self.in_features)

    def dequantized(self) -> torch.Tensor:
        return self.scale.to(self.dtype)[:, None] * self.codes()  # one pass from the int8 codes

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized weight rows ``ids`` (an embedding lookup on a tied head)."""
        return self.codes(ids).to(self.dtype) * self.scale[ids, None]


@dataclass(frozen=True, slots=True)
class PackLayout:
    """Where PyTorch's CPU int4 pack keeps each output row; it follows the CPU's vector width.

    The pack is ``[out/block, in, block/2]`` bytes. The low nibbles of a
    block's ``block/2`` bytes, then their high nibbles, are its lanes;
    ``lane_of_row[r]`` is the lane of the block's row ``r`` (AVX-512: blocks of
    64 with rows j and j + 32 in one byte; AVX2: 32, rows j and j + 16;
    unvectorized builds: 32, rows 2j and 2j + 1).
    """

    block: int
    lane_of_row: torch.Tensor
    in_order: bool  # the lanes are the rows: no reordering


@cache
def pack_layout() -> PackLayout:
    """Read off the pack of a probe whose two columns spell each row's number in nibbles."""
    number = torch.arange(_PACK_ROWS, dtype=torch.int32)
    low_digit, high_digit = (
        torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            digit[:, None].expand(-1, 2).contiguous(), 1
        ).flatten()
        for digit in (number % 16, number // 16)
    )
    low_nibble = (low_digit & 15).long() + 16 * (high_digit & 15).long()
    high_nibble = (low_digit >> 4).long() + 16 * (high_digit >> 4).long()
    # A block holds column 0 of its rows, then column 1 of the same rows.
    same = (low_nibble == low_nibble[0]) & (high_nibble == high_nibble[0])
    half = int(same[1:].nonzero()[0]) + 1
    lanes = torch.cat((low_nibble[:half], high_nibble[:half]))
    block = 2 * half
    if _PACK_ROWS % block or not torch.equal(lanes.sort().values, torch.arange(block)):
        raise RuntimeError(f"unknown int4 pack layout: lanes {lanes.tolist()}")
    lane_of_row = lanes.argsort()
    return PackLayout(block, lane_of_row, torch.equal(lane_of_row, torch.arange(block)))


class Int4Linear(nn.Module):
    """y = x Wᵀ (+ b) with w = q·s + m, q ∈ 0..15, one (s, m) per group of 32 inputs.

    The codes are stored in PyTorch's CPU int4 pack (``PackLayout``). The
    kernel takes (s, m + 8s) per group, as it subtracts 8 from each code.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        """Quantize ``weight``; its dtype is the one the layer takes and returns."""
        super().__init__()
        if not self.fits(weight):
            shape = tuple(weight.shape)
            raise ValueError(f"int4 needs rows in 64s and columns in 32s, not {shape}")
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        self.layout = pack_layout()  # read here, not while a graph is traced
        packed, scales_and_zeros = zip(*map(self._quantize, weight.split(_CHUNK_ROWS)), strict=True)
        self.register_buffer("weight", torch.cat(packed))  # blocks of 64 rows pack alone
        self.register_buffer("scales_and_zeros", torch.cat(scales_and_zeros, dim=1))
        self.register_buffer("bias", None if bias is None else bias.to(self.dtype))

    @staticmethod
    def _quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows (a multiple of 64) → their pack and ``[in/32, rows, 2]`` scales and zeros."""
        groups = weight.float().reshape(weight.shape[0], -1, GROUP_SIZE)
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)
        scale = ((high - low) / 15).clamp(min=torch.finfo(KERNEL_DTYPE).tiny).to(KERNEL_DTYPE)
        low = low.to(KERNEL_DTYPE)
        codes = (groups - low.float()[..., None]) / scale.float()[..., None]
        codes = codes.round().clamp(0, 15).to(torch.int32).reshape(weight.shape)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        zero = (low.float() + 8 * scale.float()).to(KERNEL_DTYPE)
        return packed, torch.stack((scale.T, zero.T), -1)

    @staticmethod
    def fits(weight: torch.Tensor) -> bool:
        rows, columns = weight.shape
        return rows % _PACK_ROWS == 0 and columns % GROUP_SIZE == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.vnni():
            y = torch.ops.sluice.int4_gemm(x.to(KERNEL_DTYPE), self.weight, self.scales_and_zeros)
        elif torch.compiler.is_exporting() or x.shape[0] < self.dense_from_rows():
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.to(KERNEL_DTYPE), self.weight, GROUP_SIZE, self.scales_and_zeros
            )
        else:
            y = linear(x, self.dequantized_transposed().T)
        y = y.to(self.dtype)
        return y if self.bias is None else y + self.bias

    def vnni(self) -> bool:
        """Whether ``int4_gemm`` runs here on this layer's pack (AVX-512's, rows in order)."""
        return _int4_vnni(self.layout.block, self.layout.in_order)

    def dense_from_rows(self) -> int:
        """Input rows from which this layer, off the VNNI kernel, dequantizes and runs the
        dense GEMM."""
        return _int4_dense_from_rows(self.layout.block, self.layout.in_order, self.dtype)

    def dequantized_transposed(self) -> torch.Tensor:
        """Wᵀ ``[in, out]`` in the layer's dtype."""
        rows, columns = self.out_features, self.in_features
        layout = self.layout
        if dequantize.serves(layout.block, layout.in_order, self.dtype):
            return dequantize.int4_transposed(self.weight, self.scales_and_zeros, self.dtype)
        packed = self.weight.view(rows // layout.block, columns, layout.block // 2)
        lanes = torch.cat((packed & 15, packed >> 4), dim=2)
        codes = lanes if layout.in_order else lanes[..., layout.lane_of_row]
        grouped = codes.transpose(0, 1).reshape(-1, GROUP_SIZE, rows)  # [in/32, 32, out]
        scale, zero = self.scales_and_zeros.unsqueeze(1).float().unbind(-1)  # [in/32, 1, out]
        # One pass from the codes, in float32 as the kernel computes: q·s + (z - 8s).
        weight = torch.addcmul(zero - 8 * scale, grouped, scale)
        return weight.view(columns, rows).to(self.dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized weight rows ``ids`` (an embedding lookup on a tied head)."""
        layout = self.layout
        half = layout.block // 2
        lane = layout.lane_of_row[ids % layout.block]
        packed = self.weight.view(-1, self.in_features, half)
        byte = (lane % half).view(-1, 1, 1).expand(-1, self.in_features, 1)
        pairs = packed[ids // layout.block].gather(2, byte).squeeze(2)  # [len(ids), in]
        codes = torch.where((lane >= half).view(-1, 1), pairs >> 4, pairs & 15)
        scale, zero = self.scales_and_zeros[:, ids].unbind(-1)  # [in/32, len(ids)] each
        count = ids.shape[0]  # not len(ids): an exported graph keeps the count symbolic
        grouped = codes.view(count, -1, GROUP_SIZE).to(self.dtype) - 8
        return (grouped * scale.T[..., None] + zero.T[..., None]).view(count, -1)


def _int4_vnni(block: int, in_order: bool) -> bool:
    return block == 64 and in_order and vnni_gemm.available()


@cache
def _int4_dense_from_rows(block: int, in_order: bool, dtype: torch.dtype) -> int:
    amx = torch.cpu._is_amx_tile_supported()
    if amx and dtype == torch.bfloat16 and dequantize.serves(block, in_order, dtype):
        return AMX_INT4_DENSE_FROM_ROWS
    return DENSE_FROM_ROWS


QuantizedLinear = Int8Linear | Int4Linear


class QuantizedEmbedding(nn.Module):
    """An embedding whose table is a tied, quantized head's weight."""

    def __init__(self, head: QuantizedLinear):
        super().__init__()
        self.head = [head]  # a list, so the head is not registered twice

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head[0].rows(ids)


def check_quantization(method: str) -> None:
    if method not in QUANTIZATIONS:
        raise ValueError(
            f"quantization {method!r} is not supported; use one of {', '.join(QUANTIZATIONS)}"
        )


def quantize(linear: Linear, method: str) -> QuantizedLinear:
    """``linear`` as ``method``; int4 falls back to int8 for shapes its pack cannot hold."""
    weight, bias = linear.weight.data, None if linear.bias is None else linear.bias.data
    if method == "int4" and Int4Linear.fits(weight):
        return Int4Linear(weight, bias)
    return Int8Linear(weight, bias)


def quantize_linears(model: nn.Module, methods: dict[str, str] | str) -> dict[str, str]:
    """Replace ``Linear`` layers of ``model`` in place; return the method each one got.

    ``methods`` names one method for every layer or maps layer names to
    theirs (layers it leaves out stay dense). A tied embedding then reads its
    rows from the quantized head.
    """
    chosen: dict[str, str] = {}
    for name, module in list(model.named_modules()):
        method = methods if isinstance(methods, str) else methods.get(name)
        if not isinstance(module, Linear) or method is None:
            continue
        check_quantization(method)
        parent, _, attribute = name.rpartition(".")
        replacement = quantize(module, method)
        setattr(model.get_submodule(parent), attribute, replacement)
        chosen[name] = "int4" if isinstance(replacement, Int4Linear) else "int8"
    head = getattr(model, "lm_head", None)
    if getattr(model.cfg, "tie_word_embeddings", False) and "lm_head" in chosen:
        model.embed_tokens = QuantizedEmbedding(head)
    return chosen
