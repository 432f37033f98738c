"""``bench.wakeup``: the floor ``bench.queue`` prints, measured through a real Redis."""

from __future__ import annotations

import os

from bench.wakeup import KEY, measure
from tests.distributed.conftest import RedisServer


def test_every_push_wakes_the_listener_and_is_timed(redis_server: RedisServer) -> None:
    floor = measure(redis_server.url, rounds=20)
    assert len(floor.wake_s) == 20 and len(floor.ping_s) == 20
    assert all(0 < latency < 1 for latency in floor.wake_s)
    assert all(0 < rtt < 1 for rtt in floor.ping_s)
    assert redis_server.client.llen(KEY) == 0  # every push was read


def test_the_listener_runs_on_the_cpus_it_is_given(redis_server: RedisServer) -> None:
    cpu = max(os.sched_getaffinity(0))
    floor = measure(redis_server.url, {cpu}, rounds=5)
    assert floor.listener_cpus == [cpu]
    assert len(floor.wake_s) == 5
