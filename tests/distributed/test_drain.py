"""Two workers share a burst; SIGTERM drains one of them without losing a request.

More requests than both engines hold at once: each worker takes what its
engine can batch and the rest wait in Redis. Mid-burst one worker gets
SIGTERM: it takes nothing new, finishes what it runs and exits cleanly, and
the other worker serves everything left. Every response must be the exact
greedy text.
"""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from openai import OpenAI

from tests.distributed.conftest import WORKER_SEQS, Fleet, Greedy, stream_chat, tokenize, wait_until

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TOPICS = ["the sea", "a forest", "the moon", "a city", "winter", "a river", "bread",
          "a violin", "the desert", "a lighthouse"]  # fmt: skip
MAX_TOKENS = 96  # a burst that lasts past a heartbeat or two at today's speed


def messages(topic: str) -> list[dict]:
    return [{"role": "user", "content": f"Write one sentence about {topic}."}]


def test_a_burst_is_shared_and_a_drained_worker_loses_nothing(
    api: str, fleet: Fleet, openai_client: OpenAI, reference: Greedy
):
    assert len(TOPICS) > 2 * WORKER_SEQS  # some requests must wait in the queue
    expected = reference.many([tokenize(api, messages(topic)) for topic in TOPICS], MAX_TOKENS)

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
