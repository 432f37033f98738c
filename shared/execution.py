"""How an engine runs its steps, as every entry point offers it, importable without the engine."""

from __future__ import annotations

import os

ENFORCE_EAGER_HELP = (
    "run every step eagerly: no compiled decode graph on a CPU (saves the C++ compile at "
    "a machine's first start, about 2 minutes on 2 cores, at some 25%% of decode speed); "
    "SLUICE_ENFORCE_EAGER=1 sets the default"
)


def default_enforce_eager() -> bool:
    """``SLUICE_ENFORCE_EAGER`` when set to anything but 0 (a test run), else False."""
    return os.environ.get("SLUICE_ENFORCE_EAGER", "0") not in ("", "0")
