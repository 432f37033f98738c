"""Which dtype the engine computes in and which width its weights keep.

``dtype="auto"`` picks bfloat16 where the hardware computes it natively
(CUDA; CPUs with AVX512-BF16 or AMX) and float32 elsewhere, because bfloat16
emulated on an older CPU is slower than float32. ``quantization="auto"`` keeps
a checkpoint's block-quantized weights quantized on a CPU unless float32 was
asked for by name: a 4-bit GGUF tensor stays 4-bit (``Int4Linear``), an 8-bit
one 8-bit (``Int8Linear``), and float tensors stay dense. The low-bit kernels
take bfloat16 inputs on every CPU, so a float32 model keeps its weights
quantized too. A model with low-bit layers keeps its KV cache in bfloat16
(as llama.cpp keeps its in float16): its activations already meet bfloat16 at
every such layer, and a float32 cache would double the server's largest
allocation. ``--dtype float32`` keeps exact parity with transformers; the
parity tests pin it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from engine.model.quantized import KERNEL_DTYPE, check_quantization
from shared.cpu import cpu_flags

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
QUANTIZED_DTYPES = ("auto", "bfloat16", "float32")
"""What a model with low-bit layers may compute in: the layers return their model's dtype."""
INT4_MAX_BITS = 5.0
"""Stored widths up to this become int4: Q4_0 and Q4_K are 4.5 bits per weight, Q4_1 5.0."""
INT8_MAX_BITS = 8.5
"""Wider block types up to this (Q5_*, Q6_K, Q8_0) become int8; wider ones stay dense."""


@dataclass(frozen=True, slots=True)
class Precision:
    dtype: torch.dtype
    quantization: str  # "none", "int8", "int4", or "stored": each layer at its checkpoint's width
    reason: str  # why, for the engine's start line

    @property
    def kv_dtype(self) -> torch.dtype:
        """What the KV cache stores; attention computes in ``dtype`` all the same."""
        return self.dtype if self.quantization == "none" else KERNEL_DTYPE


def native_bf16_flag(cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """The CPU flag that makes bfloat16 native here, or None (or when the CPU cannot be read)."""
    flags = cpu_flags(cpuinfo)
    return next((flag for flag in NATIVE_BF16_FLAGS if flag in flags), None)


def resolve_precision(
    dtype: str, quantization: str, device: torch.device, bf16_flag: str | None = None
) -> Precision:
    """Check the pair before anything loads; ``bf16_flag`` is the CPU's, as ``native_bf16_flag``."""
    if quantization not in ("auto", "none"):
        check_quantization(quantization)
        if device.type != "cpu":
            raise ValueError(f"quantization {quantization!r} runs on CPU only, not {device.type}")
        if dtype not in QUANTIZED_DTYPES:
            raise ValueError(
                f"quantization {quantization!r} computes in bfloat16 or float32, not {dtype}"
            )
        chosen = _dtype_for(dtype, device, bf16_flag)
        return Precision(
            chosen.dtype, quantization, f"quantization {quantization}; {chosen.reason}"
        )
    chosen = _dtype_for(dtype, device, bf16_flag)
    if quantization == "none" or device.type != "cpu" or dtype == "float32":
        return chosen
    return Precision(chosen.dtype, "stored", f"{chosen.reason}; quantized weights kept quantized")


def _dtype_for(dtype: str, device: torch.device, bf16_flag: str | None) -> Precision:
    if dtype == "auto":
        if device.type == "cuda":
            return Precision(torch.bfloat16, "none", "dtype auto: bfloat16 on CUDA")
        if bf16_flag is None:
            return Precision(torch.float32, "none", "dtype auto: float32, no native bfloat16 here")
        return Precision(torch.bfloat16, "none", f"dtype auto: bfloat16, the CPU has {bf16_flag}")
    if dtype in DTYPES:
        return Precision(DTYPES[dtype], "none", f"dtype {dtype}")
    raise ValueError(f"dtype {dtype!r} is not supported; use auto, {', '.join(DTYPES)}")


def precision_for(dtype: str, quantization: str, device: torch.device) -> Precision:
    """``resolve_precision`` for this machine's CPU."""
    flag = native_bf16_flag() if device.type == "cpu" else None
    return resolve_precision(dtype, quantization, device, flag)


def stored_methods(layer_bits: dict[str, list[float | None]]) -> dict[str, str]:
    """A method per layer from the stored widths of the tensors fused into it (None: float).

    A layer with a float part, or with no stored widths at all (an HF
    checkpoint's), stays dense.
    """
    methods = {}
    for layer, widths in layer_bits.items():
        if not widths or any(bits is None for bits in widths):
            continue
        if max(widths) <= INT4_MAX_BITS:
            methods[layer] = "int4"
        elif max(widths) <= INT8_MAX_BITS:
            methods[layer] = "int8"
    return methods
