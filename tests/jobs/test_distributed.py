"""Jobs survive an API restart in distributed mode: real Redis, worker and API processes.

The API that took a job is stopped mid-generation, gracefully (it detaches
and gives its lease back) or with ``kill -9`` (its lease lapses). The worker
goes on; a new API process adopts the job when asked for it, replays the
request's events and finishes the job. Its result must equal the synchronous
greedy response, and its stream must be whole: ids 1..N, text equal to the
result, ``[DONE]`` last.
"""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from shared import keys
from tests.distributed.conftest import Child, Fleet, RedisServer, free_port, wait_until
from tests.jobs.conftest import sse_events, stable

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

API_OPTIONS = ("--queue-timeout", "60", "--first-token-timeout", "90", "--total-timeout", "120")
BODY = {
    "model": "default",
    "messages": [{"role": "user", "content": "Count from 1 to 300, separated by commas."}],
    "max_tokens": 48,
    "temperature": 0,
}


@pytest.fixture(scope="module")
def jobs_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("jobs-redis-dist"))
    server.start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture(scope="module")
def worker(jobs_redis: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    fleet = Fleet(jobs_redis, tmp_path_factory.mktemp("jobs-workers"), size=1)
    fleet.top_up()
    try:
        fleet.wait_live()
        yield fleet
    finally:
        fleet.stop_all()


def start_api(redis: RedisServer, log_dir: Path) -> tuple[Child, str]:
    port = free_port()
    command = [
        sys.executable, "-m", "api.server", "--redis", redis.url, "--port", str(port), *API_OPTIONS
    ]  # fmt: skip
    child = Child.spawn(command, log_dir / f"api-{port}.log")
    base_url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        if not child.alive:
            pytest.fail(f"the API exited:\n{child.log()}")
        try:
            return httpx.get(f"{base_url}/ready", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    wait_until(ready, 120, "the API to be ready", interval=0.2)
    return child, base_url


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL], ids=["graceful", "kill-9"])
def test_a_job_survives_the_restart_of_the_api_that_took_it(
    stop: int, jobs_redis: RedisServer, worker: Fleet, tmp_path: Path
) -> None:
    first, base_url = start_api(jobs_redis, tmp_path)
    warm = {**BODY, "max_tokens": 1}  # cache the prompt: the job and the check below hit it alike
    httpx.post(f"{base_url}/v1/chat/completions", json=warm, timeout=120)
    job = httpx.post(
        f"{base_url}/v1/jobs", json={"endpoint": "/v1/chat/completions", "body": BODY}
    ).json()
    events_key = keys.job_events(job["id"])
    wait_until(lambda: jobs_redis.client.xlen(events_key) >= 4, 60, "the first chunks")
    first.stop(stop)
    stored_before = jobs_redis.client.xlen(events_key)

    second, base_url = start_api(jobs_redis, tmp_path)
    try:
        done = wait_until(
            lambda: _completed(base_url, job["id"]), 90, "the adopted job to complete", 0.2
        )
        synchronous = httpx.post(f"{base_url}/v1/chat/completions", json=BODY, timeout=120)
        events = httpx.get(f"{base_url}/v1/jobs/{job['id']}/events", timeout=30).text
    finally:
        second.stop()
    response_id = "chatcmpl-" + job["id"].removeprefix("job_")
    assert not jobs_redis.client.exists(keys.cancel_flag(response_id))  # detached, not cancelled
    assert stable(done["result"]) == stable(synchronous.json())
    parsed = list(sse_events(events.splitlines()))
    assert [event["id"] for event in parsed] == [str(n) for n in range(1, len(parsed) + 1)]
    assert len(parsed) > stored_before
    assert parsed[-1]["data"] == "[DONE]"
    chunks = [json.loads(event["data"]) for event in parsed[:-1]]
    text = "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks)
    assert text == done["result"]["choices"][0]["message"]["content"]
    assert {chunk["id"] for chunk in chunks} == {done["result"]["id"]}


def _completed(base_url: str, job_id: str) -> dict | None:
    job = httpx.get(f"{base_url}/v1/jobs/{job_id}", timeout=10).json()
    assert job["status"] in ("queued", "running", "completed"), job
    return job if job["status"] == "completed" else None
