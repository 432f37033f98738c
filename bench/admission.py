"""The cost of API keys and per-key rate limits per request, against a request without them.

    python -m bench.admission [--requests 20000] [--redis redis://127.0.0.1:6379/0]

Calls the authentication middleware in front of an app that answers at once,
with 100 keys configured and the request carrying the last one (every digest
is compared), beside the same app without the middleware; then a rate-limit
admission and its release on a key with all three limits, in memory
(embedded). With ``--redis`` (distributed): the standalone Redis admission
and release (what an async job takes), and a request's submission to its
model's queue with and without a key's share, interleaved: the share rides
on the submission's one round trip. Prints p50 and p99 per request in
microseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid

from api.auth import Authentication, KeyRing, plain_key
from api.rate_limits import KeyLimits, KeyShare, MemoryRateLimiter, RedisRateLimiter

GOAL_US = 200.0  # auth + rate limit, embedded, p50


async def _answer(scope, receive, send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})


async def _sink(message) -> None:
    return None


def _scope(key: str) -> dict:
    headers = [(b"authorization", f"Bearer {key}".encode()), (b"content-type", b"application/json")]
    return {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": headers}


async def _timed(call, count: int) -> list[float]:
    times = []
    for _ in range(count):
        started = time.perf_counter()
        await call()
        times.append((time.perf_counter() - started) * 1e6)
    return times


async def run(requests: int, redis_url: str | None) -> None:
    plain = [f"sk-bench-{i}" for i in range(100)]
    guarded = Authentication(_answer, KeyRing([plain_key(key) for key in plain]))
    scope = _scope(plain[-1])
    rows = [
        ("no key check", await _timed(lambda: _answer(dict(scope), None, _sink), requests)),
        ("API key (100 keys)", await _timed(lambda: guarded(dict(scope), None, _sink), requests)),
    ]
    limits = KeyLimits(requests_per_minute=10**9, tokens_per_minute=10**12, max_concurrent=10**6)
    memory = MemoryRateLimiter()

    async def admit_and_release(limiter) -> None:
        await limiter.acquire("bench", limits, 600)
        await limiter.release("bench", limits, 300)

    rows.append(("rate limit, memory", await _timed(lambda: admit_and_release(memory), requests)))
    if redis_url:
        rows += await _redis_rows(redis_url, limits, max(requests // 10, 200))
    print(f"{'per request':<34}{'p50 us':>10}{'p99 us':>10}")
    for name, times in rows:
        ordered = sorted(times)
        p99 = ordered[min(int(len(ordered) * 0.99), len(ordered) - 1)]
        print(f"{name:<34}{statistics.median(times):>10.1f}{p99:>10.1f}")
    base = statistics.median(rows[0][1])
    added = statistics.median(rows[1][1]) - base + statistics.median(rows[2][1])
    print(
        f"\nadded by API key + rate limit, embedded, p50: {added:.1f} us "
        f"(goal <= {GOAL_US:.0f} us: {'met' if added <= GOAL_US else 'not met'})"
    )
    if redis_url:
        times = dict(rows)
        shared = statistics.median(times[SUBMIT_SHARE]) - statistics.median(times[SUBMIT])
        print(f"added by a key's share to a distributed submission, p50: {shared:.1f} us "
              "(no round trip of its own)")  # fmt: skip


SUBMIT = "submit, no key"
SUBMIT_SHARE = "submit with a key's share"


async def _redis_rows(url: str, limits: KeyLimits, count: int) -> list[tuple[str, list[float]]]:
    """The standalone admission and release, and submissions with and without a share."""
    from redis.asyncio import Redis

    from api.backends.request_queue import RequestQueue
    from shared import keys
    from shared.sampling import SamplingParams
    from shared.wire import Deadlines, PreparedRequest, QueuedRequest

    redis = Redis.from_url(url, decode_responses=True)
    limiter, queue = RedisRateLimiter(redis), RequestQueue(redis)
    key, model = f"bench-{uuid.uuid4().hex}", f"bench-admission-{uuid.uuid4().hex}"
    share = KeyShare(key, limits, 600)

    async def standalone() -> None:
        await limiter.acquire(key, limits, 600)
        await limiter.release(key, limits, 300)

    def job() -> QueuedRequest:
        request = PreparedRequest(uuid.uuid4().hex, model, [1, 2, 3], SamplingParams(max_tokens=4))
        return QueuedRequest(request, Deadlines(total=time.time() + 600))

    written: set[str] = {keys.inflight(model), *share.script_keys}

    async def submit(with_share: bool) -> None:
        one = job()
        done = await queue.put(one, one.deadlines.total, 10**9, share=share if with_share else None)
        if done.message is not None:
            written.update((done.message.key, done.message.wake))

    rows = [("rate limit, Redis (acquire+release)", await _timed(standalone, count))]
    plain: list[float] = []
    rated: list[float] = []
    for _ in range(count):  # interleaved: the machine's drift falls on both alike
        plain += await _timed(lambda: submit(False), 1)
        rated += await _timed(lambda: submit(True), 1)
    rows += [(SUBMIT, plain), (SUBMIT_SHARE, rated)]
    await redis.delete(*written)
    await redis.aclose()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--redis", default=None, metavar="URL")
    args = parser.parse_args(argv)
    asyncio.run(run(args.requests, args.redis))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
