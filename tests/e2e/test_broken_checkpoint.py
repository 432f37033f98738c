"""A checkpoint that cannot load ends ``sluice serve`` and ``sluice worker`` with a non-zero
status and the reason, within seconds: an orchestrator restarts what does not serve."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.engine.test_registry_models import make_tiny_model
from tests.servers import ROOT, free_port

EXIT_WITHIN_S = 90  # the process imports torch and reads the checkpoint first


@pytest.fixture(scope="module")
def broken(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny HF checkpoint whose weights file is cut short."""
    path = make_tiny_model(tmp_path_factory.mktemp("broken") / "tiny")
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    return path


def run(command: list[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SLUICE_ENFORCE_EAGER": "1"}
    return subprocess.run(
        [sys.executable, *command],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=EXIT_WITHIN_S,
    )


def test_serve_exits_with_the_reason(broken: Path) -> None:
    port = free_port()
    ended = run(["-m", "api.server", "--model", str(broken), "--port", str(port)])
    assert ended.returncode == 1, ended.stderr
    last = ended.stderr.strip().splitlines()[-1]
    assert last.startswith("sluice serve: loading the model failed:"), ended.stderr
    with pytest.raises(httpx.TransportError):  # nothing is left listening
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)


def test_worker_exits_with_the_reason(broken: Path) -> None:
    ended = run(["-m", "workers.main", "--model", str(broken), "--redis", "redis://127.0.0.1:1"])
    assert ended.returncode == 2, ended.stderr
    assert ended.stderr.strip().splitlines()[-1].startswith("sluice worker:"), ended.stderr
