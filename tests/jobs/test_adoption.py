"""Jobs outlive the API process that ran them (Redis store, distributed mode's design).

The generation is played by ``WorkerThread``, a stand-in for a GPU worker:
it writes a request's events to the request's Redis Stream at its own pace,
whatever happens to the API, and stops when the cancel flag is set. The
backend reads those streams with the real ``EventReader``. So the test can
stop one API app mid-job, start another, and check that the second adopts
the job and finishes it with a stream that has no gap, no repeat and one
spelling for every id.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
import redis

from api.app import Settings, create_app
from api.backends.base import BackendHealth, ServedModel
from api.backends.event_reader import EventReader
from api.jobs.runner import seeded_tool_call_ids
from shared import keys
from shared.event_codec import encode_event
from shared.events import Error, Finish, FinishReason, InferenceEvent, Ready, Text
from shared.registry import default_registry
from shared.tokenizer_loader import load_tokenizer
from shared.wire import PreparedRequest
from tests.jobs.conftest import serve_in_thread, sse_events

WORDS = [f"w{n} " for n in range(30)]
TOOL_CALL = ['<tool_call>{"name": "get_weather", ', '"arguments": {"city": "Paris"}}</tool_call>']
TOOLS = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]


class WorkerThread:
    """Plays every submitted request into Redis from a thread, like a worker."""

    def __init__(self, redis_url: str, pieces: list[str], interval: float = 0.03) -> None:
        self._client = redis.Redis.from_url(redis_url)
        self._pieces = pieces
        self._interval = interval
        self.finished: dict[str, FinishReason] = {}

    def submit(self, request_id: str) -> None:
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
        self._client.xadd(keys.event_stream(event.request_id), encode_event(event, 1))


class StreamBackend:
    """The distributed backend's shape without Celery: submit to ``WorkerThread``, read Redis."""

    def __init__(self, redis_url: str, worker: WorkerThread) -> None:
        spec = default_registry().resolve("default")
        self._served = ServedModel(spec, load_tokenizer(spec.tokenizer), 2048)
        self._redis_url = redis_url
        self._worker = worker
        self._reader: EventReader | None = None

    async def start(self) -> None:
        self._reader = EventReader(self._redis_url)
        await self._reader.start()

    async def stop(self) -> None:
        assert self._reader is not None
        await self._reader.stop()  # open requests end with an Error, as in the real backend

    def health(self) -> BackendHealth:
        return BackendHealth(ready=True)

    def models(self) -> list[ServedModel]:
        return [self._served]

    async def infer(self, request: PreparedRequest) -> AsyncIterator[InferenceEvent]:
        assert self._reader is not None
        subscription = self._reader.open(request.request_id)
        self._worker.submit(request.request_id)
        finished = False
        try:
            while not finished:
                event = await subscription.events.get()
                finished = isinstance(event, Finish | Error)
                yield event
        finally:
            self._reader.close(request.request_id)
            if not finished:  # what the real backend does when its reader leaves early
                client = redis.Redis.from_url(self._redis_url)
                client.set(keys.cancel_flag(request.request_id), "1")


@pytest.fixture
def worker(redis_url: str) -> WorkerThread:
    redis.Redis.from_url(redis_url).flushdb()
    return WorkerThread(redis_url, WORDS + TOOL_CALL, interval=0.05)


def app_for(redis_url: str, worker: WorkerThread) -> Any:
    return create_app(Settings(redis_url=redis_url), backend=StreamBackend(redis_url, worker))


@pytest.fixture
def replica(redis_url: str, worker: WorkerThread) -> Iterator[httpx.Client]:
    """A second API process on the same Redis."""
    with (
        serve_in_thread(app_for(redis_url, worker)) as url,
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
        serve_in_thread(app_for(redis_url, worker)) as first,
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
        serve_in_thread(app_for(redis_url, worker)) as second,
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
        serve_in_thread(app_for(redis_url, worker)) as first,
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
