"""Helpers for the jobs tests: a Redis server, records, a model-free backend, a threaded server.

The route tests run the real app (``create_app``) in a uvicorn thread with
``PacedBackend`` instead of an engine, so live streams, reconnects and
cancellation are exercised over real HTTP in well under a second each.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

import pytest
import redis
import uvicorn
from fastapi import FastAPI

from api.backends.base import Backend, BackendHealth, ServedModel
from api.jobs.records import JobRecord
from shared.events import Finish, FinishReason, InferenceEvent, Ready, Text
from shared.registry import default_registry
from shared.tokenizer_loader import load_tokenizer
from shared.wire import PreparedRequest
from tests.servers import free_port


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "distributed: real Redis, worker and API processes (select with -m distributed)"
    )


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``redis-server`` on a free port, without persistence, for the whole session."""
    port = free_port()
    log = (tmp_path_factory.mktemp("jobs-redis") / "redis.log").open("w")
    command = ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no"]
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    client = redis.Redis(port=port)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                process.kill()
                pytest.fail("redis-server did not answer")
            time.sleep(0.05)
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        process.kill()
        process.wait()
        log.close()


def make_record(
    job_id: str = "job_1", *, retention_s: float = 60.0, owner: str | None = None
) -> JobRecord:
    now = time.time()
    return JobRecord(
        id=job_id,
        endpoint="/v1/chat/completions",
        body={"model": "default", "messages": [{"role": "user", "content": "Hi"}]},
        metadata={"batch": "a"},
        owner=owner,
        response_id=f"chatcmpl-{job_id}",
        response_created=int(now),
        created_at=now,
        expires_at=now + retention_s,
    )


class PacedBackend(Backend):
    """A backend without a model: ``max_tokens`` words, one every ``interval`` seconds.

    The text is ``w0 w1 …``, so every run of a request says the same. A
    request asking for ``HOLD`` tokens never starts, like one queued behind
    a full engine. ``started`` and ``closed_early`` record what happened to
    each request id (written on the server's loop, read by the test).
    """

    HOLD = 7

    def __init__(self, interval: float = 0.02) -> None:
        spec = default_registry().resolve("default")
        self._served = ServedModel(spec, load_tokenizer(spec.tokenizer), 2048)
        self.interval = interval
        self.started: list[str] = []
        self.closed_early: list[str] = []

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def health(self) -> BackendHealth:
        return BackendHealth(ready=True)

    def models(self) -> list[ServedModel]:
        return [self._served]

    async def infer(self, request: PreparedRequest) -> AsyncIterator[InferenceEvent]:
        request_id, count = request.request_id, request.sampling.max_tokens
        finished = False
        try:
            if count == self.HOLD:
                await asyncio.Event().wait()
            self.started.append(request_id)
            yield Ready(request_id, len(request.prompt_token_ids), 0)
            for index in range(count):
                await asyncio.sleep(self.interval)
                yield Text(request_id, f"w{index} ", [index])
            finished = True
            yield Finish(request_id, FinishReason.LENGTH, count)
        finally:
            if not finished:
                self.closed_early.append(request_id)


@contextlib.contextmanager
def serve_in_thread(app: FastAPI) -> Iterator[str]:
    """Run ``app`` with uvicorn on a free port in a thread; yields its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            pytest.fail("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)


def sse_events(lines: Iterable[str]) -> Iterator[dict[str, str]]:
    """Parse SSE lines into ``{"id", "event", "data"}`` dicts (fields that were present)."""
    event: dict[str, str] = {}
    for line in lines:
        if not line:
            if event:
                yield event
            event = {}
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        event[name] = value.removeprefix(" ")
    if event:
        yield event


# What differs between two runs of one request: the ids and the times.
VOLATILE = {"id", "item_id", "created", "created_at", "completed_at"}


def stable(value: Any) -> Any:
    """``value`` without what differs between runs (ids and times; all else must match)."""
    if isinstance(value, dict):
        return {k: stable(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [stable(item) for item in value]
    return value
