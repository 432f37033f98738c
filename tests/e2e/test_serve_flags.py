"""vLLM's serve flags on a real server: a proxy's root path, and an access log that leaves
successful probes out at INFO."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.servers import running_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def named(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    log_dir = tmp_path_factory.mktemp("named")
    args = [
        "--root-path", "/llm",
        "--max-model-len", "1024", "--max-num-seqs", "2",
    ]  # fmt: skip
    with running_server(args, log_dir, {"SLUICE_ENFORCE_EAGER": "1"}) as base_url:
        yield base_url, log_dir / "server.log"


def test_the_root_path_and_the_quiet_probes(named: tuple[str, Path]):
    base_url, log = named
    assert httpx.get(f"{base_url}/openapi.json").json()["servers"] == [{"url": "/llm"}]
    for _ in range(3):
        assert httpx.get(f"{base_url}/ready").status_code == 200
    assert httpx.post(f"{base_url}/tokenize", json={"prompt": "Hi"}).status_code == 200
    lines = log.read_text().splitlines()  # paths as the client asked, the root path included
    assert not [line for line in lines if " GET /llm/ready " in line and "status=200" in line]
    assert [line for line in lines if " POST /llm/tokenize " in line and "status=200" in line]
