"""A Redis restart: requests in flight fail cleanly, later ones succeed, nothing restarted.

The server runs without persistence, so a restart loses every queue, stream
and lease, like a crashed Redis. A streamed request in flight must end with
an in-stream error and a whole one with a 503, promptly rather than at their
deadlines; then, once the workers have reconnected on their own, a new
request must get the exact greedy text from the same API process.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import anthropic
import openai
import pytest
from anthropic import Anthropic
from openai import OpenAI

from tests.distributed.conftest import (
    Fleet,
    Greedy,
    RedisServer,
    stream_chat,
    tokenize,
    wait_until,
)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

LONG = [{"role": "user", "content": "Write a long story about a dragon who learns to fly."}]
SHORT = [{"role": "user", "content": "Write one sentence about the sea."}]


def test_a_redis_restart_fails_requests_in_flight_and_later_ones_succeed(
    api: str, fleet: Fleet, redis_server: RedisServer, openai_client: OpenAI, reference: Greedy
):
    expected = reference(tokenize(api, SHORT), 12)
    whole_failure: list[BaseException] = []

    def whole_request() -> None:
        try:
            openai_client.chat.completions.create(
                model="default", messages=LONG, max_tokens=600, temperature=0
            )
        except openai.APIStatusError as exc:
            whole_failure.append(exc)

    deltas = stream_chat(openai_client, LONG, 600)
    next(deltas)  # the stream has started
    whole = threading.Thread(target=whole_request)
    whole.start()
    time.sleep(0.5)  # the whole request is queued or running too

    restarted = time.monotonic()
    redis_server.restart()
    with pytest.raises(openai.APIError) as in_stream:
        for _ in deltas:
            pass
    stream_failed_after = time.monotonic() - restarted
    whole.join(timeout=30)
    assert "Redis" in in_stream.value.message
    assert [failure.status_code for failure in whole_failure] == [503]
    assert whole_failure[0].response.headers["retry-after"]
    assert stream_failed_after < 5

    fleet.wait_live(timeout=30)  # the workers reconnect by themselves
    # nothing keeps generating for the failed requests (their leases went with the data)
    wait_until(idle_fleet(fleet), 10, "the workers to stop the failed requests", interval=0.2)
    again = openai_client.chat.completions.create(
        model="default", messages=SHORT, max_tokens=12, temperature=0
    )
    assert again.choices[0].message.content == expected
    assert time.monotonic() - restarted < 30


def idle_fleet(fleet: Fleet) -> Callable[[], bool]:
    def idle() -> bool:
        beats = fleet.heartbeats().values()
        return bool(beats) and all(beat["running"] + beat["waiting"] == 0 for beat in beats)

    return idle


LINES = 24


def test_a_batch_running_through_a_redis_restart_still_answers_every_line(
    api: str, fleet: Fleet, redis_server: RedisServer, anthropic_client: Anthropic
):
    """Redis forgets the batch, its lines' jobs and their leases: the replica running it
    writes the batch back and runs the lines it lost again, so every line succeeds."""
    params = {"model": "default", "max_tokens": 64, "temperature": 0, "messages": SHORT}
    # enough lines that the batch still runs when Redis restarts, at today's speed
    requests = [{"custom_id": f"r{n}", "params": params} for n in range(LINES)]
    batch = anthropic_client.messages.batches.create(requests=requests)
    wait_until(
        lambda: anthropic_client.messages.batches.retrieve(batch.id).request_counts.succeeded,
        120,
        "a first line to succeed",
        interval=0.2,
    )
    redis_server.restart()
    fleet.wait_live(timeout=30)

    def ended() -> bool:
        try:
            return anthropic_client.messages.batches.retrieve(batch.id).processing_status == "ended"
        except anthropic.APIStatusError:  # the record is written back within a poll
            return False

    wait_until(ended, 180, "the batch to end", interval=0.5)
    done = anthropic_client.messages.batches.retrieve(batch.id)
    assert done.request_counts.succeeded == len(requests), done.request_counts
    results = list(anthropic_client.messages.batches.results(batch.id))
    assert sorted(result.custom_id for result in results) == sorted(f"r{n}" for n in range(LINES))
    assert {result.result.type for result in results} == {"succeeded"}
    texts = {result.result.message.content[0].text for result in results}
    assert len(texts) == 1  # greedy: every line the same answer, however often it ran
