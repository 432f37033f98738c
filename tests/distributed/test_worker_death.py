"""``kill -9`` of the worker serving a stream: the stream completes, exactly, elsewhere.

The job is redelivered after the visibility timeout to the surviving worker,
which resumes from the tokens already in the request's stream under a new
attempt. The client keeps reading the same stream, so its text must equal an
uninterrupted greedy run with no duplicate and no gap. Ten rounds (``make
soak`` runs more), each with a fresh replacement worker loading while the
survivor finishes the stream.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import pytest
from openai import OpenAI

from shared import keys
from tests.distributed.conftest import (
    VISIBILITY_TIMEOUT_S,
    Fleet,
    Greedy,
    RedisServer,
    stream_chat,
    tokenize,
    wait_until,
)
from workers.app import broker_transport_options
from workers.visibility import UNACKED_MUTEX_KEY

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

MESSAGES = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
MAX_TOKENS = 96
ROUNDS = int(os.environ.get("SLUICE_KILL_ROUNDS", "10"))  # ``make soak`` asks for more


@pytest.mark.parametrize("round_", range(ROUNDS))
def test_a_killed_worker_s_stream_completes_on_the_other(
    round_: int,
    api: str,
    fleet: Fleet,
    redis_server: RedisServer,
    openai_client: OpenAI,
    reference: Greedy,
):
    kill_mid_stream_and_finish(api, fleet, redis_server, openai_client, reference)


def test_a_worker_killed_mid_sweep_does_not_hold_up_redelivery(
    api: str,
    fleet: Fleet,
    redis_server: RedisServer,
    openai_client: OpenAI,
    reference: Greedy,
):
    """The victim dies holding the redelivery sweep's lock, as it would a few times in a thousand.

    The lock is left exactly as a worker takes it (kombu's lock, with the
    workers' own expiry), so no other worker can sweep the victim's job back to
    its queue until it expires.
    """
    expiry_s = broker_transport_options(VISIBILITY_TIMEOUT_S)["unacked_mutex_expire"]

    def hold_the_sweep_lock() -> None:
        lock = redis_server.client.lock(UNACKED_MUTEX_KEY, timeout=expiry_s)
        wait_until(lambda: lock.acquire(blocking=False), 5, "the sweep lock")

    kill_mid_stream_and_finish(
        api, fleet, redis_server, openai_client, reference, while_killing=hold_the_sweep_lock
    )


def kill_mid_stream_and_finish(
    api: str,
    fleet: Fleet,
    redis_server: RedisServer,
    client: OpenAI,
    reference: Greedy,
    while_killing: Callable[[], None] = lambda: None,
) -> None:
    """Stream, ``kill -9`` the serving worker, and check the stream ends as if nothing happened."""
    expected = reference(tokenize(api, MESSAGES), MAX_TOKENS)
    deltas = stream_chat(client, MESSAGES, MAX_TOKENS)
    request_id, text, _ = next(deltas)
    while not text:
        _, text, _ = next(deltas)
    streaming_since = time.time()

    serving = wait_until(lambda: serving_worker(fleet, streaming_since), 5, "the serving worker")
    victim = fleet.workers[serving]
    while_killing()
    os.kill(victim.pid, signal.SIGKILL)
    killed = time.monotonic()
    victim.child.process.wait()
    fleet.top_up()  # the replacement loads while the survivor resumes the stream

    finish = None
    for _, delta, reason in deltas:
        text += delta
        finish = reason or finish
    resumed_after = time.monotonic() - killed
    assert text == expected
    assert finish == "length"
    stream = redis_server.client.xrange(keys.event_stream(request_id))
    assert max(int(fields["a"]) for _, fields in stream) >= 2, "the stream was not resumed"
    assert resumed_after < 20


def serving_worker(fleet: Fleet, since: float) -> str | None:
    """Our one worker whose heartbeat, written after ``since``, shows a running sequence."""
    beats = {
        worker_id: beat for worker_id, beat in fleet.heartbeats().items() if beat["ts"] > since
    }
    if not all(worker_id in beats for worker_id in fleet.workers):
        return None  # an older beat could describe the previous round's request
    busy = [worker_id for worker_id in fleet.workers if beats[worker_id]["running"]]
    return busy[0] if len(busy) == 1 else None
