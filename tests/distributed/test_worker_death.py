"""``kill -9`` of the worker serving a stream: the stream completes, exactly, elsewhere.

The killed worker's registry entry stops being renewed and expires within
``keys.HEARTBEAT_TTL_S``; the next heartbeat of the surviving worker finds it
expired and puts the job it had taken back at the head of its queue, where
the survivor takes it and resumes from the tokens already in the request's
stream under a new attempt, a few seconds after the kill. The client keeps
reading the same stream, so its text must equal an uninterrupted greedy run
with no duplicate and no gap, and its longest wait between two deltas (the
stall the client sees) stays within seconds. One round here, beside the
constrained stream's (``make soak`` runs fifty), each with a fresh
replacement worker loading while the survivor finishes the stream; the last
test prints the stalls over the rounds.

A worker killed right after its take script ran holds a job it never
started: the job must wait while the worker's entry lives, then run, whole,
on a live worker.
"""

from __future__ import annotations

import json
import math
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator

import jsonschema
import pytest
import redis
from openai import OpenAI

from shared import keys
from shared.constraints import grammar_of
from shared.event_codec import Entry, decode_entry
from shared.events import Finish, FinishReason, Text
from shared.registry import DEFAULT_MODEL
from shared.sampling import SamplingParams, StructuredOutputs
from shared.task_message import queue_lists, task_message
from shared.wire import Deadlines, PreparedRequest, QueuedRequest
from tests.distributed.conftest import (
    MAX_MODEL_LEN,
    WORKER_SEQS,
    Fleet,
    GhostWorker,
    Greedy,
    RedisServer,
    stream_chat,
    tokenize,
    wait_until,
)
from workers.broker.scripts import TAKE
from workers.broker.transport import START_ARGS

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

MESSAGES = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
MAX_TOKENS = 256  # a second or more of stream: heartbeats show its worker before it ends
CONSTRAINED_MAX_TOKENS = 200
ROUNDS = int(os.environ.get("SLUICE_KILL_ROUNDS", "1"))  # ``make soak`` asks for more
STALL_BOUND_S = 10  # the longest wait for the next delta a client may see across a kill
RESUMED_BOUND_S = 12  # from the kill to the first delta the survivor generated
STALLS: list[float] = []  # each round's longest gap between deltas, for the summary
RESUMED: list[float] = []  # each round's time from the kill to the survivor's first delta


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


LIST_SCHEMA = {
    "type": "object",
    "properties": {
        "keeper": {"type": "string", "maxLength": 20},
        "days": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "day": {"type": "integer", "minimum": 1, "maximum": 99},
                    "event": {"type": "string", "maxLength": 40},
                },
                "required": ["day", "event"],
                "additionalProperties": False,
            },
            "minItems": 6,
            "maxItems": 6,
        },
    },
    "required": ["keeper", "days"],
    "additionalProperties": False,
}


def test_a_killed_worker_s_constrained_stream_completes_to_the_same_object(
    api: str,
    fleet: Fleet,
    redis_server: RedisServer,
    openai_client: OpenAI,
    reference: Greedy,
):
    """The survivor replays the matcher over the tokens already streamed and continues."""
    grammar = grammar_of(StructuredOutputs(json=LIST_SCHEMA))
    structured = StructuredOutputs(grammar=grammar)
    expected = reference(tokenize(api, MESSAGES), CONSTRAINED_MAX_TOKENS, structured)
    response_format = {"type": "json_schema", "json_schema": {"name": "log", "schema": LIST_SCHEMA}}
    deltas = stream_chat(
        openai_client, MESSAGES, CONSTRAINED_MAX_TOKENS, response_format=response_format
    )
    reader = kill_mid_stream(fleet, redis_server, deltas, expected)
    assert reader.finish == "stop"
    jsonschema.validate(json.loads(reader.text), LIST_SCHEMA)


