"""Jobs survive an API restart in distributed mode: real Redis, worker and API processes.

The API that took a job is stopped mid-generation, gracefully (it detaches
and gives its lease back) or with ``kill -9`` (its lease lapses). The worker
goes on; a new API process adopts the job when asked for it, replays the
request's events and finishes the job. Its result must equal the synchronous
greedy response, and its stream must be whole: ids 1..N, text equal to the
result, ``[DONE]`` last.
"""

from __future__ import annotations

import hashlib
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
ALICE, BOB, METERED = "sk-alice-01", "sk-bob-02", "sk-metered-03"
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
    fleet = Fleet(jobs_redis, tmp_path_factory.mktemp("jobs-workers"), size=1, loglevel="INFO")
    fleet.top_up()
    try:
        fleet.wait_live()
        yield fleet
    finally:
        fleet.stop_all()


def start_api(redis: RedisServer, log_dir: Path, *options: str) -> tuple[Child, str]:
    port = free_port()
    command = [
        sys.executable, "-m", "api.server", "--redis", redis.url, "--port", str(port),
        *API_OPTIONS, *options,
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


def test_keys_own_their_jobs_and_share_one_limit_across_two_replicas(
    jobs_redis: RedisServer, worker: Fleet, tmp_path: Path
) -> None:
    """Two API processes, one Redis: a job is its key's on either, and a limit is one limit."""
    digest = hashlib.sha256(METERED.encode()).hexdigest()
    keys_file = tmp_path / "keys.toml"
    keys_file.write_text(f'[keys.metered]\nsha256 = "{digest}"\nrequests_per_minute = 3\n')
    options = ("--api-key", ALICE, "--api-key", BOB, "--api-keys", str(keys_file))
    first, first_url = start_api(jobs_redis, tmp_path, *options)
    second, second_url = start_api(jobs_redis, tmp_path, *options)
    try:
        alice = [_client(url, ALICE) for url in (first_url, second_url)]
        bob = [_client(url, BOB) for url in (first_url, second_url)]
        body = {**BODY, "max_tokens": 4}
        submitted = alice[0].post(
            "/v1/jobs", json={"endpoint": "/v1/chat/completions", "body": body}
        )
        assert submitted.status_code == 202, submitted.text
        job_id = submitted.json()["id"]
        done = wait_until(
            lambda: alice[1].get(f"/v1/jobs/{job_id}").json()["status"] == "completed",
            90,
            "the job to complete, read through the other replica",
            0.2,
        )
        assert done
        for replica in (0, 1):
            assert job_id in [job["id"] for job in alice[replica].get("/v1/jobs").json()["data"]]
            assert job_id not in [job["id"] for job in bob[replica].get("/v1/jobs").json()["data"]]
            for answer in (
                bob[replica].get(f"/v1/jobs/{job_id}"),
                bob[replica].get(f"/v1/jobs/{job_id}/events"),
                bob[replica].delete(f"/v1/jobs/{job_id}"),
            ):
                assert answer.status_code == 404, answer.text
            assert (
                httpx.get(f"{(first_url, second_url)[replica]}/v1/jobs/{job_id}").status_code == 401
            )
        assert alice[1].get(f"/v1/jobs/{job_id}/events").text.rstrip().endswith("data: [DONE]")
        response_id = "chatcmpl-" + job_id.removeprefix("job_")  # the request id, everywhere
        (log,) = [worker.child.log_path.read_text() for worker in worker.workers.values()]
        assert f"{response_id}: attempt 1, " in log and f"{response_id}: finished after " in log
        # Three requests a minute for the metered key, whichever replica each one reaches.
        metered = [_client(url, METERED) for url in (first_url, second_url)]
        one = {**BODY, "max_tokens": 1}
        replies = [metered[i % 2].post("/v1/chat/completions", json=one) for i in range(6)]
        assert sorted(r.status_code for r in replies) == [200, 200, 200, 429, 429, 429]
        served = [r for r in replies if r.status_code == 200]
        assert sorted(r.headers["x-ratelimit-remaining-requests"] for r in served) == [
            "0",
            "1",
            "2",
        ]
        refused = [r for r in replies if r.status_code == 429]
        for reply in refused:
            assert reply.headers["x-ratelimit-limit-requests"] == "3"
            assert int(reply.headers["retry-after"]) >= 1
            assert reply.json()["error"]["code"] == "rate_limit_exceeded"
        streamed = metered[0].post("/v1/chat/completions", json={**one, "stream": True})
        assert streamed.status_code == 429 and streamed.headers["retry-after"]
        for client in (*alice, *bob, *metered):
            client.close()
    finally:
        first.stop()
        second.stop()


def _client(base_url: str, key: str) -> httpx.Client:
    return httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def test_stored_and_background_responses_cross_replicas_and_survive_a_kill(
    jobs_redis: RedisServer, worker: Fleet, tmp_path: Path
) -> None:
    """A response stored through one replica is continued through the other; a background one
    whose replica is killed is adopted, and its stream read back whole through the survivor."""
    from openai import OpenAI

    first, first_url = start_api(jobs_redis, tmp_path)
    second, second_url = start_api(jobs_redis, tmp_path)
    clients = [
        OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0) for url in (first_url, second_url)
    ]
    options = {"model": "default", "temperature": 0, "max_output_tokens": 48}
    count = "Count from 1 to 300, separated by commas."
    try:
        stored = clients[0].responses.create(input="Say hi.", **{**options, "max_output_tokens": 8})
        continued = clients[1].responses.create(
            input="Again.", previous_response_id=stored.id, **{**options, "max_output_tokens": 8}
        )
        assert continued.previous_response_id == stored.id
        assert continued.usage.input_tokens_details.cached_tokens >= 16  # the one worker's cache
        foreground = clients[0].responses.create(input=count, store=False, **options)
        queued = clients[1].responses.create(input=count, background=True, **options)
        job_id = "job_" + queued.id.removeprefix("resp_")
        events_key = keys.job_events(job_id)
        wait_until(lambda: jobs_redis.client.xlen(events_key) >= 8, 60, "the first events")
        second.stop(signal.SIGKILL)
        events = list(clients[0].responses.retrieve(queued.id, stream=True, starting_after=2))
    finally:
        first.stop()
        second.stop(signal.SIGKILL)
    assert [event.sequence_number for event in events] == list(range(3, 3 + len(events)))
    assert events[-1].response.output_text == foreground.output_text


