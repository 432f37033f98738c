"""Suite-wide settings that must be in place before torch is imported, and shared references."""

import os
from pathlib import Path
from typing import Any

import pytest

# As the engine sets it (engine/__init__.py), before anything here imports torch.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Engines, servers and workers the suite starts compute in float32 unless a test
# asks otherwise: float32 matches transformers token for token and its outputs do
# not depend on the batch a request shares. The tests of the default precision
# (bfloat16 with quantized weights, on CPUs that compute bfloat16 natively) ask.
os.environ["SLUICE_DTYPE"] = "float32"
# ...and step eagerly: compiling the decode graph costs a minute or two of C++ per
# model and precision. tests/engine/test_compiled.py compiles on purpose.
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
