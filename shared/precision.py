"""The precision options every entry point offers, importable without the engine.

What they mean, and how ``auto`` resolves, is ``engine.precision``'s.
"""

from __future__ import annotations

import os

QUANTIZATION_CHOICES = ("auto", "none", "int8", "int4")
DTYPE_HELP = (
    "auto (bfloat16 where the hardware computes it natively, else float32), float32, "
    "bfloat16 or float16; SLUICE_DTYPE sets the default"
)
QUANTIZATION_HELP = (
    "auto: a CPU engine keeps a GGUF's quantized weights quantized unless --dtype is "
    "float32; int8 or int4: quantize every linear layer (CPU, bfloat16 or float32); "
    "none: dense weights"
)


def default_dtype() -> str:
    """``SLUICE_DTYPE`` when set (a deployment, or a test run pinning float32), else auto."""
    return os.environ.get("SLUICE_DTYPE", "auto")
