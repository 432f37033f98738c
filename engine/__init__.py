"""The inference engine: model, paged KV cache, scheduler, sampler.

Import from here: ``LLM`` for offline use, ``LLMEngine`` for hosts that drive
the step loop themselves. Names resolve lazily so that importing one
submodule (say ``engine.config``) does not load the whole engine.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

# The engine runs beside other threads (the event loop, a worker's I/O) on few
# cores. OpenMP's default spin-waiting then stalls every parallel region while
# a spinning thread is descheduled (10x slower decode measured on 2 cores);
# sleeping waits cost a few microseconds per op instead. It must be set before
# torch loads its OpenMP runtime.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

_EXPORTS = {
    "EngineArgs": "engine.config",
    "LLM": "engine.llm",
    "RequestOutput": "engine.llm",
    "LLMEngine": "engine.llm_engine",
    "SamplingParams": "shared.sampling",
    "StructuredOutputs": "shared.sampling",
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


__all__ = list(_EXPORTS)
