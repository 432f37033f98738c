"""One real server for the whole end-to-end session.

``python -m api.server`` runs in a subprocess on a free port with the default
model and compiled decode steps, exactly as ``sluice serve`` would; the fixture
waits for ``/ready`` and kills the process at the end. A short context and few sequences keep the KV
cache (and the suite) small on a two-core machine.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.servers import COMPILED, running_server

CONTEXT = 2048


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The base URL (``http://127.0.0.1:PORT``) of a ready server."""
    args = ["--max-model-len", str(CONTEXT), "--max-num-seqs", "4"]
    with running_server(args, tmp_path_factory.mktemp("server"), COMPILED) as base_url:
        yield base_url


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
