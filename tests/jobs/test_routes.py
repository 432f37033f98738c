"""The jobs API over HTTP, on the real app with a model-free backend (embedded mode's store).

What a client relies on: the result is the synchronous response, the event
stream is the synchronous stream with ids and resumes exactly after
``Last-Event-ID``, cancellation stops queued and running jobs, bad bodies
are refused at submission in their protocol's shape, and retention ends
with ``expired`` and then 404.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.settings import Settings
from tests.jobs.conftest import PacedBackend, serve_in_thread, sse_events, stable

CHAT = "/v1/chat/completions"
BODIES: dict[str, dict[str, Any]] = {
    CHAT: {"model": "default", "messages": [{"role": "user", "content": "Hi"}]},
    "/v1/responses": {"model": "default", "input": "Hi"},
    "/v1/messages": {"model": "default", "messages": [{"role": "user", "content": "Hi"}]},
}
LIMIT_FIELD = {
    CHAT: "max_tokens",
    "/v1/responses": "max_output_tokens",
    "/v1/messages": "max_tokens",
}


@pytest.fixture(scope="module")
def backend() -> PacedBackend:
    return PacedBackend()


@pytest.fixture(scope="module")
def base_url(backend: PacedBackend) -> Iterator[str]:
    app = create_app(Settings(max_batch_jobs=3), backend=backend)
    with serve_in_thread(app) as url:
        yield url


@pytest.fixture
def http(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=30) as client:
        yield client


def body(endpoint: str, tokens: int, **extra: Any) -> dict[str, Any]:
    return {**BODIES[endpoint], LIMIT_FIELD[endpoint]: tokens, **extra}


def submit(http: httpx.Client, endpoint: str, tokens: int, **extra: Any) -> dict[str, Any]:
    response = http.post("/v1/jobs", json={"endpoint": endpoint, "body": body(endpoint, tokens)})
    assert response.status_code == 202, response.text
    return response.json()


def wait_for(http: httpx.Client, job_id: str, *statuses: str, timeout: float = 20) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = http.get(f"/v1/jobs/{job_id}").json()
        if job["status"] in statuses:
            return job
        time.sleep(0.02)
    pytest.fail(f"job {job_id} never reached {statuses}: {job}")


def read_events(http: httpx.Client, job_id: str, **headers: str) -> list[dict[str, str]]:
    with http.stream("GET", f"/v1/jobs/{job_id}/events", headers=headers) as response:
        assert response.status_code == 200, response.read()
        return list(sse_events(response.iter_lines()))


@pytest.mark.parametrize("endpoint", list(BODIES))
def test_the_result_and_the_events_are_the_synchronous_response_and_stream(
    http: httpx.Client, endpoint: str
) -> None:
    job = submit(http, endpoint, 5)
    assert job["status"] == "queued" and job["id"].startswith("job_")
    done = wait_for(http, job["id"], "completed")
    synchronous = http.post(endpoint, json=body(endpoint, 5)).json()
    assert stable(done["result"]) == stable(synchronous)
    assert done["result"]["id"].endswith(job["id"].removeprefix("job_"))
    assert done["usage"]["completion_tokens"] == 5
    assert done["started_at"] is not None and done["finished_at"] is not None

    events = read_events(http, job["id"])
    assert [event["id"] for event in events] == [str(n) for n in range(1, len(events) + 1)]
    with http.stream("POST", endpoint, json=body(endpoint, 5, stream=True)) as response:
        live = list(sse_events(response.iter_lines()))
    assert [e.get("event") for e in events] == [e.get("event") for e in live]
    datas = [e["data"] for e in events]
    assert [stable(_json(d)) for d in datas] == [stable(_json(e["data"])) for e in live]


def test_events_resume_after_the_last_event_id_while_the_job_runs(http: httpx.Client) -> None:
    job = submit(http, CHAT, 100)  # about two seconds of generation
    first: list[dict[str, str]] = []
    with http.stream("GET", f"/v1/jobs/{job['id']}/events") as response:
        for event in sse_events(response.iter_lines()):
            first.append(event)
            if len(first) == 6:
                break  # the connection drops mid-stream
    assert http.get(f"/v1/jobs/{job['id']}").json()["status"] == "running"
    rest = read_events(http, job["id"], **{"Last-Event-ID": first[-1]["id"]})
    whole = read_events(http, job["id"])
    assert first + rest == whole
    assert [e["id"] for e in whole] == [str(n) for n in range(1, len(whole) + 1)]
    assert whole[-1]["data"] == "[DONE]"
    text = "".join(_json(e["data"])["choices"][0]["delta"].get("content") or "" for e in whole[:-1])
    assert text == "".join(f"w{n} " for n in range(100))
    after = http.get(f"/v1/jobs/{job['id']}/events?after=3")
    assert [e["id"] for e in sse_events(after.text.splitlines())][0] == "4"


def test_a_cancelled_queued_job_never_runs(http: httpx.Client, backend: PacedBackend) -> None:
    job = submit(http, CHAT, PacedBackend.HOLD)
    cancelled = http.delete(f"/v1/jobs/{job['id']}").json()
    assert cancelled["status"] == "cancelled" and cancelled["started_at"] is None
    response_id = "chatcmpl-" + job["id"].removeprefix("job_")
    assert response_id in backend.closed_early and response_id not in backend.started
    assert read_events(http, job["id"]) == []
    assert http.delete(f"/v1/jobs/{job['id']}").json()["status"] == "cancelled"  # idempotent


def test_a_cancelled_running_job_stops_at_once(http: httpx.Client, backend: PacedBackend) -> None:
    job = submit(http, "/v1/messages", 500)  # ten seconds if left alone
    wait_for(http, job["id"], "running")
    time.sleep(0.1)
    started = time.monotonic()
    cancelled = http.delete(f"/v1/jobs/{job['id']}").json()
    assert time.monotonic() - started < 2  # it would take ten
    assert cancelled["status"] == "cancelled"
    assert 0 < cancelled["usage"]["completion_tokens"] < 500
    assert "msg_" + job["id"].removeprefix("job_") in backend.closed_early
    events = read_events(http, job["id"])
    assert [e["event"] for e in events[-2:]] == ["message_delta", "message_stop"]


def test_bodies_the_endpoint_would_refuse_are_refused_at_submission(
    http: httpx.Client, base_url: str
) -> None:
    before = len(http.get("/v1/jobs?limit=100").json()["data"])
    chat = http.post("/v1/jobs", json={"endpoint": CHAT, "body": body(CHAT, 4, temperature=9)})
    assert chat.status_code == 400
    assert chat.json()["error"]["param"] == "temperature"
    no_limit = {"endpoint": "/v1/messages", "body": BODIES["/v1/messages"]}
    messages = http.post("/v1/jobs", json=no_limit)
    assert messages.status_code == 400
    assert messages.json()["type"] == "error"  # Anthropic's shape
    assert "max_tokens" in messages.json()["error"]["message"]

    good = {"endpoint": CHAT, "body": body(CHAT, 2)}
    batch = http.post("/v1/jobs/batch", json={"jobs": [good, no_limit]})
    assert batch.status_code == 400 and batch.json()["type"] == "error"
    assert batch.json()["error"]["message"].startswith("jobs[1].body: ")
    assert len(http.get("/v1/jobs?limit=100").json()["data"]) == before  # nothing was queued

    envelope = http.post("/v1/jobs", json={"endpoint": "/v1/embeddings", "body": {}})
    assert envelope.status_code == 400 and envelope.json()["error"]["param"] == "endpoint"
    metadata = http.post("/v1/jobs", json={**good, "metadata": {"n": 1}})
    assert metadata.json()["error"]["param"] == "metadata.n"
    too_many = http.post("/v1/jobs/batch", json=[good] * 4)
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "jobs"
    assert http.get("/v1/jobs/job_nope").status_code == 404
    bad_id = http.get(f"/v1/jobs/{submit(http, CHAT, 1)['id']}/events?after=x")
    assert bad_id.status_code == 400
    assert http.get("/v1/jobs?status=done").status_code == 400


def test_a_batch_answers_its_jobs_in_order_and_the_list_filters(http: httpx.Client) -> None:
    jobs = [
        {"endpoint": endpoint, "body": body(endpoint, 2), "metadata": {"n": str(n)}}
        for n, endpoint in enumerate(BODIES)
    ]
    response = http.post("/v1/jobs/batch", json=jobs)
    assert response.status_code == 202
    submitted = response.json()["data"]
    assert [job["endpoint"] for job in submitted] == list(BODIES)
    assert [job["metadata"] for job in submitted] == [{"n": "0"}, {"n": "1"}, {"n": "2"}]
    for job in submitted:
        wait_for(http, job["id"], "completed")
    held = submit(http, CHAT, PacedBackend.HOLD)
    queued = http.get("/v1/jobs?status=queued").json()
    assert held["id"] in [job["id"] for job in queued["data"]]
    page = http.get("/v1/jobs?status=completed&limit=2").json()
    assert page["has_more"] and [job["id"] for job in page["data"]] == [
        submitted[2]["id"],
        submitted[1]["id"],
    ]
    assert page["data"][0]["result"] is None  # fetch the job for its result
    rest = http.get(f"/v1/jobs?status=completed&limit=1&after={page['last_id']}").json()
    assert rest["data"][0]["id"] == submitted[0]["id"]
    http.delete(f"/v1/jobs/{held['id']}")


def test_retention_ends_with_expired_then_not_found() -> None:
    app = create_app(Settings(job_retention_s=0.3), backend=PacedBackend())
    with TestClient(app) as client:
        job = client.post("/v1/jobs", json={"endpoint": CHAT, "body": body(CHAT, 1)}).json()
        time.sleep(0.35)
        expired = client.get(f"/v1/jobs/{job['id']}").json()
        assert expired["status"] == "expired" and expired["metadata"] == {}
        events = client.get(f"/v1/jobs/{job['id']}/events")
        assert events.status_code == 404 and events.json()["error"]["code"] == "job_expired"
        time.sleep(0.3)
        gone = client.get(f"/v1/jobs/{job['id']}")
        assert gone.status_code == 404 and "never existed, or it expired" in gone.text


def test_jobs_belong_to_the_key_that_submitted_them_once_keys_exist() -> None:
    app = create_app(Settings(api_keys=("sk-mine", "sk-other")), backend=PacedBackend())
    with TestClient(app) as client:
        mine = {"x-api-key": "sk-mine"}
        job = client.post(
            "/v1/jobs", json={"endpoint": CHAT, "body": body(CHAT, 1)}, headers=mine
        ).json()
        assert client.get(f"/v1/jobs/{job['id']}", headers=mine).status_code == 200
        other = {"x-api-key": "sk-other"}
        assert client.get(f"/v1/jobs/{job['id']}", headers=other).status_code == 404
        assert client.delete(f"/v1/jobs/{job['id']}", headers=other).status_code == 404
        assert client.get("/v1/jobs", headers=other).json()["data"] == []


def _json(data: str) -> Any:
    return data if data == "[DONE]" else json.loads(data)