def test_a_batch_whose_replica_is_killed_completes_through_the_other(
    jobs_redis: RedisServer, worker: Fleet, tmp_path: Path
) -> None:
    """Lines run two at a time; the replica running the batch is killed mid-way. The other
    replica takes the batch over: every line is answered once, none twice."""
    import io

    from openai import OpenAI

    concurrency = ("--batch-concurrency", "2")
    first, first_url = start_api(jobs_redis, tmp_path, *concurrency)
    second, second_url = start_api(jobs_redis, tmp_path, *concurrency)
    clients = [
        OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0) for url in (first_url, second_url)
    ]
    lines = [
        {
            "custom_id": f"line-{n}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                **BODY,
                "max_tokens": 8,
                "messages": [{"role": "user", "content": f"Say {n}."}],
            },
        }
        for n in range(10)
    ]
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    try:
        file_id = (
            clients[0].files.create(file=("in.jsonl", io.BytesIO(content)), purpose="batch").id
        )
        batch = clients[0].batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        wait_until(
            lambda: clients[1].batches.retrieve(batch.id).request_counts.completed >= 2,
            90,
            "two lines to finish",
            0.2,
        )
        first.stop(signal.SIGKILL)
        done = wait_until(
            lambda: (b := clients[1].batches.retrieve(batch.id)).status == "completed" and b,
            180,
            "the batch to complete through the other replica",
            0.5,
        )
        output = [
            json.loads(x) for x in clients[1].files.content(done.output_file_id).text.splitlines()
        ]
    finally:
        first.stop(signal.SIGKILL)
        second.stop()
    assert sorted(item["custom_id"] for item in output) == sorted(x["custom_id"] for x in lines)
    assert done.request_counts.completed == len(lines) and done.request_counts.failed == 0
    assert all(item["response"]["status_code"] == 200 for item in output)
