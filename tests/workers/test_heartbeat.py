"""Heartbeats: the registry entry and load report, the hand-back of dead workers' jobs and of
a worker's own queue, and the cache summary's renewal."""

from __future__ import annotations

import dataclasses
import json
import time
import uuid

import redis

from engine.block_manager import CacheChanges
from shared import keys
from shared.prefix_hash import digest
from shared.registry import DEFAULT_MODEL
from shared.sampling import SamplingParams
from shared.task_message import REQUEST_HEADER
from shared.wire import WorkerLoad
from tests.workers.conftest import (
    CAPACITY,
    KV_BLOCKS,
    MAX_MODEL_LEN,
    WORKER_ID,
    Producer,
    wait_until,
)
from workers.broker.scripts import TAKE
from workers.broker.transport import BINDING_PREFIXES
from workers.cache_summary import SUMMARY_TTL_S, CacheSummary
from workers.heartbeat import Heartbeat, WorkerIdentity
from workers.host import HostSnapshot
from workers.runtime import WorkerRuntime

FIELDS = {field.name for field in dataclasses.fields(WorkerLoad)}  # what placement reads
SNAPSHOT = HostSnapshot(capacity=2, max_model_len=64, kv_blocks_total=8, running=1)
TTL_S = 0.4  # the registry TTL of the heartbeats built here


def redis_now(client: redis.Redis) -> float:
    seconds, micros = client.time()
    return seconds + micros / 1e6


def heartbeat(client: redis.Redis, worker_id: str, model: str, interval_s: float) -> Heartbeat:
    identity = WorkerIdentity(worker_id, model)
    return Heartbeat(client, identity, lambda: SNAPSHOT, lambda: False, interval_s, TTL_S)


def hold(client: redis.Redis, worker_id: str, queue: str, bodies: list[str]) -> None:
    """``worker_id`` takes ``bodies`` from ``queue`` with the real take script."""
    messages = [json.dumps({"properties": {"delivery_tag": body}, "body": body}) for body in bodies]
    client.lpush(queue, *messages)
    taken, _ = TAKE.bind(client)(
        keys=[keys.taken(worker_id), f"{queue}:wake", queue], args=[len(bodies), 1]
    )
    assert len(taken) == 2 * len(bodies) and client.llen(queue) == 0


def beat_until_reclaimed(client: redis.Redis, worker_id: str, model: str) -> Heartbeat:
    """A live worker of ``model`` that beats until it has reclaimed a dead one's jobs."""
    live = heartbeat(client, worker_id, model, interval_s=0.05)
    live.start()
    try:
        wait_until(lambda: live.reclaimed, 5, "the dead worker's jobs reclaimed")
    finally:
        live.stop(timeout=5)
    return live


def bodies_on(client: redis.Redis, queue: str) -> list[str]:
    """The queue's messages, head first (workers pop from the right)."""
    return [json.loads(item)["body"] for item in reversed(client.lrange(queue, 0, -1))]


def test_heartbeat_reports_the_load_with_a_short_ttl(
    worker: WorkerRuntime, producer: Producer, client: redis.Redis
) -> None:
    before = producer.heartbeat()
    producer.wait_end(producer.send(SamplingParams(max_tokens=4, temperature=0.0)))
    wait_until(
        lambda: producer.heartbeat()["generated_tokens"] >= before["generated_tokens"] + 4,
        5,
        "the tokens counted",
    )

    beat = producer.heartbeat()
    assert set(beat) == FIELDS
    assert beat["worker_id"] == WORKER_ID and beat["model"] == DEFAULT_MODEL
    assert beat["capacity"] == CAPACITY and beat["max_model_len"] == MAX_MODEL_LEN
    assert beat["kv_blocks_total"] == KV_BLOCKS and beat["draining"] is False
    assert beat["steps"] > before["steps"] and abs(beat["ts"] - time.time()) < 5
    expiry = client.zscore(keys.workers(DEFAULT_MODEL), WORKER_ID)
    assert 0 < expiry - redis_now(client) <= keys.HEARTBEAT_TTL_S