def test_a_job_taken_by_a_worker_killed_before_it_started_runs_elsewhere(
    api: str, fleet: Fleet, redis_server: RedisServer, reference: Greedy
):
    """The victim's take script ran (the job is in its taken records, its attempt 1 taken)
    and the victim died before generating anything: no event, no stream.

    The victim is a worker of the model's registry with no process behind it;
    its last beat and its take are the workers' own scripts. The job is put on
    its queue and taken in one transaction, so no real worker can take it
    first. It must stay where it is while the victim's entry lives (a live
    worker's jobs are never taken from it), then run on a live worker, whole,
    under attempt 2.
    """
    client = redis_server.client
    prompt = tokenize(api, MESSAGES)
    expected = reference(prompt, MAX_TOKENS)
    sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    request_id = f"taken-unstarted-{uuid.uuid4().hex}"
    request = PreparedRequest(request_id, DEFAULT_MODEL, prompt, sampling, created=time.time())
    message = task_message(QueuedRequest(request, Deadlines()))
    victim = GhostWorker(client, "victim")
    taken_key = keys.taken(victim.worker_id)
    stream = keys.event_stream(request_id)
    queue = keys.queue_name(DEFAULT_MODEL)
    assert not any(client.llen(name) for name in queue_lists(queue)), "queue not empty"

    victim.beat(
        ttl_s=keys.HEARTBEAT_TTL_S, capacity=WORKER_SEQS, max_model_len=MAX_MODEL_LEN,
        running=0, waiting=0, kv_blocks_used=0, aborted=0, ts=time.time(),
    )  # fmt: skip
    killed = time.monotonic()  # its last beat: the entry expires one TTL from now
    client.script_load(TAKE.source)
    script_keys = [taken_key, message.wake, *queue_lists(queue)]
    with client.pipeline(transaction=True) as pipe:
        pipe.lpush(message.key, message.body)
        pipe.lpush(message.wake, "1")
        pipe.evalsha(TAKE.sha, len(script_keys), *script_keys, 1, 1, *START_ARGS)
        *_, (taken, started) = pipe.execute()
    assert taken == [message.key, message.body], "the victim did not take the job"
    assert started[0] == request_id and started[1][0] == 1  # its attempt 1, taken
    assert client.hlen(taken_key) == 1 and not client.exists(message.wake)

    wait_until(lambda: client.exists(stream), 30, "the job to run on a live worker")
    first_event_after = time.monotonic() - killed
    wait_until(lambda: finished(client, request_id), 60, "the job to finish")

    entries = [decode_entry(request_id, fields) for _, fields in client.xrange(stream)]
    text = "".join(entry.event.text for entry in entries if isinstance(entry.event, Text))
    assert text == expected
    assert isinstance(entries[-1].event, Finish)
    assert entries[-1].event.reason is FinishReason.LENGTH
    assert {entry.attempt for entry in entries} == {2}  # attempt 1 died unused
    # not before the victim's entry expired: a live worker keeps what it took
    assert first_event_after >= keys.HEARTBEAT_TTL_S - 0.1
    assert first_event_after < RESUMED_BOUND_S
    assert not client.exists(taken_key)  # handed back by a survivor's heartbeat
    assert client.zscore(keys.workers(DEFAULT_MODEL), victim.worker_id) is None
    assert not client.hexists(keys.worker_loads(DEFAULT_MODEL), victim.worker_id)


def test_stalls_over_the_kill_rounds(capsys: pytest.CaptureFixture[str]):
    """Reports the stalls the rounds above measured (``make soak``: over its rounds)."""
    if not STALLS:
        pytest.skip("no kill round ran")
    lines = [
        f"\nkill -9 mid-stream, {len(STALLS)} round(s):",
        f"  longest gap between deltas (s): {summary(STALLS)}",
        f"  kill to the survivor's first delta (s): {summary(RESUMED)}",
    ]
    report = "\n".join(lines)
    print(report)
    with capsys.disabled():  # shown under ``pytest -q`` too
        print(report)


def summary(values: list[float]) -> str:
    ordered = sorted(values)

    def percentile(p: float) -> float:  # nearest rank
        return ordered[max(math.ceil(p / 100 * len(ordered)), 1) - 1]

    return f"p50 {percentile(50):.2f}  p99 {percentile(99):.2f}  max {ordered[-1]:.2f}"


