"""The CPU's feature flags, as Linux reports them, and what they say about bfloat16."""

from __future__ import annotations

from pathlib import Path


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The first processor's flags (``avx512_vnni``, ``amx_tile``, ...); empty where the file
    cannot be read, as off Linux."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    lines = (line for line in text.splitlines() if line.startswith("flags"))
    return frozenset(next((line.split(":", 1)[1].split() for line in lines), []))


NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def native_bf16_flag(cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """The CPU flag that makes bfloat16 native here, or None (or when the CPU cannot be read)."""
    flags = cpu_flags(cpuinfo)
    return next((flag for flag in NATIVE_BF16_FLAGS if flag in flags), None)
