"""Weight-only int8 and int4 linear layers for CPU decoding.

Single-stream decode reads every weight once per token, so its speed is the
memory bandwidth divided by the model's bytes. Low-bit weights with bfloat16
scales cut those bytes while the activations stay bfloat16:

- ``Int8Linear``: int8 with one scale per output row (PyTorch's
  ``_weight_int8pack_mm``);
- ``Int4Linear``: 4-bit codes in groups of 32 inputs, each group with its own
  scale and minimum (``_weight_int4pack_mm_for_cpu``). This is GGUF's Q4_1
  layout, and Q4_0 and Q4_K blocks are expressible in it too, so a 4-bit GGUF
  keeps its codes up to the rounding of its scales to bfloat16.

Both kernels work like matrix-vector products: their cost grows with every row
of input and they are fast only with bfloat16 inputs. Prefill chunks of
``DENSE_FROM_ROWS`` rows or more dequantize the weight and run the dense GEMM
instead; decode batches stay on the low-bit kernel, because dequantizing every
weight on every step costs more than it saves below that size.

A tied embedding reads its rows from the quantized head (``QuantizedEmbedding``)
instead of keeping a dense copy of the largest matrix.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.layers import Linear
from shared.versions import require

require("torch")  # aten._weight_int8pack_mm and the int4 pack layout are private

DENSE_FROM_ROWS = 64
"""Input rows from which dequantize-then-GEMM beats the low-bit kernels (measured on AVX-512)."""

GROUP_SIZE = 32
"""Inputs sharing one int4 scale and minimum: GGUF's block size."""

_PACK_ROWS = 64
"""The int4 pack interleaves output rows in blocks of 64 (two nibbles of 32 lanes)."""

QUANTIZATIONS = ("int8", "int4")

_CHUNK_ROWS = 4096
"""Rows quantized at a time: a whole 49152-row head in float32 would cost ~450 MB of temporaries."""


class Int8Linear(nn.Module):
    """y = x (s ⊙ W_int8)ᵀ (+ b), with symmetric per-output-row scales s."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        rows, scales = [], []
        for chunk in weight.split(_CHUNK_ROWS):
            chunk = chunk.float()
            scale = (chunk.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
            rows.append((chunk / scale[:, None]).round().clamp(-127, 127).to(torch.int8))
            scales.append(scale.to(torch.bfloat16))
        self.register_buffer("weight", torch.cat(rows))
        self.register_buffer("scale", torch.cat(scales))
        self.register_buffer("bias", None if bias is None else bias.to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] < DENSE_FROM_ROWS:
            y = torch.ops.aten._weight_int8pack_mm(x, self.weight, self.scale)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.dequantized(), self.bias)

    def dequantized(self) -> torch.Tensor:
        return self.weight.to(torch.bfloat16) * self.scale[:, None]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized weight rows ``ids`` (an embedding lookup on a tied head)."""
        return self.weight[ids].to(torch.bfloat16) * self.scale[ids, None]


class Int4Linear(nn.Module):
    """y = x Wᵀ (+ b) with w = q·s + m, q ∈ 0..15, one (s, m) per group of 32 inputs.

    The codes are stored in PyTorch's CPU int4 pack, ``[out/64, in, 32]``
    bytes: byte ``[b, k, j]`` holds row ``64b + j`` in its low nibble and row
    ``64b + 32 + j`` in its high nibble. The kernel takes (s, m + 8s) per
    group, as it subtracts 8 from each code.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        if not self.fits(weight):
            shape = tuple(weight.shape)
            raise ValueError(f"int4 needs rows in 64s and columns in 32s, not {shape}")
        self.out_features, self.in_features = weight.shape
        packed, scales_and_zeros = zip(*map(self._quantize, weight.split(_CHUNK_ROWS)), strict=True)
        self.register_buffer("weight", torch.cat(packed))  # blocks of 64 rows pack alone
        self.register_buffer("scales_and_zeros", torch.cat(scales_and_zeros, dim=1))
        self.register_buffer("bias", None if bias is None else bias.to(torch.bfloat16))

    @staticmethod
    def _quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows (a multiple of 64) → their pack and ``[in/32, rows, 2]`` scales and zeros."""
        groups = weight.float().reshape(weight.shape[0], -1, GROUP_SIZE)
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)
        scale = ((high - low) / 15).clamp(min=torch.finfo(torch.bfloat16).tiny).to(torch.bfloat16)
        low = low.to(torch.bfloat16)
        codes = (groups - low.float()[..., None]) / scale.float()[..., None]
        codes = codes.round().clamp(0, 15).to(torch.int32).reshape(weight.shape)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        zero = (low.float() + 8 * scale.float()).to(torch.bfloat16)
        return packed, torch.stack((scale.T, zero.T), -1)

    @staticmethod
    def fits(weight: torch.Tensor) -> bool:
        rows, columns = weight.shape
        return rows % _PACK_ROWS == 0 and columns % GROUP_SIZE == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] < DENSE_FROM_ROWS:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x, self.weight, GROUP_SIZE, self.scales_and_zeros
            )
        else:
            y = x @ self.dequantized_transposed()
        return y if self.bias is None else y + self.bias

    def dequantized_transposed(self) -> torch.Tensor:
        """Wᵀ ``[in, out]`` in bfloat16: the pack's lane order is already the output order."""
        rows, columns = self.out_features, self.in_features
        packed = self.weight.view(rows // _PACK_ROWS, columns, _PACK_ROWS // 2)
        codes = torch.cat((packed & 15, packed >> 4), dim=2).transpose(0, 1).reshape(columns, rows)
        scale, zero = self.scales_and_zeros.unsqueeze(1).unbind(-1)  # [in/32, 1, out] each
        grouped = codes.view(-1, GROUP_SIZE, rows).to(torch.bfloat16)
        return ((grouped - 8) * scale + zero).view(columns, rows)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized weight rows ``ids`` (an embedding lookup on a tied head)."""
        packed = self.weight.view(-1, self.in_features, _PACK_ROWS // 2)
        lane = ids % (_PACK_ROWS // 2)
        lanes = lane.view(-1, 1, 1).expand(-1, self.in_features, 1)
        pairs = packed[ids // _PACK_ROWS].gather(2, lanes).squeeze(2)  # [len(ids), in]
        high = (ids % _PACK_ROWS >= _PACK_ROWS // 2).view(-1, 1)
        codes = torch.where(high, pairs >> 4, pairs & 15)
        scale, zero = self.scales_and_zeros[:, ids].unbind(-1)  # [in/32, len(ids)] each
        grouped = codes.view(len(ids), -1, GROUP_SIZE).to(torch.bfloat16) - 8
        return (grouped * scale.T[..., None] + zero.T[..., None]).view(len(ids), -1)


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
