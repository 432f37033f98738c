"""``engine.native``: each kernel library is built once per cache, and a failed build falls
back to PyTorch's own ops with a warning."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from engine.attention import paged_decode
from engine.model import dequantize, vnni_gemm

# A kernel's module, and a probe that computes with what serves when its build fails.
FALLBACKS = {
    "vnni_gemm": (
        vnni_gemm,
        "from engine.model.quantized import Int4Linear;"
        "layer = Int4Linear(torch.randn(64, 64, dtype=torch.bfloat16), None);"
        "assert layer(torch.randn(4, 64, dtype=torch.bfloat16)).isfinite().all()",
    ),
    "paged_decode": (
        paged_decode,
        "assert not paged_decode.serves(torch.zeros(1, 9, 64), torch.zeros(2, 16, 3, 64))",
    ),
    "dequantize": (
        dequantize,
        "from engine.model.quantized import Int4Linear;"
        "layer = Int4Linear(torch.randn(64, 96, dtype=torch.bfloat16), None);"
        "assert layer.dequantized_transposed().shape == (96, 64)",
    ),
}


def _skip_unless_available(module: ModuleType) -> None:
    if not module.available():
        pytest.skip(f"{module.__name__} does not run here")


def test_a_new_cache_builds_it_once_and_leaves_no_staging_behind(tmp_path: Path) -> None:
    """A process with an empty cache compiles the kernel; the next one loads what it built.

    One kernel stands for all: they are built and kept by the same code (``engine.native``),
    and the suite's own cache builds every one of them when it starts empty."""
    name = "dequantize"
    module = FALLBACKS[name][0]
    _skip_unless_available(module)
    probe = f"from {module.__package__} import {name}; assert {name}.available()"
    env = os.environ | {"SLUICE_CACHE_DIR": str(tmp_path)}
    for _ in range(2):
        subprocess.run([sys.executable, "-c", probe], env=env, check=True, timeout=300)
    [built] = (tmp_path / "kernels").iterdir()
    assert (built / f"{module.NAME}.so").is_file()


@pytest.mark.parametrize("name", FALLBACKS)
def test_a_failed_build_leaves_pytorchs_ops_serving(name: str, tmp_path: Path) -> None:
    """Without a working compiler the engine falls back, with a warning, and still computes."""
    module, computes = FALLBACKS[name]
    _skip_unless_available(module)
    probe = (
        f"import torch; from {module.__package__} import {name};"
        f"assert not {name}.available(); {computes}"
    )
    env = os.environ | {"SLUICE_CACHE_DIR": str(tmp_path), "CXX": str(tmp_path / "no-compiler")}
    done = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert f"{module.NAME} is unavailable" in done.stderr
    assert not any((tmp_path / "kernels").glob("*/*.so"))
