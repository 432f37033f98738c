"""The CPU's feature flags, as Linux reports them."""

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
