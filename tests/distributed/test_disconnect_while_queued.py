"""A client that leaves while its job is still queued cancels it before any worker runs it.

The real API process serves the default model in distributed mode against a
Redis of this module's own. No worker consumes the model's queue; a ghost
worker (a registry entry with no consumer behind it) stands in for one, so
admission accepts the request and its job stays queued. A client that
disconnects before the first event must make the API set the request's
cancel flag and publish its id on the cancel channel at once: that is what
lets a worker drop the job without prefill if it already took it; a job
still queued is withdrawn from its list, with its wake token, so no worker
pops it and no autoscaler counts it. A stream nobody starts must still be
refused with a status (503), not a 200 stream holding an error, and its job
is withdrawn too; one a worker accepts starts then, before its prompt is
computed (the test writes the events a worker writes).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import redis

from shared import keys
from shared.events import Accepted, Finish, FinishReason, Ready, Text
from shared.registry import DEFAULT_MODEL
from shared.task_message import queue_lists
from tests.distributed.conftest import Api, GhostWorker, RedisServer, wait_until
from tests.streams import append_events

pytestmark = pytest.mark.distributed

QUEUE_TIMEOUT_S = 4  # far beyond the 1 s the cancel may take, so a late one cannot pass
CANCEL_WITHIN_S = 1.0
MESSAGES = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def queued_api(own_redis: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The API on ``own_redis``, whose jobs stay queued (no worker consumes them)."""
    api = Api(own_redis, tmp_path_factory.mktemp("queued-api"))
    try:
        yield api.ensure("--queue-timeout", str(QUEUE_TIMEOUT_S))
    finally:
        api.stop()


@pytest.fixture
def server(own_redis: RedisServer) -> RedisServer:
    own_redis.client.flushall()
    GhostWorker(own_redis.client).beat(ttl_s=60, capacity=4, max_model_len=1024)  # for admission
    return own_redis


def nothing_queued(server: RedisServer) -> bool:
    """No job in the model's queue lists, and no wake token left for one."""
    queue = keys.queue_name(DEFAULT_MODEL)
    lists = [*queue_lists(queue), keys.queue_wake(queue)]
    return server.client.exists(*lists) == 0


class CancelListener:
    """The request ids published on the cancel channel, read as they come."""

    def __init__(self, client: redis.Redis) -> None:
        self._pubsub = client.pubsub()
        self._pubsub.subscribe(keys.CANCEL_CHANNEL)
        self._pubsub.get_message(timeout=5)  # the subscription is in place from here on
        self.seen: set[str] = set()

    def published(self, request_id: str) -> bool:
        message = self._pubsub.get_message(ignore_subscribe_messages=True, timeout=0.05)
        if message is not None:
            self.seen.add(message["data"])
        return request_id in self.seen

    def close(self) -> None:
        self._pubsub.close()


async def leave_while_queued(base_url: str, path: str, body: dict, server: RedisServer) -> str:
    """POST ``body``, wait until its job is queued, then drop the connection; the request id.

    The request id is read from the model's in-flight set: the client never
    sees it, since no event (and so no response header) comes before it leaves.
    """
    inflight = keys.inflight(DEFAULT_MODEL)
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:

        async def request() -> None:
            async with client.stream("POST", path, json=body) as response:
                await response.aread()

        task = asyncio.create_task(request())
        deadline = time.monotonic() + 10
        while not (queued := await asyncio.to_thread(server.client.zrange, inflight, 0, -1)):
            assert not task.done(), "the request ended before its job was queued"
            assert time.monotonic() < deadline, "the job was never queued"
            await asyncio.sleep(0.02)
        assert not task.done()  # still waiting for its first event
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    return queued[0]  # the client has closed its connection here


@pytest.mark.parametrize(
    ("path", "stream"),
    [("/v1/chat/completions", True), ("/v1/messages", True), ("/v1/chat/completions", False)],
    ids=["chat-stream", "messages-stream", "chat-whole"],
)
def test_a_client_that_leaves_while_queued_cancels_its_job(
    queued_api: str, server: RedisServer, path: str, stream: bool
):
    body = {"model": "default", "messages": MESSAGES, "max_tokens": 8, "stream": stream}
    listener = CancelListener(server.client)
    try:
        request_id = asyncio.run(leave_while_queued(queued_api, path, body, server))
        wait_until(lambda: listener.published(request_id), CANCEL_WITHIN_S, "the cancel", 0)
    finally:
        listener.close()
    assert server.client.get(keys.cancel_flag(request_id)) == "1"
    assert server.client.ttl(keys.cancel_flag(request_id)) > 0  # it expires on its own
    inflight = keys.inflight(DEFAULT_MODEL)
    wait_until(lambda: server.client.zscore(inflight, request_id) is None, 5, "ZREM")
    wait_until(lambda: nothing_queued(server), 5, "the job withdrawn from its queue")


def test_a_stream_nobody_starts_is_still_refused_with_a_status(
    queued_api: str, server: RedisServer
):
    body = {"model": "default", "messages": MESSAGES, "max_tokens": 8, "stream": True}
    began = time.monotonic()
    response = httpx.post(f"{queued_api}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 503  # the queue timeout, before any SSE
    assert response.headers["content-type"].startswith("application/json")
    assert int(response.headers["retry-after"]) > 0
    assert response.json()["error"]["type"] == "overloaded_error"
    assert "No worker started the request" in response.json()["error"]["message"]
    assert QUEUE_TIMEOUT_S <= time.monotonic() - began < QUEUE_TIMEOUT_S + 2
    wait_until(lambda: nothing_queued(server), 5, "the job withdrawn from its queue")


def test_a_stream_starts_when_a_worker_accepts_it_before_its_first_token(
    queued_api: str, server: RedisServer
):
    """The status and headers go out on ``Accepted``; the chunks follow ``Ready``."""
    body = {"model": "default", "messages": MESSAGES, "max_tokens": 8, "stream": True}
    headers_seen = threading.Event()
    request_ids: list[str] = []

    def worker() -> None:
        inflight = keys.inflight(DEFAULT_MODEL)
        queued = wait_until(lambda: server.client.zrange(inflight, 0, -1), 10, "the job queued")
        request_id = queued[0]
        request_ids.append(request_id)
        append_events(server.client, request_id, 1, Accepted(request_id))
        headers_seen.wait(10)  # with no response start by then, the test fails below
        done = Finish(request_id, FinishReason.STOP, 1)
        append_events(
            server.client, request_id, 1, Ready(request_id, 5, 0), Text(request_id, "Hi", [1]), done
        )

    writer = threading.Thread(target=worker)
    writer.start()
    try:
        with httpx.stream(
            "POST", f"{queued_api}/v1/chat/completions", json=body, timeout=30
        ) as response:
            written = server.client.xlen(keys.event_stream(request_ids[0]))
            headers_seen.set()
            text = response.read().decode()
    finally:
        headers_seen.set()
        writer.join()
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert written == 1  # only the Accepted: the prompt is not computed yet
    assert '"content":"Hi"' in text and text.rstrip().endswith("data: [DONE]")
