"""Weight-only int8 linear layers for CPU decoding.

Single-stream decode reads every weight once per token, so its speed is the
memory bandwidth divided by the model's bytes. Storing weights as int8 with one
bfloat16 scale per output row halves the bytes of a bfloat16 model while the
activations stay bfloat16, so outputs stay close to the bfloat16 model's.

PyTorch's int8-weight kernel (``_weight_int8pack_mm``) is fast only with
bfloat16 inputs (20x slower with float32 ones) and works like a
matrix-vector kernel: its cost grows with every row of input. Prefill chunks of
``DENSE_FROM_ROWS`` rows or more dequantize the weight and run the dense GEMM
instead; decode batches stay on the int8 kernel, because dequantizing every
weight on every step costs more than it saves below that size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.layers import Linear
from shared.versions import require

require("torch")  # aten._weight_int8pack_mm is private

DENSE_FROM_ROWS = 64
"""Input rows from which dequantize-then-GEMM beats the int8 kernel (measured on AVX-512)."""

QUANTIZATIONS = ("int8",)


class Int8Linear(nn.Module):
    """y = x (s ⊙ W_int8)ᵀ (+ b), with symmetric per-output-row scales s."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        weight = weight.float()
        scale = (weight.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        quantized = (weight / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
        self.register_buffer("weight", quantized)
        self.register_buffer("scale", scale.to(torch.bfloat16))
        self.register_buffer("bias", None if bias is None else bias.to(torch.bfloat16))

    @classmethod
    def from_linear(cls, linear: Linear) -> Int8Linear:
        return cls(linear.weight.data, None if linear.bias is None else linear.bias.data)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] < DENSE_FROM_ROWS:
            y = torch.ops.aten._weight_int8pack_mm(x, self.weight, self.scale)
            return y if self.bias is None else y + self.bias
        dense = self.weight.to(x.dtype) * self.scale[:, None]
        return F.linear(x, dense, self.bias)


def check_quantization(method: str) -> None:
    if method not in QUANTIZATIONS:
        raise ValueError(
            f"quantization {method!r} is not supported; use one of {', '.join(QUANTIZATIONS)}"
        )


def quantize_linears(model: nn.Module, method: str) -> None:
    """Replace every ``Linear`` of ``model`` in place (tied embeddings keep their copy)."""
    check_quantization(method)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Linear):
                setattr(parent, name, Int8Linear.from_linear(child))
