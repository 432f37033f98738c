"""SIGTERM drains a worker without losing a request.

More requests than both engines hold at once: each worker takes what its
engine can batch and the rest wait in Redis. Mid-burst one worker gets
SIGTERM: it takes nothing new, finishes what it runs and exits cleanly, and
the other worker serves everything left. Every response must be the exact
greedy text.

A generation that outlasts the drain grace is handed back instead: the
drained worker stops it, puts its job back at the head of the queue and
exits, and another worker resumes it from the request's stream under a new
attempt. The client's stream must still read as one uninterrupted greedy
run.
"""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from openai import OpenAI

from shared import keys
from tests.distributed.conftest import (
    WORKER_SEQS,
    Fleet,
    Greedy,
    RedisServer,
    Worker,
    stream_chat,
    tokenize,
    wait_until,
)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TOPICS = ["the sea", "a forest", "the moon", "a city", "winter", "a river", "bread",
          "a violin", "the desert", "a lighthouse"]  # fmt: skip
MAX_TOKENS = 24
LONG_MESSAGES = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
LONG_MAX_TOKENS = 192  # seconds of decoding, even on a fast core: it cannot end within the grace
SHORT_GRACE_S = 1.0


def messages(topic: str) -> list[dict]:
    return [{"role": "user", "content": f"Write one sentence about {topic}."}]


def test_a_burst_is_shared_and_a_drained_worker_loses_nothing(
    api: str, fleet: Fleet, openai_client: OpenAI, reference: Greedy
):
    assert len(TOPICS) > 2 * WORKER_SEQS  # some requests must wait in the queue
    expected = [reference(tokenize(api, messages(topic)), MAX_TOKENS) for topic in TOPICS]

    def complete(topic: str) -> str:
        return "".join(
            text for _, text, _ in stream_chat(openai_client, messages(topic), MAX_TOKENS)
        )

    with ThreadPoolExecutor(len(TOPICS)) as pool:
        results = [pool.submit(complete, topic) for topic in TOPICS]
        wait_until(lambda: both_busy(fleet), 30, "both workers to run requests")
        drained = next(iter(fleet.workers.values()))
        began = time.monotonic()
        drained.child.process.send_signal(signal.SIGTERM)
        texts = [result.result(timeout=120) for result in results]

    assert texts == expected
    assert drained.child.process.wait(timeout=30) == 0
    drain_s = time.monotonic() - began
    assert drained.worker_id not in fleet.heartbeats()  # a clean exit removes its heartbeat
    assert drain_s < 30
    fleet.top_up()


def both_busy(fleet: Fleet) -> bool:
    """Every worker of ours has requests in its running batch: the burst is shared."""
    beats = fleet.heartbeats()
    return all(beats.get(worker_id, {}).get("running", 0) > 0 for worker_id in fleet.workers)


def test_a_generation_outlasting_the_drain_grace_is_handed_back_and_resumed(
    api: str,
    fleet: Fleet,
    redis_server: RedisServer,
    openai_client: OpenAI,
    reference: Greedy,
):
    """SIGTERM a worker with a 1 s grace mid-stream: the next worker finishes the stream exactly.

    The fleet is rearranged so the short-grace worker is the only one live
    when the request comes; the worker that resumes it starts loading only
    once the drain has begun, so it cannot have taken the job first.
    """
    first, second = list(fleet.workers.values())
    retire(fleet, first)
    drained = fleet.start_worker("--drain-grace", f"{SHORT_GRACE_S:g}")
    expected = reference(tokenize(api, LONG_MESSAGES), LONG_MAX_TOKENS)  # while it loads
    fleet.wait_live()
    retire(fleet, second)

    deltas = stream_chat(openai_client, LONG_MESSAGES, LONG_MAX_TOKENS)
    request_id, text, _ = next(deltas)
    while not text:
        _, text, _ = next(deltas)
    drained.child.process.send_signal(signal.SIGTERM)
    began = time.monotonic()
    fleet.top_up()  # the worker that resumes the request loads meanwhile
    assert drained.child.process.wait(timeout=30) == 0, drained.child.log()
    drain_s = time.monotonic() - began

    finish = None
    for _, delta, reason in deltas:
        text += delta
        finish = reason or finish
    assert text == expected
    assert finish == "length"
    stream = redis_server.client.xrange(keys.event_stream(request_id))
    attempts = [int(fields["a"]) for _, fields in stream]
    assert attempts[0] == 1 and max(attempts) >= 2, "the generation was not handed back"
    assert drain_s < SHORT_GRACE_S + 10  # it did not wait for the generation to end
    assert drained.worker_id not in fleet.heartbeats()
    fleet.top_up()


def retire(fleet: Fleet, worker: Worker) -> None:
    """Stop an idle worker of the fleet with SIGTERM (a clean, prompt exit) and forget it."""
    assert worker.child.stop(signal.SIGTERM) == 0, worker.child.log()
    del fleet.workers[worker.worker_id]
