"""What one hop through Redis costs on this machine when the process it wakes is idle.

A listener process blocks in ``BRPOP``; the caller pushes its monotonic
clock every ``GAP_S``, long enough for the listener (and its CPU) to go
idle, and the listener notes how long each push took to return its read.
No Sluice code runs on that path: it is the cheapest that a hop of the
distributed path can be when it wakes a process waiting for work, as a
worker waits for its next job and Redis, with the API and the client
waiting too, for a worker's first event. Beside it, the caller's ``PING``
while it keeps its CPU busy: the same round trip without the wake-up.

``python -m bench.queue`` prints both beside its figures (see its
docstring for how many such wake-ups the distributed path adds). The
listener runs as ``python -m bench.wakeup URL ROUNDS`` and prints its
latencies and CPUs as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass

import redis

GAP_S = 0.01
KEY = "sluice:bench:wakeup"
READY_KEY = "sluice:bench:wakeup:ready"
LISTEN_TIMEOUT_S = 30


@dataclass(frozen=True, slots=True)
class WakeFloor:
    wake_s: list[float]  # push -> BRPOP returned in the idle listener, one per round
    ping_s: list[float]  # a busy caller's PING round trips
    listener_cpus: list[int]  # where the listener ran


def measure(redis_url: str, listener_cpus: set[int] | None = None, rounds: int = 200) -> WakeFloor:
    """``rounds`` wake-ups of a listener on ``listener_cpus``, and as many busy ``PING``s."""
    client = redis.Redis.from_url(redis_url, socket_timeout=LISTEN_TIMEOUT_S)
    client.delete(KEY, READY_KEY)
    pin = (lambda: os.sched_setaffinity(0, listener_cpus)) if listener_cpus else None
    listener = subprocess.Popen(
        [sys.executable, "-m", "bench.wakeup", redis_url, str(rounds)],
        stdout=subprocess.PIPE,
        preexec_fn=pin,
    )
    try:
        if client.brpop([READY_KEY], LISTEN_TIMEOUT_S) is None:
            raise RuntimeError("the wake-up listener did not start")
        for _ in range(rounds):
            time.sleep(GAP_S)
            client.lpush(KEY, time.monotonic_ns())
        output, _ = listener.communicate(timeout=LISTEN_TIMEOUT_S)
    finally:
        if listener.poll() is None:
            listener.kill()
            listener.wait()
    heard = json.loads(output)
    return WakeFloor(heard["wake_s"], _busy_pings(client, rounds), heard["cpus"])


def _busy_pings(client: redis.Redis, rounds: int) -> list[float]:
    timings = []
    for _ in range(rounds):
        started = time.perf_counter()
        client.ping()
        timings.append(time.perf_counter() - started)
    return timings


def listen(redis_url: str, rounds: int) -> dict[str, list]:
    """Block in ``BRPOP`` ``rounds`` times: how long after each push the read returned."""
    client = redis.Redis.from_url(redis_url, socket_timeout=LISTEN_TIMEOUT_S + 5)
    client.lpush(READY_KEY, "1")
    latencies = []
    for _ in range(rounds):
        reply = client.brpop([KEY], LISTEN_TIMEOUT_S)
        if reply is None:
            break
        latencies.append((time.monotonic_ns() - int(reply[1])) / 1e9)
    return {"wake_s": latencies, "cpus": sorted(os.sched_getaffinity(0))}


if __name__ == "__main__":
    print(json.dumps(listen(sys.argv[1], int(sys.argv[2]))))
