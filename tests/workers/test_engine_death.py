"""A worker whose engine thread died hands its runs back at once and shuts itself down.

The engine thread catches ``Exception`` around each command and step;
anything else (here a command raising ``SystemExit``, as a library calling
``sys.exit`` would) leaves its loop and ends the thread. The hosts here run
on engines of their own on the suite's weights, against a Redis of the
test's own, so that the jobs they hand back wait in no queue a worker reads.
The watchdog's SIGTERM would end pytest, so the runtimes here get a
shutdown action that only records its call; the exit code is ``serve``'s.
"""

from __future__ import annotations

import json
import threading
import time
import uuid

import pytest
import redis

from engine.llm_engine import LLMEngine
from shared import keys
from shared.registry import DEFAULT_MODEL
from shared.sampling import SamplingParams
from shared.wire import Deadlines, PreparedRequest, QueuedRequest, encode_queued
from tests.workers.conftest import (
    PROMPT,
    engine_on_the_same_weights,
    take_as_a_worker,
    task_context,
    wait_until,
)
from workers.heartbeat import WorkerIdentity
from workers.host import Outcome, Run, WorkerHost
from workers.publisher import EventPublisher
from workers.runtime import WorkerRuntime, connect
from workers.task import run_job

LONG = SamplingParams(max_tokens=200, temperature=0.0)  # still running when the engine dies
GRACE_S = 30.0  # a drain that waited it out would fail the test by far
FAST_S = 0.05  # heartbeat and watchdog intervals of the runtimes here

# The engine thread ending on an uncaught exception is what these tests are about.
engine_thread_dies = pytest.mark.filterwarnings(
    "ignore::pytest.PytestUnhandledThreadExceptionWarning"
)


def kill_engine_thread(host: WorkerHost) -> None:
    """End the engine thread with a command that raises what it does not catch."""

    def die(engine: LLMEngine) -> None:
        raise SystemExit("the engine thread dies")

    host._thread.call(die)
    wait_until(host.engine_died, 5, "the engine thread to die")


def prepared(request_id: str) -> PreparedRequest:
    return PreparedRequest(request_id, DEFAULT_MODEL, PROMPT, LONG, created=time.time())


def streamed(client: redis.Redis, request_id: str) -> int:
    return client.xlen(keys.event_stream(request_id))


@engine_thread_dies
def test_the_watchdog_hands_back_a_dead_engine_s_runs_at_once(
    engine: LLMEngine, quiet_redis_url: str
) -> None:
    own = connect(quiet_redis_url)
    publisher = EventPublisher(own, DEFAULT_MODEL)
    deaths: list[float] = []
    host = WorkerHost(
        engine_on_the_same_weights(engine), publisher, lambda: deaths.append(time.monotonic()),
        engine_check_s=FAST_S,
    )  # fmt: skip
    host.start()
    direct_id, task_id = uuid.uuid4().hex, uuid.uuid4().hex
    run = Run(prepared(direct_id), own.incr(keys.lease(direct_id)))
    context = task_context(own, publisher, host)
    job = QueuedRequest(prepared(task_id), Deadlines())
    take_as_a_worker(own, context, [job])
    task = threading.Thread(target=run_job, args=(context, encode_queued(job)))
    try:
        host.submit(run)
        task.start()
        wait_until(
            lambda: all(streamed(own, rid) >= 2 for rid in (direct_id, task_id)),
            30,
            "tokens to flow for both runs",
        )
        kill_engine_thread(host)
        died = time.monotonic()

        outcome = run.wait(5)
        task.join(5)  # its task thread wakes at once, requeues the job and returns
        resolved_s = time.monotonic() - died
        late = Run(prepared(uuid.uuid4().hex), 1)
        host.submit(late)  # after the death: nothing would ever run it
        late_outcome = late.wait(5)
        began = time.monotonic()
        handed_back = host.drain(GRACE_S)
        drain_s = time.monotonic() - began
        requeued = own.lrange(keys.queue_name(DEFAULT_MODEL), 0, -1)
    finally:
        host.stop(10)
        own.close()

    assert outcome is Outcome.HANDED_BACK and late_outcome is Outcome.HANDED_BACK
    assert resolved_s < 1.0 and len(deaths) == 1 and host.draining
    assert not task.is_alive()
    assert handed_back == 0 and drain_s < 1.0  # nothing left for the drain
    assert len(requeued) == 1 and task_id.encode() in requeued[0]  # the task's job, back
    assert host.running() == {} and host.snapshot.runs == 0
    assert host.engine_died()  # still, once stopped: the worker's exit code says so


def test_a_host_not_yet_started_or_stopped_has_no_dead_engine(
    engine: LLMEngine, quiet_redis_url: str
) -> None:
    own = connect(quiet_redis_url)
    host = WorkerHost(engine_on_the_same_weights(engine), EventPublisher(own, DEFAULT_MODEL))
    assert not host.engine_died()
    host.start()
    assert not host.engine_died()
    host.stop(10)
    own.close()

    assert not host.engine_died()


@engine_thread_dies
def test_the_watchdog_drains_a_worker_whose_engine_died_and_shuts_it_down(
    engine: LLMEngine, quiet_redis_url: str
) -> None:
    deaths: list[float] = []
    identity = WorkerIdentity("engine-death", DEFAULT_MODEL)
    runtime = WorkerRuntime.start(
        quiet_redis_url,
        identity,
        engine_on_the_same_weights(engine),
        heartbeat_interval_s=FAST_S,
        on_engine_death=lambda: deaths.append(time.monotonic()),
        engine_check_s=FAST_S,
    )
    loads = keys.worker_loads(DEFAULT_MODEL)

    def draining() -> bool | None:
        beat = runtime.client.hget(loads, identity.worker_id)
        return None if beat is None else json.loads(beat)["draining"]

    try:
        wait_until(lambda: draining() is False, 5, "a beat of a live worker")
        kill_engine_thread(runtime.host)
        wait_until(lambda: deaths, 5, "the shutdown")
        assert runtime.host.draining and runtime.engine_died
        wait_until(draining, 5, "a beat that says draining")
        time.sleep(5 * FAST_S)
        assert len(deaths) == 1  # the shutdown is begun once
    finally:
        runtime.stop()

    with redis.Redis.from_url(quiet_redis_url) as client:
        assert not client.hexists(loads, identity.worker_id)
        assert client.zscore(keys.workers(DEFAULT_MODEL), identity.worker_id) is None


def test_a_runtime_stopped_cleanly_is_not_shut_down_by_its_watchdog(
    engine: LLMEngine, quiet_redis_url: str
) -> None:
    deaths: list[float] = []
    runtime = WorkerRuntime.start(
        quiet_redis_url,
        WorkerIdentity("stopped-cleanly", DEFAULT_MODEL),
        engine_on_the_same_weights(engine),
        heartbeat_interval_s=FAST_S,
        on_engine_death=lambda: deaths.append(time.monotonic()),
        engine_check_s=FAST_S,
    )
    time.sleep(2 * FAST_S)
    runtime.stop()
    time.sleep(2 * FAST_S)

    assert deaths == [] and not runtime.engine_died and not runtime.host.draining
