"""A real ``python -m api.server`` process for tests, as ``sluice serve`` would run it."""

from __future__ import annotations

import itertools
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
STARTUP_TIMEOUT_S = 300

COMPILED = {"SLUICE_ENFORCE_EAGER": "0"}
"""The environment of a server whose tests are about serving: decode steps run through the
compiled graphs, as users run them (the suite's other engines step eagerly). Servers of one
``--max-model-len`` share the graphs the first of them compiled."""


PORTS_PER_PROCESS = 1000
FIRST_PORT = 20000  # below the kernel's ephemeral range, where clients' own ports come from
_next_port = itertools.count()


def free_port() -> int:
    """A free port no other process of the run picks: each pytest process (``pytest -n``)
    takes ports in turn from a block of its own, below the ephemeral ports the kernel
    hands out, so a port chosen here is still free when its server binds it."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    first = FIRST_PORT + int(worker.removeprefix("gw")) * PORTS_PER_PROCESS
    for _ in range(PORTS_PER_PROCESS):
        port = first + next(_next_port) % PORTS_PER_PROCESS
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {first}..{first + PORTS_PER_PROCESS - 1}")


@contextmanager
def running_server(
    args: list[str], log_dir: Path, env: dict[str, str] | None = None
) -> Iterator[str]:
    """Start the server with ``args`` on a free port; yield its base URL once ``/ready``.

    One OpenMP thread and no tokenizer threads: the test process and the server
    share two cores; ``env`` adds to its environment. The process is terminated
    (then killed) on exit.
    """
    port = free_port()
    log_path = log_dir / "server.log"
    command = [sys.executable, "-m", "api.server", "--port", str(port), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
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
        time.sleep(0.1)
    pytest.fail(f"the server was not ready after {STARTUP_TIMEOUT_S}s:\n{log_path.read_text()}")


def server_pid(base_url: str) -> int | None:
    """The server process's id, found by the port in its command line (Linux only)."""
    port = str(urlsplit(base_url).port)
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            words = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if b"api.server" in words and f"--port\0{port}".encode() in b"\0".join(words):
            return int(cmdline.parent.name)
    return None


def rss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    found = re.search(r"VmRSS:\s+(\d+) kB", status)
    return int(found.group(1)) / 1024 if found else None


def cpu_seconds(pid: int) -> float:
    """The CPU time (user and system) the process has used so far (Linux only)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
