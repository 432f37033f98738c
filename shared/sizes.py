"""Byte sizes as people write them on a command line: ``2GiB``, ``512MiB``, ``1.5GB``, ``4096``."""

from __future__ import annotations

import argparse
import re

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")


def parse_bytes(text: str) -> int:
    """A positive whole number of bytes; ``ValueError`` naming the accepted units otherwise."""
    match = _SIZE.fullmatch(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"expected a size such as 512MiB or 2GiB (units: B, KB, MB, GB, "
            f"KiB, MiB, GiB), got {text!r}"
        )
    size = int(float(match.group(1)) * _UNITS[unit])
    if size < 1:
        raise ValueError(f"a size must be at least 1 byte, got {text!r}")
    return size


def byte_size_argument(text: str) -> int:
    """``parse_bytes`` as an argparse type, so the error shows its message."""
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_gpu_memory_utilization(parser: argparse.ArgumentParser) -> None:
    """``--gpu-memory-utilization``, as ``sluice serve``, ``worker`` and ``generate`` take it."""
    parser.add_argument(
        "--gpu-memory-utilization",
        type=fraction_argument,
        default=None,
        metavar="FRACTION",
        help="on a CUDA device, size the KV cache so that the device is this fraction full, "
        "counting the weights, a step's activations and what other processes hold, e.g. 0.9 "
        "(default: sized as --kv-cache-memory's default)",
    )


def fraction_argument(text: str) -> float:
    """An argparse type: a fraction in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction such as 0.9, got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be more than 0 and at most 1, got {value:g}")
    return value
