"""The inference engine: model, paged KV cache, scheduler, sampler.

Import from here: ``LLM`` for offline use, ``LLMEngine`` for hosts that drive
the step loop themselves. Names resolve lazily so that importing one
submodule (say ``engine.config``) does not load the whole engine.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "EngineArgs": "engine.config",
    "LLM": "engine.llm",
    "RequestOutput": "engine.llm",
    "LLMEngine": "engine.llm_engine",
    "SamplingParams": "shared.sampling",
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


__all__ = list(_EXPORTS)
