"""Suite-wide settings that must be in place before torch is imported, and shared references."""

import os
from pathlib import Path
from typing import Any

import pytest
from xdist.scheduler import LoadScopeScheduling

# As the engine sets it (engine/__init__.py), before anything here imports torch.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Engines, servers and workers the suite starts compute in the default precision,
# as users run them (bfloat16 with the GGUF's low-bit weights where the CPU has the
# instructions), and step eagerly unless a test is about serving: compiling the
# decode graphs costs a minute of C++ per model and batch limit, and every process
# of the run shares the one cache of what was compiled (engine.CACHE_DIR). The
# tests that compare with transformers ask for float32, where it is the reference.
os.environ["SLUICE_ENFORCE_EAGER"] = "1"

# Property tests draw the same examples on every run in CI, so a red build is reproducible.
try:
    from hypothesis import settings as _hypothesis_settings

    _hypothesis_settings.register_profile("ci", derandomize=True, print_blob=True)
    if os.environ.get("CI"):
        _hypothesis_settings.load_profile("ci")
except ImportError:  # pragma: no cover - hypothesis is a dev dependency
    pass


@pytest.fixture(scope="session")
def transformers_default() -> Any:
    """transformers' float32 model of the default GGUF (it undoes llama.cpp's Q/K permutation).

    The reference the loader, parity and logprob tests compare with; loaded once (about 12 s).
    """
    transformers = pytest.importorskip("transformers")
    import torch

    from shared.registry import default_registry

    gguf = Path(default_registry().resolve("default").weights)
    return transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    ).eval()


SHARED_ROOMS = ("distributed", "e2e", "jobs", "workers")  # session fixtures are processes


def room(nodeid: str) -> str:
    """The unit of work ``pytest -n`` gives one process whole: a shared room (its fleet,
    server or Redis with a worker starts once, its tests run in order), or a module."""
    path = nodeid.split("::")[0]
    parts = path.split("/")
    return parts[1] if len(parts) > 2 and parts[1] in SHARED_ROOMS else path


class RoomScheduling(LoadScopeScheduling):
    """xdist's scope scheduling with rooms for scopes (``_split_scope``: the pin in
    pyproject.toml; tests/test_rooms.py runs it)."""

    def _split_scope(self, nodeid: str) -> str:
        return room(nodeid)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> RoomScheduling:
    return RoomScheduling(config, log)
