"""Jobs end to end in embedded mode: a real ``sluice serve`` process on the default model.

The server runs one sequence at a time, so a second job really waits in the
engine's queue while the first runs. Greedy requests make the job's result
comparable with the synchronous response; the official SDKs read the job's
event stream as if it were their own endpoint's.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.jobs.conftest import sse_events, stable
from tests.servers import running_server

pytestmark = pytest.mark.slow

HI = [{"role": "user", "content": "Say hi in five words."}]
COUNT = [{"role": "user", "content": "Count from 1 to 300, separated by commas."}]
BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"model": "default", "messages": HI, "max_tokens": 8},
    "/v1/completions": {"model": "default", "prompt": "Say hi in five words:", "max_tokens": 8},
    "/v1/responses": {"model": "default", "input": HI, "max_output_tokens": 8},
    "/v1/messages": {"model": "default", "messages": HI, "max_tokens": 8},
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    args = ["--max-model-len", "1024", "--max-num-seqs", "1"]
    with running_server(args, tmp_path_factory.mktemp("jobs-server")) as base_url:
        yield base_url


@pytest.fixture
def http(server: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server, timeout=120) as client:
        yield client


def submit(http: httpx.Client, endpoint: str, body: dict[str, Any]) -> str:
    response = http.post("/v1/jobs", json={"endpoint": endpoint, "body": body})
    assert response.status_code == 202, response.text
    return response.json()["id"]


def wait_for(http: httpx.Client, job_id: str, *statuses: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = http.get(f"/v1/jobs/{job_id}").json()
        if job["status"] in statuses:
            return job
        time.sleep(0.05)
    pytest.fail(f"job {job_id} never reached {statuses}: {job}")


@pytest.mark.parametrize("endpoint", list(BODIES))
def test_a_job_result_is_the_synchronous_response(http: httpx.Client, endpoint: str) -> None:
    body = {**BODIES[endpoint], "temperature": 0}
    http.post(endpoint, json=body)  # the prompt's blocks are cached from here on, for both
    job = wait_for(http, submit(http, endpoint, body), "completed")
    synchronous = http.post(endpoint, json=body).json()
    assert stable(job["result"]) == stable(synchronous)
    assert job["result"]["id"].endswith(job["id"].removeprefix("job_"))


def test_the_sdks_read_a_job_stream_and_resume_it_after_a_last_event_id(
    http: httpx.Client, openai_client: Any, anthropic_client: Any
) -> None:
    from anthropic import Stream as AnthropicStream
    from anthropic.types import RawMessageStreamEvent
    from openai import Stream as OpenAIStream
    from openai.types.chat import ChatCompletionChunk

    chat = {"model": "default", "messages": HI, "max_tokens": 12, "temperature": 0}
    chat_job = wait_for(http, submit(http, "/v1/chat/completions", chat), "completed")
    with http.stream("GET", f"/v1/jobs/{chat_job['id']}/events") as response:
        head = list(itertools.islice(sse_events(response.iter_lines()), 4))
    tail = openai_client.get(
        f"/jobs/{chat_job['id']}/events",
        cast_to=ChatCompletionChunk,
        options={"headers": {"Last-Event-ID": head[-1]["id"]}},
        stream=True,
        stream_cls=OpenAIStream[ChatCompletionChunk],
    )
    text = "".join(json.loads(e["data"])["choices"][0]["delta"].get("content", "") for e in head)
    text += "".join(chunk.choices[0].delta.content or "" for chunk in tail if chunk.choices)
    assert text == chat_job["result"]["choices"][0]["message"]["content"]

    messages = {"model": "default", "messages": HI, "max_tokens": 12, "temperature": 0}
    messages_job = wait_for(http, submit(http, "/v1/messages", messages), "completed")
    events = anthropic_client.get(
        f"/v1/jobs/{messages_job['id']}/events",
        cast_to=RawMessageStreamEvent,
        stream=True,
        stream_cls=AnthropicStream[RawMessageStreamEvent],
    )
    deltas = [event.delta.text for event in events if event.type == "content_block_delta"]
    assert "".join(deltas) == messages_job["result"]["content"][0]["text"]


def test_cancelling_a_queued_and_a_running_job_frees_the_engine(http: httpx.Client) -> None:
    running = submit(http, "/v1/chat/completions", _count_body(400))
    wait_for(http, running, "running")
    queued = submit(http, "/v1/chat/completions", _count_body(8))
    time.sleep(0.5)
    assert http.get(f"/v1/jobs/{queued}").json()["status"] == "queued"  # one sequence at a time

    cancelled = http.delete(f"/v1/jobs/{queued}").json()
    assert cancelled["status"] == "cancelled" and cancelled["started_at"] is None
    assert cancelled["usage"]["completion_tokens"] == 0
    assert http.get(f"/v1/jobs/{queued}/events").text.strip() == ""

    stopped = http.delete(f"/v1/jobs/{running}").json()
    assert stopped["status"] == "cancelled"
    assert 0 < stopped["usage"]["completion_tokens"] < 400
    events = list(sse_events(http.get(f"/v1/jobs/{running}/events").text.splitlines()))
    assert events[-1]["data"] == "[DONE]" and '"finish_reason":"stop"' in events[-2]["data"]

    after = wait_for(http, submit(http, "/v1/chat/completions", _count_body(4)), "completed")
    assert after["usage"]["completion_tokens"] == 4  # the engine is free again
    listed = http.get("/v1/jobs?status=cancelled").json()["data"]
    assert {running, queued} <= {job["id"] for job in listed}


def _count_body(max_tokens: int) -> dict[str, Any]:
    return {"model": "default", "messages": COUNT, "max_tokens": max_tokens, "temperature": 0}


@pytest.fixture
def openai_client(server: str) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=f"{server}/v1", api_key="sk-local", max_retries=0, timeout=60)


@pytest.fixture
def anthropic_client(server: str) -> Any:
    from anthropic import Anthropic

    return Anthropic(base_url=server, api_key="sk-local", max_retries=0, timeout=60)
