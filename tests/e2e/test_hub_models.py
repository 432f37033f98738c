"""``--model org/name`` serves a checkpoint from the local hub cache, offline.

The cache is built on disk in the hub's layout (``models--org--name/refs`` and
``snapshots/<commit>``), so nothing reaches a network: ``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import OpenAI

from tests.engine.test_registry_models import make_tiny_model
from tests.servers import ROOT, running_server

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = tmp_path_factory.mktemp("hub")
    repo = cache / "models--acme--tiny-chat"
    make_tiny_model(repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return cache


def offline(cache: Path) -> dict[str, str]:
    return {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "SLUICE_ENFORCE_EAGER": "1"}


@pytest.fixture(scope="module")
def server(hub_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    args = ["--model", "acme/tiny-chat", "--max-num-seqs", "2"]
    with running_server(args, tmp_path_factory.mktemp("log"), offline(hub_cache)) as url:
        yield url


def test_a_hub_id_serves_from_the_cache(server: str) -> None:
    client = OpenAI(base_url=f"{server}/v1", api_key="sk-local", max_retries=0, timeout=60)
    assert [model.id for model in client.models.list()] == ["acme/tiny-chat"]
    completion = client.chat.completions.create(
        model="acme/tiny-chat",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert completion.usage is not None and completion.usage.completion_tokens == 5


@pytest.mark.parametrize("name", ["acme/not-cached", f"acme/tiny-chat@{'f' * 40}"])
def test_a_hub_id_not_in_the_cache_is_refused_offline(hub_cache: Path, name: str) -> None:
    ended = subprocess.run(
        [sys.executable, "-m", "api.server", "--model", name, "--port", "1"],
        cwd=ROOT,
        env={**os.environ, **offline(hub_cache)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ended.returncode == 2
    assert "is not in the local hub cache and downloads are off" in ended.stderr
