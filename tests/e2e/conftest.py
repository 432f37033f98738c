"""One real server for the whole end-to-end session.

``python -m api.server`` runs in a subprocess on a free port with the default
model, exactly as ``sluice serve`` would; the fixture waits for ``/ready`` and
kills the process at the end. A short context and few sequences keep the KV
cache (and the suite) small on a two-core machine.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

CONTEXT = 2048
STARTUP_TIMEOUT_S = 300
ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The base URL (``http://127.0.0.1:PORT``) of a ready server."""
    port = _free_port()
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    command = [
        sys.executable, "-m", "api.server",
        "--port", str(port), "--max-model-len", str(CONTEXT), "--max-num-seqs", "4",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    with log_path.open("w") as log:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=log)
    base_url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(base_url, process, log_path)
        yield base_url
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _wait_ready(base_url: str, process: subprocess.Popen, log_path: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"the server exited with {process.returncode}:\n{log_path.read_text()}")
        try:
            if httpx.get(f"{base_url}/ready", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    pytest.fail(f"the server was not ready after {STARTUP_TIMEOUT_S}s:\n{log_path.read_text()}")


@pytest.fixture(scope="session")
def http(server: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server, timeout=60) as client:
        yield client


@pytest.fixture(scope="session")
def openai_client(server: str):
    from openai import OpenAI

    return OpenAI(base_url=f"{server}/v1", api_key="sk-local", max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def anthropic_client(server: str):
    from anthropic import Anthropic

    return Anthropic(base_url=server, api_key="sk-local", max_retries=0, timeout=60)