def test_a_stopped_heartbeat_leaves_and_hands_back_what_it_held(client: redis.Redis) -> None:
    model, queue = f"model-{uuid.uuid4().hex}", f"queue-{uuid.uuid4().hex}"
    beats = heartbeat(client, "short-lived", model, interval_s=0.05)

    beats.start()
    wait_until(lambda: client.zscore(keys.workers(model), "short-lived"), 5, "the first beat")
    hold(client, "short-lived", queue, ["a", "b"])
    beats.stop(timeout=5)

    assert client.zscore(keys.workers(model), "short-lived") is None
    assert not client.hexists(keys.worker_loads(model), "short-lived")
    assert sorted(bodies_on(client, queue)) == ["a", "b"] and client.llen(f"{queue}:wake") == 2
    assert not client.exists(keys.taken("short-lived"))


def test_a_dead_worker_s_jobs_go_back_to_the_head_of_their_queue(client: redis.Redis) -> None:
    """Its registry entry expired: a live worker's next beats put its jobs back first in line."""
    model, queue = f"model-{uuid.uuid4().hex}", f"queue-{uuid.uuid4().hex}"
    hold(client, "dead", queue, ["held-1", "held-2"])
    client.zadd(keys.workers(model), {"dead": redis_now(client) - 1})
    client.hset(keys.worker_loads(model), "dead", "{}")
    client.lpush(queue, json.dumps({"body": "queued-later"}))
    live = beat_until_reclaimed(client, "live", model)

    order = bodies_on(client, queue)
    assert sorted(order[:2]) == ["held-1", "held-2"] and order[2] == "queued-later"
    assert live.reclaimed == 2 and client.llen(f"{queue}:wake") == 2
    assert client.zscore(keys.workers(model), "dead") is None
    assert not client.hexists(keys.worker_loads(model), "dead")
    assert not client.exists(keys.taken("dead"))


def test_a_worker_reclaims_only_after_beating_for_a_whole_ttl(client: redis.Redis) -> None:
    """After an outage every entry has expired; each live worker gets a TTL to renew its own."""
    model, queue = f"model-{uuid.uuid4().hex}", f"queue-{uuid.uuid4().hex}"
    hold(client, "late", queue, ["kept"])
    client.zadd(keys.workers(model), {"late": redis_now(client) - 1})
    back = heartbeat(client, "back", model, interval_s=0.05)

    back.beat()  # the first beat after the outage
    assert client.hlen(keys.taken("late")) == 1 and back.reclaimed == 0
    time.sleep(TTL_S / 2)
    back.beat()
    assert client.hlen(keys.taken("late")) == 1 and back.reclaimed == 0
    time.sleep(TTL_S / 2 + 0.05)
    back.beat()

    assert back.reclaimed == 1 and bodies_on(client, queue) == ["kept"]
    client.delete(keys.workers(model), keys.worker_loads(model))


def test_a_stall_of_redis_longer_than_the_ttl_takes_no_live_worker_for_dead(
    client: redis.Redis,
) -> None:
    """Redis paused (a fork, a VM pause): every entry expired; whoever beats first reclaims no one.

    The pause is played by moving both entries' expiries into the past, as
    Redis's clock sees them after it; the beat that comes first already
    reclaims where its own entry stayed renewed.
    """
    model, queue = f"model-{uuid.uuid4().hex}", f"queue-{uuid.uuid4().hex}"
    first = heartbeat(client, "first", model, interval_s=0.05)
    second = heartbeat(client, "second", model, interval_s=0.05)
    hold(client, "first", queue, ["one"])
    hold(client, "second", queue, ["two"])
    for _ in range(3):  # both have been live for longer than a TTL
        first.beat()
        second.beat()
        time.sleep(TTL_S / 2)

    stalled = redis_now(client) - 0.01
    client.zadd(keys.workers(model), {"first": stalled, "second": stalled})
    first.beat()  # the first beat after the pause
    time.sleep(TTL_S / 4)
    second.beat()
    first.beat()

    assert first.reclaimed == second.reclaimed == 0
    assert client.hlen(keys.taken("first")) == client.hlen(keys.taken("second")) == 1
    first.stop(timeout=1)
    second.stop(timeout=1)


