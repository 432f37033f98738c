"""``sluice warmup`` compiles ahead what a first start would, so the start compiles nothing.

A tiny model (random weights, real architecture) and a cache directory of the
test's own, holding only the kernels the suite's cache built (``tests/engine/test_native.py``
builds each into an empty cache): the warm-up compiles the decode graphs into it, and
the server started after it loads them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine import CACHE_DIR
from engine.precision import own_kernels_run
from tests.engine.test_registry_models import make_tiny_model
from tests.servers import COMPILED, ROOT, running_server

pytestmark = pytest.mark.slow


def test_a_server_after_warmup_compiles_nothing(tmp_path: Path) -> None:
    weights = str(make_tiny_model(tmp_path / "tiny", hidden_size=64, intermediate_size=128))
    if own_kernels_run():  # built in the suite's cache on the first call
        shutil.copytree(Path(CACHE_DIR) / "kernels", tmp_path / "cache" / "kernels")
    env = {**COMPILED, "SLUICE_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    options = ["--model", weights, "--max-num-seqs", "1"]  # one graph to compile
    warmed = subprocess.run(
        [sys.executable, "-m", "api.cli", "warmup", *options],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert warmed.returncode == 0, warmed.stderr
    assert "decode graphs compiled" in warmed.stdout
    with running_server(options, tmp_path, env):
        log = (tmp_path / "server.log").read_text()
    assert "loaded the decode graphs" in log
    assert "compiling the decode graphs" not in log
