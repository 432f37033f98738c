"""Stored and background responses through the official ``openai`` SDK.

Greedy decoding makes a response a function of its input, so a background
response, a replayed stream and a continued conversation are each compared
with the same request made in the foreground.
"""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from openai import OpenAI

pytestmark = pytest.mark.slow

MODEL = "default"
SEA = "Write one sentence about the sea."
TOKENS = 16
LONG = 1000  # enough tokens that a cancel lands mid-way


def _create(client: OpenAI, **kwargs):
    options = {"model": MODEL, "input": SEA, "max_output_tokens": TOKENS, "temperature": 0}
    return client.responses.create(**{**options, **kwargs})


def _settled(client: OpenAI, response_id: str, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        response = client.responses.retrieve(response_id)
        if response.status not in ("queued", "in_progress"):
            return response
        time.sleep(0.1)
    pytest.fail(f"{response_id} never settled")


def test_a_stored_response_is_retrieved_and_deleted(openai_client: OpenAI):
    created = _create(openai_client)
    assert created.store is True
    retrieved = openai_client.responses.retrieve(created.id)
    assert retrieved.output_text == created.output_text and retrieved.usage == created.usage
    openai_client.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.retrieve(created.id)
    unstored = _create(openai_client, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.retrieve(unstored.id)


def test_a_streamed_response_is_stored_once_it_ends(openai_client: OpenAI):
    final = None
    for event in _create(openai_client, stream=True):
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert final is not None
    deadline = time.monotonic() + 10
    while True:  # kept right after the last event is sent
        try:
            retrieved = openai_client.responses.retrieve(final.id)
            break
        except openai.NotFoundError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    assert retrieved.output_text == final.output_text


def test_previous_response_id_continues_the_conversation_from_the_cache(openai_client: OpenAI):
    first = _create(openai_client)
    follow_up = "Now one about the moon."
    continued = _create(openai_client, input=follow_up, previous_response_id=first.id)
    explicit = _create(
        openai_client,
        input=[
            {"role": "user", "content": SEA},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": follow_up},
        ],
        store=False,
    )
    assert continued.previous_response_id == first.id
    assert continued.output_text == explicit.output_text
    assert continued.usage.input_tokens == explicit.usage.input_tokens
    # the first prompt and its answer come from the prefix cache, at least the first's full blocks
    assert continued.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // 16 * 16
    items = openai_client.responses.input_items.list(continued.id, order="asc").data
    texts = [item.content[0].text for item in items]
    assert texts == [SEA, first.output_text, follow_up]
    assert [item.role for item in items] == ["user", "assistant", "user"]
    newest = openai_client.responses.input_items.list(continued.id, limit=1)
    assert [item.id for item in newest.data] == [items[-1].id] and newest.has_more
    third = _create(openai_client, input="And the stars?", previous_response_id=continued.id)
    assert third.usage.input_tokens > continued.usage.input_tokens  # the whole chain


def test_a_background_response_replays_its_stream_after_a_sequence_number(openai_client: OpenAI):
    foreground = _create(openai_client, store=False)
    queued = _create(openai_client, background=True)
    assert queued.status == "queued" and queued.background is True and queued.output == []
    k = 3
    events = list(openai_client.responses.retrieve(queued.id, stream=True, starting_after=k))
    assert [event.sequence_number for event in events] == list(range(k + 1, k + 1 + len(events)))
    assert events[-1].type == "response.incomplete"  # max_output_tokens
    assert events[-1].response.output_text == foreground.output_text
    whole = list(openai_client.responses.retrieve(queued.id, stream=True))
    assert [event.sequence_number for event in whole][: k + 1] == list(range(k + 1))
    assert whole[k + 1 :] == events
    settled = _settled(openai_client, queued.id)
    assert settled.output_text == foreground.output_text and settled.background is True


def test_an_empty_cursor_replays_from_the_first_event(openai_client: OpenAI, http: httpx.Client):
    queued = _create(openai_client, background=True)
    _settled(openai_client, queued.id)
    params = {"stream": "true", "starting_after": ""}
    replay = http.get(f"/v1/responses/{queued.id}", params=params, timeout=30)
    first = next(line for line in replay.text.splitlines() if line.startswith("id:"))
    assert first == "id: 0"


def test_a_background_response_asked_to_stream_streams_its_events(openai_client: OpenAI):
    foreground = _create(openai_client, store=False)
    events = list(_create(openai_client, background=True, stream=True))
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[0].response.background is True
    assert events[-1].response.output_text == foreground.output_text
    assert openai_client.responses.retrieve(events[-1].response.id).status == "incomplete"


def test_cancelling_a_background_response_stops_its_generation(openai_client: OpenAI):
    story = "Write a long story about a lighthouse keeper."  # hundreds of tokens, greedily
    running = _create(openai_client, background=True, max_output_tokens=LONG, input=story)
    deadline = time.monotonic() + 60
    while openai_client.responses.retrieve(running.id).status == "queued":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    cancelled = openai_client.responses.cancel(running.id)
    assert cancelled.status == "cancelled"
    time.sleep(1)
    assert openai_client.responses.retrieve(running.id).status == "cancelled"
    events = list(openai_client.responses.retrieve(running.id, stream=True))
    deltas = [event for event in events if event.type == "response.output_text.delta"]
    assert len(deltas) < LONG // 2  # it stopped, far short of its budget


def test_a_responses_job_with_store_false_is_not_a_stored_response(
    openai_client: OpenAI, http: httpx.Client
):
    body = {"model": MODEL, "input": SEA, "max_output_tokens": 4, "store": False}
    job = http.post("/v1/jobs", json={"endpoint": "/v1/responses", "body": body}).json()
    deadline = time.monotonic() + 60
    while (job := http.get(f"/v1/jobs/{job['id']}").json())["status"] in ("queued", "running"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert job["status"] == "completed"  # the job itself keeps its result
    response_id = job["result"]["id"]
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.retrieve(response_id)
    with pytest.raises(openai.NotFoundError):
        _create(openai_client, previous_response_id=response_id)


@pytest.mark.parametrize("cursor", ["-2", "-1", "x", "1e3", "1.5", str(2**64)])
def test_a_stream_cursor_outside_the_stream_is_refused_and_the_server_keeps_answering(
    openai_client: OpenAI, http: httpx.Client, cursor: str
):
    """A cursor before the first event once froze the server (a read loop that never suspended)."""
    count = "Count to 1000."
    queued = _create(openai_client, background=True, max_output_tokens=LONG, input=count)
    openai_client.responses.cancel(queued.id)  # cancelled while queued or just started
    answer = http.get(
        f"/v1/responses/{queued.id}",
        params={"stream": "true", "starting_after": cursor},
        timeout=10,
    )
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "starting_after"
    assert http.get("/health", timeout=2).status_code == 200
    replay = http.get(f"/v1/responses/{queued.id}", params={"stream": "true"}, timeout=10)
    assert replay.status_code == 200  # the whole (short) stream, then its end


@pytest.mark.parametrize(
    ("call", "param"),
    [
        (lambda c: _create(c, background=True, store=False), "store"),
        (lambda c: c.responses.cancel(_create(c).id), "response_id"),
        (lambda c: list(c.responses.retrieve(_create(c).id, stream=True)), "stream"),
        (lambda c: _create(c, previous_response_id="resp_unknown"), "previous_response_id"),
    ],
)
def test_what_cannot_be_done_is_refused(openai_client: OpenAI, call, param: str):
    with pytest.raises((openai.BadRequestError, openai.NotFoundError)) as caught:
        call(openai_client)
    assert caught.value.body["param"] == param