def test_live_workers_never_reclaim_each_other(client: redis.Redis) -> None:
    model, queue = f"model-{uuid.uuid4().hex}", f"queue-{uuid.uuid4().hex}"
    first = heartbeat(client, "first", model, interval_s=0.05)
    second = heartbeat(client, "second", model, interval_s=0.05)
    first.start()
    second.start()
    try:
        hold(client, "first", queue, ["one"])
        hold(client, "second", queue, ["two"])
        time.sleep(4 * TTL_S)
        assert first.reclaimed == second.reclaimed == 0
        assert client.hlen(keys.taken("first")) == client.hlen(keys.taken("second")) == 1
        assert client.llen(queue) == 0
    finally:
        first.stop(timeout=5)
        second.stop(timeout=5)
    assert sorted(bodies_on(client, queue)) == ["one", "two"]  # handed back as each left


def test_a_restarted_worker_hands_back_what_its_predecessor_held(client: redis.Redis) -> None:
    """Same worker id, new process: the old one's jobs must not wait behind the new one's beats."""
    model, queue = f"model-{uuid.uuid4().hex}", f"queue-{uuid.uuid4().hex}"
    hold(client, "pod-0", queue, ["from-before"])
    restarted = heartbeat(client, "pod-0", model, interval_s=0.05)

    restarted.start()
    restarted.stop(timeout=5)

    assert bodies_on(client, queue) == ["from-before"]


def test_a_malformed_record_is_dropped_and_the_rest_still_go_back(client: redis.Redis) -> None:
    """One record not in the ``<wake>\\n<list>\\n<message>`` form must not hold up the others."""
    model, queue = f"model-{uuid.uuid4().hex}", f"queue-{uuid.uuid4().hex}"
    hold(client, "broken", queue, ["fine"])
    client.hset(keys.taken("broken"), "junk", "no newlines here")
    client.zadd(keys.workers(model), {"broken": redis_now(client) - 1})
    beat_until_reclaimed(client, "mender", model)

    assert bodies_on(client, queue) == ["fine"] and not client.exists(keys.taken("broken"))


def own_message(body: str, hand_back_at: float) -> str:
    headers = {REQUEST_HEADER: [body, "", hand_back_at]}
    return json.dumps({"properties": {"delivery_tag": body}, "headers": headers, "body": body})


def place(client: redis.Redis, model: str, worker_id: str, items: list[tuple[str, float]]) -> None:
    """Put jobs on ``worker_id``'s own queue as the API does, each with its wake token."""
    own = keys.own_queue(model, worker_id)
    for body, hand_back_at in items:
        client.lpush(own, own_message(body, hand_back_at))
        client.lpush(keys.queue_wake(own), "1")


def test_an_own_queue_job_past_its_hand_back_time_goes_to_the_shared_queue_s_head(
    client: redis.Redis,
) -> None:
    model, worker_id = f"model-{uuid.uuid4().hex}", "placed-on"
    shared = keys.queue_name(model)
    own = keys.own_queue(model, worker_id)
    client.lpush(shared, json.dumps({"body": "shared-queued"}))
    now = redis_now(client)
    place(client, model, worker_id, [("due-1", now - 2), ("due-2", now - 1), ("later", now + 60)])
    beats = heartbeat(client, worker_id, model, interval_s=0.05)

    beats.beat()

    assert bodies_on(client, shared) == ["due-1", "due-2", "shared-queued"]
    assert bodies_on(client, own) == ["later"] and client.llen(keys.queue_wake(own)) == 1
    assert client.llen(keys.queue_wake(shared)) == 2 and beats.handed_back == 2
    client.delete(keys.workers(model), keys.worker_loads(model), keys.workers_alive_since(model))
    client.delete(shared, own, keys.queue_wake(shared), keys.queue_wake(own))


