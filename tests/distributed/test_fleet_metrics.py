"""The fleet gauges of ``/metrics``: queued, in flight, live workers and desired workers.

A real API process (``python -m api.server --redis``) on a Redis of this
module's own, with no worker consuming the queue: the test plays the
workers. Their registry entries and load reports are written by
``workers.heartbeat.Heartbeat`` itself, and a worker "takes" jobs the way
``workers.broker.transport`` does (it pops a wake token, then runs the take
script, which pops the messages, records them in the worker's taken records
and starts them). Jobs get on the queue by submitting HTTP requests, which
stay pending until cancelled.

The point pinned here: a job a worker has reserved has left the list but
still needs a worker, so the desired count is ``ceil((queued + in flight) /
capacity)``, not the list length.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from redis.asyncio import Redis as AsyncRedis

from api.backends.request_queue import RequestQueue
from shared import keys
from shared.registry import DEFAULT_MODEL
from shared.sampling import SamplingParams
from shared.task_message import queue_lists
from shared.wire import Deadlines, PreparedRequest, QueuedRequest
from tests.distributed.conftest import Api, RedisServer
from workers.broker.scripts import TAKE
from workers.broker.transport import START_ARGS
from workers.heartbeat import Heartbeat, WorkerIdentity
from workers.host import HostSnapshot

pytestmark = pytest.mark.distributed

CAPACITY = 2  # per worker, as its heartbeat reports it
Gauges = dict[str, float]


@pytest.fixture(scope="module")
def metrics_api(own_redis: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """An API process on the module's Redis, whose queue no worker consumes."""
    api = Api(own_redis, tmp_path_factory.mktemp("metrics-api"))
    try:
        yield api.ensure("--queue-timeout", "60", "--total-timeout", "120")
    finally:
        api.stop()


@pytest.fixture
def server(own_redis: RedisServer) -> RedisServer:
    own_redis.client.flushall()
    return own_redis


def beat(server: RedisServer, worker_id: str, running: int = 0, waiting: int = 0) -> None:
    """One beat, written by the workers' own code (long TTL: no thread renews the entry)."""
    snapshot = HostSnapshot(
        capacity=CAPACITY, max_model_len=1024, kv_blocks_total=64, running=running,
        waiting=waiting, kv_blocks_used=8 * (running + waiting),
    )  # fmt: skip
    identity = WorkerIdentity(worker_id, DEFAULT_MODEL)
    Heartbeat(server.client, identity, lambda: snapshot, lambda: False, ttl_s=60).beat()


def take(server: RedisServer, worker_id: str, count: int) -> None:
    """Reserve ``count`` jobs as a worker's consumer does: wake on a token, take by script."""
    wake = keys.queue_wake(keys.queue_name(DEFAULT_MODEL))
    assert server.client.rpop(wake) is not None, "no job on the queue"
    taken_key = keys.taken(worker_id)
    script_keys = [taken_key, wake, *queue_lists(keys.queue_name(DEFAULT_MODEL))]
    taken, started = TAKE.bind(server.client)(keys=script_keys, args=[count, 1, *START_ARGS])
    assert len(taken) == 2 * count and len(started) == 2 * count  # every job named and started
    assert server.client.hlen(taken_key) == count  # recorded as the worker's


def fleet_gauges(text: str) -> Gauges:
    """The gauges of the served model, by name: ``sluice_*`` (label ``model``) and vLLM's
    (label ``model_name``)."""
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        if family.type == "gauge"
        for sample in family.samples
        if DEFAULT_MODEL in (sample.labels.get("model"), sample.labels.get("model_name"))
    }


async def scrape_until(
    client: httpx.AsyncClient, condition: Callable[[Gauges], bool], what: str
) -> Gauges:
    """Scrape ``/metrics`` until ``condition`` holds (the API reads the fleet every second)."""
    deadline = time.monotonic() + 10
    while True:
        response = await client.get("/metrics")
        response.raise_for_status()
        gauges = fleet_gauges(response.text)
        if condition(gauges):
            return gauges
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}; last scrape: {gauges}")
        await asyncio.sleep(0.1)


def fleet(gauges: Gauges) -> dict[str, float]:
    """The gauges this module asserts on, without the ``sluice_`` prefix."""
    names = (
        "requests_queued", "requests_in_flight", "requests_outstanding", "workers_live",
        "workers_running_requests", "desired_workers",
    )  # fmt: skip
    vllm = {name: gauges[f"vllm:num_requests_{name}"] for name in ("running", "waiting")}
    return {name: gauges[f"sluice_{name}"] for name in names} | vllm


