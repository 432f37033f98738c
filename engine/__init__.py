"""The inference engine: model, paged KV cache, scheduler, sampler.

Import from here: ``LLM`` for offline use, ``LLMEngine`` for hosts that drive
the step loop themselves. Names resolve lazily so that importing one
submodule (say ``engine.config``) does not load the whole engine.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

# OpenMP's idle worker threads spin for GOMP_SPINCOUNT iterations before they
# sleep. A decode step launches a parallel op every few microseconds, so a
# short spin catches the next op without a futex wake-up, while a thread that
# finds no work soon yields its core to the event loop, a client or another
# process. Measured on 2 cores through ``sluice serve``: sleeping at once
# (OMP_WAIT_POLICY=PASSIVE) halved single-stream decode; 10,000 spins decode
# as fast as libgomp's default 300,000 and hand an idle core back 30x sooner.
# It must be set before torch loads its OpenMP runtime.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")
CACHE_DIR = os.environ.get("SLUICE_CACHE_DIR") or os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "sluice"
)
"""Where the engine keeps what it compiled for this machine (``engine.compiled``): a user's
cache survives a reboot, so only a machine's first start compiles."""
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(CACHE_DIR, "inductor"))

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