def test_a_draining_worker_hands_back_its_whole_own_queue(client: redis.Redis) -> None:
    model, worker_id = f"model-{uuid.uuid4().hex}", "draining"
    shared, own = keys.queue_name(model), keys.own_queue(model, worker_id)
    later = redis_now(client) + 60
    place(client, model, worker_id, [("first", later), ("second", later)])
    identity = WorkerIdentity(worker_id, model)
    beats = Heartbeat(client, identity, lambda: SNAPSHOT, lambda: True, 0.05, TTL_S)

    beats.beat()

    assert bodies_on(client, shared) == ["first", "second"]
    assert not client.exists(own, keys.queue_wake(own))
    beats.stop(timeout=5)
    client.delete(shared, keys.queue_wake(shared))


def test_a_dead_worker_s_own_queue_and_held_jobs_go_to_the_shared_queue(
    client: redis.Redis,
) -> None:
    """What it took from its own queue goes back there, then on with the rest, first in line."""
    model, dead = f"model-{uuid.uuid4().hex}", "dead-placed"
    shared, own = keys.queue_name(model), keys.own_queue(model, dead)
    later = redis_now(client) + 60
    place(client, model, dead, [("held", later)])
    hold_messages = TAKE.bind(client)(
        keys=[keys.taken(dead), keys.queue_wake(own), own], args=[1, 1]
    )
    assert len(hold_messages[0]) == 2
    place(client, model, dead, [("waiting", later)])
    client.sadd(keys.cache_summary(dead), b"x" * 16)
    client.zadd(keys.workers(model), {dead: redis_now(client) - 1})
    client.lpush(shared, json.dumps({"body": "shared-queued"}))

    beat_until_reclaimed(client, "live-placed", model)

    assert bodies_on(client, shared) == ["held", "waiting", "shared-queued"]
    assert client.llen(keys.queue_wake(shared)) == 2
    assert not client.exists(own, keys.queue_wake(own), keys.taken(dead), keys.cache_summary(dead))
    client.delete(shared, keys.queue_wake(shared))


def test_leaving_hands_back_the_own_queue_and_deletes_the_summary(client: redis.Redis) -> None:
    model, worker_id = f"model-{uuid.uuid4().hex}", "leaving"
    shared, own = keys.queue_name(model), keys.own_queue(model, worker_id)
    place(client, model, worker_id, [("placed", redis_now(client) + 60)])
    client.sadd(keys.cache_summary(worker_id), b"y" * 16)
    bindings = [prefix + own for prefix in BINDING_PREFIXES]  # what kombu declared for it
    for binding in bindings:
        client.sadd(binding, f"{own}\x06\x16\x06\x16{own}")
    beats = heartbeat(client, worker_id, model, interval_s=0.05)
    beats.start()
    beats.stop(timeout=5)

    assert bodies_on(client, shared) == ["placed"]
    assert not client.exists(own, keys.queue_wake(own), keys.cache_summary(worker_id), *bindings)
    client.delete(shared, keys.queue_wake(shared))


def test_a_summary_redis_lost_is_written_again_whole(client: redis.Redis) -> None:
    model, worker_id = f"model-{uuid.uuid4().hex}", f"summarised-{uuid.uuid4().hex}"
    summary = CacheSummary(client, worker_id)
    summary.start()
    identity = WorkerIdentity(worker_id, model)
    beats = Heartbeat(client, identity, lambda: SNAPSHOT, lambda: False, 0.05, TTL_S, summary)
    try:
        summary.note(CacheChanges(added={1, 2, 3}))
        summary.note(CacheChanges(added={4}, dropped={2}))
        expected = {digest(h) for h in (1, 3, 4)}
        wait_until(lambda: client.smembers(summary.key) == expected, 5, "the summary written")
        assert 0 < client.ttl(summary.key) <= SUMMARY_TTL_S

        client.delete(summary.key)  # as after a Redis restart
        beats.beat()

        wait_until(lambda: client.smembers(summary.key) == expected, 5, "the summary rewritten")
        assert beats.report().cache_summary_size == 3
    finally:
        summary.stop(timeout=5)
        beats.stop(timeout=5)
