"""The precision options every entry point offers, importable without the engine.

What they mean, and how ``auto`` resolves, is ``engine.precision``'s.
"""

from __future__ import annotations

import os

QUANTIZATION_CHOICES = ("auto", "none", "int8", "int4")


def default_dtype() -> str:
    """``SLUICE_DTYPE`` when set (a deployment, or a test run pinning float32), else auto."""
    return os.environ.get("SLUICE_DTYPE", "auto")
