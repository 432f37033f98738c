"""A checkpoint's sampling defaults, from its ``generation_config.json``.

A model's authors publish the sampling they mean it to run with (Qwen3's
``temperature`` 0.6, ``top_p`` 0.95, ``top_k`` 20, say). Like vLLM's
``--generation-config auto``, a request's own values win and the file fills
in only what the request leaves unset; ``max_new_tokens`` is the default
completion budget. ``do_sample`` is not read: a request that wants greedy
asks for temperature 0.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The fields read as numbers, each with the range a request may ask for: (low, high, low open).
_RANGES: dict[str, tuple[float, float, bool]] = {
    "temperature": (0.0, float("inf"), False),
    "top_p": (0.0, 1.0, True),
    "min_p": (0.0, 1.0, False),
    "repetition_penalty": (0.0, float("inf"), True),
}


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """What a request that leaves a field unset gets; None: the API's own default."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None


NO_DEFAULTS = SamplingDefaults()


def sampling_defaults(weights: Path) -> SamplingDefaults:
    """The defaults in ``weights/generation_config.json``; none for a GGUF file or no file.

    A value of the wrong type or range is left out, so a checkpoint's odd
    file cannot make every request fail.
    """
    path = weights / "generation_config.json"
    if not weights.is_dir() or not path.is_file():
        return NO_DEFAULTS
    try:
        config: Any = json.loads(path.read_text())
    except (OSError, ValueError):
        return NO_DEFAULTS
    if not isinstance(config, dict):
        return NO_DEFAULTS
    values: dict[str, Any] = {
        name: float(config[name]) for name in _RANGES if _in_range(config.get(name), name)
    }
    if _integer(config.get("top_k")):
        values["top_k"] = config["top_k"]
    if _integer(config.get("max_new_tokens")):
        values["max_tokens"] = config["max_new_tokens"]
    return SamplingDefaults(**values)


def _in_range(value: Any, name: str) -> bool:
    low, high, low_open = _RANGES[name]
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    return (value > low if low_open else value >= low) and value <= high


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
