"""Which dtype the engine computes in and which width its weights keep.

``dtype="auto"`` picks bfloat16 where the hardware computes it natively
(CUDA; CPUs with AVX512-BF16 or AMX, where the engine's own kernels run) and
float32 elsewhere, because bfloat16 emulated on an older CPU is slower than
float32, and because on a CPU the default is batch-invariant: a request's
tokens do not depend on what else the engine is running. On a CPU that
guarantee rests on the engine's kernels (``own_kernels``): int8 activations
with integer accumulation for the low-bit layers (``engine.model.vnni_gemm``),
one attention kernel for every query row (``engine.attention.paged_decode``),
and norms and SiLU of its own (``engine.model.rowwise``), called alike by eager
steps and by the compiled decode graphs. Where they do not run, bfloat16's
rounding would follow the batch, so ``auto`` computes in float32 with dense
weights, as ``--dtype float32`` does: PyTorch's low-bit kernels round their
inputs to bfloat16 along paths chosen by the row count. ``quantization="auto"``
keeps a checkpoint's block-quantized weights quantized on a CPU otherwise: a
4-bit GGUF tensor stays 4-bit (``Int4Linear``), an 8-bit one 8-bit
(``Int8Linear``), and float tensors stay dense; a quantization named
explicitly keeps them quantized whatever the dtype. A model with low-bit
layers keeps its KV cache in bfloat16 (as llama.cpp keeps its in float16): its
activations already meet bfloat16 at every such layer, and a float32 cache
would double the server's largest allocation. ``--dtype float32`` keeps exact
parity with transformers; the parity tests pin it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from engine.attention import paged_decode
from engine.model import rowwise, vnni_gemm
from engine.model.quantized import KERNEL_DTYPE, check_quantization
from shared.cpu import native_bf16_flag

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
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
    batch_invariant: bool = False  # a row's logits are the same bits whatever shares its step

    @property
    def kv_dtype(self) -> torch.dtype:
        """What the KV cache stores; attention computes in ``dtype`` all the same."""
        return self.dtype if self.quantization == "none" else KERNEL_DTYPE


def resolve_precision(
    dtype: str,
    quantization: str,
    device: torch.device,
    bf16_flag: str | None = None,
    own_kernels: bool = True,
) -> Precision:
    """Check the pair before anything loads; ``bf16_flag`` is the CPU's, as ``native_bf16_flag``,
    and ``own_kernels`` whether the engine's kernels run on it (``own_kernels_run``)."""
    precision = _resolve(dtype, quantization, device, bf16_flag, own_kernels)
    invariant = device.type == "cpu" and own_kernels and precision.dtype == torch.bfloat16
    return replace(precision, batch_invariant=invariant)


def _resolve(
    dtype: str, quantization: str, device: torch.device, bf16_flag: str | None, own_kernels: bool
) -> Precision:
    if quantization not in ("auto", "none", "stored"):
        check_quantization(quantization)
        if device.type != "cpu":
            raise ValueError(f"quantization {quantization!r} runs on CPU only, not {device.type}")
        if dtype not in QUANTIZED_DTYPES:
            raise ValueError(
                f"quantization {quantization!r} computes in bfloat16 or float32, not {dtype}"
            )
        chosen = _dtype_for(dtype, device, bf16_flag, own_kernels)
        return Precision(
            chosen.dtype, quantization, f"quantization {quantization}; {chosen.reason}"
        )
    chosen = _dtype_for(dtype, device, bf16_flag, own_kernels)
    if quantization == "stored" and device.type != "cpu":
        raise ValueError(f"quantization 'stored' runs on CPU only, not {device.type}")
    if quantization == "stored":
        return Precision(chosen.dtype, "stored", f"quantization stored; {chosen.reason}")
    if quantization == "none" or device.type != "cpu" or chosen.dtype == torch.float32:
        return chosen
    return Precision(chosen.dtype, "stored", f"{chosen.reason}; quantized weights kept quantized")


def _dtype_for(
    dtype: str, device: torch.device, bf16_flag: str | None, own_kernels: bool
) -> Precision:
    if dtype == "auto":
        if device.type == "cuda":
            return Precision(torch.bfloat16, "none", "dtype auto: bfloat16 on CUDA")
        if bf16_flag is None:
            reason = "dtype auto: float32 with dense weights, no native bfloat16 here"
            return Precision(torch.float32, "none", reason)
        if not own_kernels:
            reason = (
                "dtype auto: float32 with dense weights, the engine's batch-invariant kernels "
                "do not run here"
            )
            return Precision(torch.float32, "none", reason)
        return Precision(torch.bfloat16, "none", f"dtype auto: bfloat16, the CPU has {bf16_flag}")
    if dtype in DTYPES:
        return Precision(DTYPES[dtype], "none", f"dtype {dtype}")
    raise ValueError(f"dtype {dtype!r} is not supported; use auto, {', '.join(DTYPES)}")


def precision_for(dtype: str, quantization: str, device: torch.device) -> Precision:
    """``resolve_precision`` for this machine's CPU."""
    cpu = device.type == "cpu"
    flag = native_bf16_flag() if cpu else None
    return resolve_precision(dtype, quantization, device, flag, cpu and own_kernels_run())


def own_kernels_run() -> bool:
    """Whether the kernels a batch-invariant CPU engine computes with run here (built on the
    first call)."""
    return vnni_gemm.available() and paged_decode.available() and rowwise.available()


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
