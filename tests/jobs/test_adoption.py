"""Jobs outlive the API process that ran them (distributed mode, without a model).

The API apps are the real ones in distributed mode: jobs go on the model's
Celery queue in Redis and their events are read back from Redis. The
worker is ``WorkerThread``, a stand-in that takes jobs off the queue and
writes each request's events to its Redis Stream at its own pace, whatever
happens to the API, stopping when the cancel flag is set. So the test can
stop one API app mid-job, start another, and check that the second adopts
the job and finishes it with a stream that has no gap, no repeat and one
spelling for every id.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis

from api.app import create_app
from api.jobs.runner import seeded_tool_call_ids
from api.settings import Settings
from shared import keys
from shared.events import Finish, FinishReason, InferenceEvent, Ready, Text
from shared.registry import DEFAULT_MODEL
from shared.wire import decode_queued
from tests.jobs.conftest import PacedBackend, serve_in_thread, sse_events
from tests.streams import append_events

WORDS = [f"w{n} " for n in range(30)]
TOOL_CALL = ['<tool_call>{"name": "get_weather", ', '"arguments": {"city": "Paris"}}</tool_call>']
TOOLS = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]


class WorkerThread:
    """A stand-in worker: takes jobs off the model's queue and plays ``pieces`` into Redis.

    Each request's events go to its stream at the worker's own pace; a set
    cancel flag ends the request with ``Finish(abort)``, as on a real worker.
    """

    def __init__(self, redis_url: str, pieces: list[str], interval: float) -> None:
        self._client = redis.Redis.from_url(redis_url)
        self._pieces = pieces
        self._interval = interval
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._take_jobs, daemon=True)
        self.finished: dict[str, FinishReason] = {}

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(5)

    def _take_jobs(self) -> None:
        queue = keys.queue_name(DEFAULT_MODEL)
        while not self._stopped.is_set():
            item = self._client.brpop([queue], timeout=0.1)
            if item is not None:
                message = json.loads(item[1])
                args = json.loads(base64.b64decode(message["body"]))[0]
                request_id = decode_queued(args[0]).request.request_id
                threading.Thread(target=self._play, args=(request_id,), daemon=True).start()

    def _play(self, request_id: str) -> None:
        self._write(Ready(request_id, 5, 0))
        for count, piece in enumerate(self._pieces, 1):
            time.sleep(self._interval)
            if self._client.exists(keys.cancel_flag(request_id)):
                self._end(Finish(request_id, FinishReason.ABORT, count - 1))
                return
            self._write(Text(request_id, piece, [count]))
        self._end(Finish(request_id, FinishReason.STOP, len(self._pieces)))

    def _end(self, finish: Finish) -> None:
        self._write(finish)
        self.finished[finish.request_id] = finish.reason

    def _write(self, event: InferenceEvent) -> None:
        append_events(self._client, event.request_id, 1, event)


@pytest.fixture
def worker(redis_url: str) -> Iterator[WorkerThread]:
    redis.Redis.from_url(redis_url).flushdb()
    worker = WorkerThread(redis_url, WORDS + TOOL_CALL, interval=0.05)
    worker.start()
    try:
        yield worker
    finally:
        worker.stop()


def app_for(redis_url: str) -> Any:
    """An API process of distributed mode; jobs go to the queue, not to the backend."""
    return create_app(Settings(redis_url=redis_url), backend=PacedBackend())


@pytest.fixture
def replica(redis_url: str, worker: WorkerThread) -> Iterator[httpx.Client]:
    """A second API process on the same Redis."""
    with (
        serve_in_thread(app_for(redis_url)) as url,
        httpx.Client(base_url=url, timeout=30) as client,
    ):
        yield client


def submit_responses_job(client: httpx.Client) -> dict[str, Any]:
    body = {"model": "default", "input": "Weather in Paris?", "tools": TOOLS}
    job = client.post("/v1/jobs", json={"endpoint": "/v1/responses", "body": body}).json()
    assert job["status"] == "queued", job
    return job


def wait_until(check, timeout: float = 20):  # noqa: ANN001, ANN201
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(0.02)
    pytest.fail("timed out")


def test_a_job_whose_api_stopped_is_adopted_and_finished_without_gap_or_repeat(
    redis_url: str, worker: WorkerThread
) -> None:
    with (
        serve_in_thread(app_for(redis_url)) as first,
        httpx.Client(base_url=first, timeout=30) as client,
    ):
        job = submit_responses_job(client)
        chunks = f"sluice:job:{job['id']}:events"
        stored = redis.Redis.from_url(redis_url)
        wait_until(lambda: stored.xlen(chunks) >= 12)
    # The first API is gone (graceful shutdown); the worker went on.
    stopped_at = stored.xlen(chunks)
    assert stopped_at < len(WORDS)
    response_id = "resp_" + job["id"].removeprefix("job_")
    assert not stored.exists(keys.cancel_flag(response_id))

    with (
        serve_in_thread(app_for(redis_url)) as second,
        httpx.Client(base_url=second, timeout=30) as client,
    ):
        done = wait_until(
            lambda: (j := client.get(f"/v1/jobs/{job['id']}").json())["status"] == "completed" and j
        )
        events = list(sse_events(client.get(f"/v1/jobs/{job['id']}/events").text.splitlines()))
    assert worker.finished[response_id] is FinishReason.STOP
    datas = [json.loads(event["data"]) for event in events]
    assert [event["id"] for event in events] == [str(n) for n in range(1, len(events) + 1)]
    assert [data["sequence_number"] for data in datas] == list(range(len(datas)))
    text = "".join(d["delta"] for d in datas if d["type"] == "response.output_text.delta")
    assert text == "".join(WORDS)

    message, call = done["result"]["output"]
    item_ids = {d["item_id"] for d in datas if d["type"] == "response.output_text.delta"}
    assert item_ids == {message["id"]}  # one spelling before and after the adoption
    assert call["call_id"] == seeded_tool_call_ids(job["id"])()
    assert call["arguments"] == '{"city": "Paris"}'
    assert datas[-1]["response"] == done["result"]
    assert done["usage"]["completion_tokens"] == len(WORDS) + len(TOOL_CALL)


def test_a_job_is_cancelled_from_a_replica_that_does_not_run_it(
    redis_url: str, worker: WorkerThread, replica: httpx.Client
) -> None:
    with (
        serve_in_thread(app_for(redis_url)) as first,
        httpx.Client(base_url=first, timeout=30) as client,
    ):
        job = submit_responses_job(client)
        wait_until(lambda: client.get(f"/v1/jobs/{job['id']}").json()["status"] == "running")
        cancelled = replica.delete(f"/v1/jobs/{job['id']}").json()
        assert cancelled["status"] == "cancelled"
        response_id = "resp_" + job["id"].removeprefix("job_")
        assert wait_until(lambda: worker.finished.get(response_id)) is FinishReason.ABORT
        events = list(sse_events(client.get(f"/v1/jobs/{job['id']}/events").text.splitlines()))
        assert client.get(f"/v1/jobs/{job['id']}").json()["status"] == "cancelled"
    assert len(events) < len(WORDS)
    assert [event["id"] for event in events] == [str(n) for n in range(1, len(events) + 1)]


def test_a_job_cancelled_where_it_runs_stops_its_worker(
    redis_url: str, worker: WorkerThread
) -> None:
    with (
        serve_in_thread(app_for(redis_url)) as url,
        httpx.Client(base_url=url, timeout=30) as client,
    ):
        job = submit_responses_job(client)
        wait_until(lambda: client.get(f"/v1/jobs/{job['id']}").json()["status"] == "running")
        cancelled = client.delete(f"/v1/jobs/{job['id']}").json()
        assert cancelled["status"] == "cancelled"
        response_id = "resp_" + job["id"].removeprefix("job_")
        assert wait_until(lambda: worker.finished.get(response_id)) is FinishReason.ABORT
        events = list(sse_events(client.get(f"/v1/jobs/{job['id']}/events").text.splitlines()))
    assert json.loads(events[-1]["data"])["response"]["status"] == "incomplete"
    inflight = redis.Redis.from_url(redis_url).zcard(keys.inflight(DEFAULT_MODEL))
    assert inflight == 0  # it left the model's in-flight set
