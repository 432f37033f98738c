"""The precision options every entry point offers, importable without the engine.

What they mean, and how ``auto`` resolves, is ``engine.precision``'s.
"""

from __future__ import annotations

import os

QUANTIZATION_CHOICES = ("auto", "none", "stored", "int8", "int4")
DTYPE_HELP = (
    "auto (bfloat16 where the hardware computes it natively and the engine's batch-invariant "
    "kernels run, else float32 on dense weights), float32, bfloat16 or float16; SLUICE_DTYPE "
    "sets the default"
)
QUANTIZATION_HELP = (
    "auto: a CPU engine keeps a GGUF's quantized weights quantized unless it computes in "
    "float32; stored: keep them quantized whatever the dtype (faster in float32, not "
    "batch-invariant); int8 or int4: quantize every linear layer (CPU, bfloat16 or float32); "
    "none: dense weights"
)


def default_dtype() -> str:
    """``SLUICE_DTYPE`` when set (a deployment, or a test run pinning float32), else auto."""
    return os.environ.get("SLUICE_DTYPE", "auto")