async def submit(client: httpx.AsyncClient) -> httpx.Response:
    body = {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    return await client.post("/v1/chat/completions", json=body)


def test_taken_jobs_count_as_in_flight_and_keep_the_desired_workers(
    metrics_api: str, server: RedisServer
):
    beat(server, "w1")

    async def scenario() -> list[dict[str, float]]:
        seen = []
        async with httpx.AsyncClient(base_url=metrics_api, timeout=90) as client:
            requests = [asyncio.create_task(submit(client)) for _ in range(3)]
            try:
                gauges = await scrape_until(
                    client, lambda g: g["sluice_requests_queued"] == 3, "3 queued jobs"
                )
                seen.append(fleet(gauges))

                # reserved by w1; one reached its engine
                await asyncio.to_thread(take, server, "w1", 2)
                beat(server, "w1", running=1)
                gauges = await scrape_until(
                    client,
                    lambda g: (
                        g["sluice_requests_queued"] == 1
                        and g["sluice_workers_running_requests"] == 1
                    ),
                    "2 jobs taken",
                )
                seen.append(fleet(gauges))

                beat(server, "w2")
                gauges = await scrape_until(
                    client, lambda g: g["sluice_workers_live"] == 2, "a second worker"
                )
                seen.append(fleet(gauges))
            finally:
                for task in requests:
                    task.cancel()  # the client leaves: the API cancels each request
                await asyncio.gather(*requests, return_exceptions=True)
            gauges = await scrape_until(
                client, lambda g: g["sluice_requests_outstanding"] == 0, "the requests to end"
            )
            seen.append(fleet(gauges))
        return seen

    queued, taken, second_worker, cancelled = asyncio.run(scenario())
    assert queued == {
        "requests_queued": 3, "requests_in_flight": 0, "requests_outstanding": 3,
        "workers_live": 1, "workers_running_requests": 0, "desired_workers": 2,
        "running": 0, "waiting": 3,
    }  # fmt: skip
    # The list holds 1 job, but 3 still need a worker: ceil(3 / 2), not ceil(1 / 2); vLLM's
    # running + waiting is the same 3, the one reserved but not running counted as waiting.
    assert taken == {
        "requests_queued": 1, "requests_in_flight": 2, "requests_outstanding": 3,
        "workers_live": 1, "workers_running_requests": 1, "desired_workers": 2,
        "running": 1, "waiting": 2,
    }  # fmt: skip
    assert second_worker == {**taken, "workers_live": 2}
    # The untaken job was withdrawn from the list: nothing is left to scale for.
    assert cancelled == {
        "requests_queued": 0, "requests_in_flight": 0, "requests_outstanding": 0,
        "workers_live": 2, "workers_running_requests": 1, "desired_workers": 0,
        "running": 1, "waiting": 0,
    }  # fmt: skip


def test_jobs_on_every_priority_list_count_as_queued(metrics_api: str, server: RedisServer):
    beat(server, "w1")

    async def scenario() -> tuple[Gauges, list[int]]:
        client = AsyncRedis.from_url(server.url, decode_responses=True)
        try:
            queue, now = RequestQueue(client), time.time()
            for index, priority in enumerate((0, 4, 9, 9, 9)):
                params = SamplingParams(max_tokens=4, temperature=0.0)
                request = PreparedRequest(
                    f"prio-{index}", DEFAULT_MODEL, [1, 2, 3], params, created=now,
                    priority=priority,
                )  # fmt: skip
                queued = QueuedRequest(request, Deadlines(total=now + 60))
                assert (await queue.put(queued, now + 60)).message
        finally:
            await client.aclose()
        lengths = [server.client.llen(name) for name in queue_lists(keys.queue_name(DEFAULT_MODEL))]
        async with httpx.AsyncClient(base_url=metrics_api, timeout=30) as http:
            gauges = await scrape_until(
                http, lambda g: g["sluice_requests_outstanding"] == 5, "5 outstanding jobs"
            )
        return gauges, lengths

    gauges, lengths = asyncio.run(scenario())
    assert lengths == [1, 1, 0, 3]  # kombu's lists for priorities 0, 3, 6 and 9
    assert fleet(gauges) == {
        "requests_queued": 5, "requests_in_flight": 0, "requests_outstanding": 5,
        "workers_live": 1, "workers_running_requests": 0, "desired_workers": 3,
        "running": 0, "waiting": 5,
    }  # fmt: skip
