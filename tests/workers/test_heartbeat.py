"""Heartbeats: the worker's load in a key with a short TTL, gone on a clean stop."""

from __future__ import annotations

import time

import redis

from shared import keys
from shared.registry import DEFAULT_MODEL
from shared.sampling import SamplingParams
from tests.workers.conftest import (
    CAPACITY,
    KV_BLOCKS,
    MAX_MODEL_LEN,
    WORKER_ID,
    Producer,
    wait_until,
)
from workers.heartbeat import Heartbeat, WorkerIdentity
from workers.host import HostSnapshot
from workers.runtime import WorkerRuntime

FIELDS = {
    "worker_id", "model", "running", "waiting", "kv_blocks_used", "kv_blocks_total",
    "tokens_per_s", "capacity", "max_model_len", "steps", "generated_tokens", "aborted",
    "draining", "ts",
}  # fmt: skip


def test_heartbeat_reports_the_load_with_a_short_ttl(
    worker: WorkerRuntime, producer: Producer, client: redis.Redis
) -> None:
    key = keys.heartbeat(DEFAULT_MODEL, WORKER_ID)
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
    assert 0 < client.ttl(key) <= keys.HEARTBEAT_TTL_S


def test_a_stopped_heartbeat_deletes_its_key(client: redis.Redis) -> None:
    identity = WorkerIdentity("short-lived", DEFAULT_MODEL)
    snapshot = HostSnapshot(capacity=2, max_model_len=64, kv_blocks_total=8, running=1)
    heartbeat = Heartbeat(client, identity, lambda: snapshot, lambda: True, interval_s=0.05)
    key = keys.heartbeat(DEFAULT_MODEL, "short-lived")

    heartbeat.start()
    wait_until(lambda: client.exists(key), 5, "the first beat")
    assert heartbeat.report()["running"] == 1 and heartbeat.report()["draining"] is True
    heartbeat.stop(timeout=5)

    assert not client.exists(key)