class StreamReader(threading.Thread):
    """Reads a streamed chat completion in the background, each delta timed as it arrives.

    Timed here and not in the test's own loop, which stops reading while it
    finds and kills the serving worker: what arrives meanwhile would look late.
    """

    def __init__(self, deltas: Iterator[tuple[str, str, str | None]]) -> None:
        super().__init__(name="stream-reader", daemon=True)
        self._deltas = deltas
        self.request_id = ""
        self.received: list[tuple[float, str]] = []  # (time.monotonic(), text) per content delta
        self.finish: str | None = None
        self.error: BaseException | None = None
        self.first_text = threading.Event()

    def run(self) -> None:
        try:
            for request_id, delta, reason in self._deltas:
                at = time.monotonic()
                self.request_id = request_id
                if delta:
                    self.received.append((at, delta))
                    self.first_text.set()
                self.finish = reason or self.finish
        except BaseException as exc:  # re-raised in the test's thread
            self.error = exc
        finally:
            self.first_text.set()

    @property
    def text(self) -> str:
        return "".join(delta for _, delta in self.received)


def kill_mid_stream_and_finish(
    api: str, fleet: Fleet, redis_server: RedisServer, client: OpenAI, reference: Greedy
) -> None:
    """Stream, ``kill -9`` the serving worker, check the stream ends as if nothing happened,
    and time the stall the client saw."""
    expected = reference(tokenize(api, MESSAGES), MAX_TOKENS)
    reader = kill_mid_stream(
        fleet, redis_server, stream_chat(client, MESSAGES, MAX_TOKENS), expected
    )
    assert reader.finish == "length"


def kill_mid_stream(
    fleet: Fleet,
    redis_server: RedisServer,
    deltas: Iterator[tuple[str, str, str | None]],
    expected: str,
) -> StreamReader:
    """Read ``deltas``, ``kill -9`` the serving worker, check the text is ``expected`` and
    record the stall; the reader is returned for the caller's own checks."""
    reader = StreamReader(deltas)
    reader.start()
    assert reader.first_text.wait(120), "no text streamed"
    if reader.error is not None:
        raise reader.error
    streaming_since = time.time()

    serving = wait_until(lambda: serving_worker(fleet, streaming_since), 5, "the serving worker")
    victim = fleet.workers[serving]
    os.kill(victim.pid, signal.SIGKILL)
    killed = time.monotonic()
    victim.child.process.wait()
    fleet.top_up()  # the replacement loads while the survivor resumes the stream

    reader.join(timeout=120)
    assert not reader.is_alive(), "the stream did not end"
    if reader.error is not None:
        raise reader.error
    entries = [
        decode_entry(reader.request_id, fields)
        for _, fields in redis_server.client.xrange(keys.event_stream(reader.request_id))
    ]
    assert max(entry.attempt for entry in entries) >= 2, "the stream was not resumed"
    assert reader.text == expected

    times = [at for at, _ in reader.received]
    stall = max(later - earlier for earlier, later in zip(times, times[1:], strict=False))
    resumed_after = survivor_s_first_delta(reader, entries) - killed
    STALLS.append(stall)
    RESUMED.append(resumed_after)
    assert stall < STALL_BOUND_S
    assert 0 < resumed_after < RESUMED_BOUND_S
    return reader


def survivor_s_first_delta(reader: StreamReader, entries: list[Entry]) -> float:
    """When the client got the first text the victim had not written.

    Deltas can still arrive after the kill with text the victim wrote before
    it (the API was relaying them); the survivor's text is what comes after
    the first attempt's, which the client's text extends without a gap.
    """
    first_attempt = min(entry.attempt for entry in entries)
    written = sum(
        len(entry.event.text)
        for entry in entries
        if entry.attempt == first_attempt and isinstance(entry.event, Text)
    )
    received = 0
    for at, delta in reader.received:
        received += len(delta)
        if received > written:
            return at
    pytest.fail("the client got no text after the first attempt's")


def finished(client: redis.Redis, request_id: str) -> bool:
    """The request's stream ends with a Finish."""
    last = client.xrevrange(keys.event_stream(request_id), count=1)
    return bool(last) and isinstance(decode_entry(request_id, last[0][1]).event, Finish)


def serving_worker(fleet: Fleet, since: float) -> str | None:
    """Our one worker whose heartbeat, written after ``since``, shows a running sequence."""
    beats = {
        worker_id: beat for worker_id, beat in fleet.heartbeats().items() if beat["ts"] > since
    }
    if not all(worker_id in beats for worker_id in fleet.workers):
        return None  # an older beat could describe the previous round's request
    busy = [worker_id for worker_id in fleet.workers if beats[worker_id]["running"]]
    return busy[0] if len(busy) == 1 else None
