"""The cost of API keys and per-key rate limits per request, against a request without them.

    python -m bench.admission [--requests 20000] [--redis redis://127.0.0.1:6379/0]

Calls the authentication middleware in front of an app that answers at once,
with 100 keys configured and the request carrying the last one (every digest
is compared), beside the same app without the middleware; then a rate-limit
admission and its release on a key with all three limits, in memory
(embedded) and, with ``--redis``, through the Redis script (distributed).
Prints p50 and p99 per request in microseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid

from api.auth import Authentication, KeyRing, plain_key
from api.rate_limits import KeyLimits, MemoryRateLimiter, RedisRateLimiter

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
        from redis.asyncio import Redis

        redis = Redis.from_url(redis_url)
        shared = RedisRateLimiter(redis)
        key = f"bench-{uuid.uuid4().hex}"

        async def through_redis() -> None:
            await shared.acquire(key, limits, 600)
            await shared.release(key, limits, 300)

        rows.append(("rate limit, Redis", await _timed(through_redis, max(requests // 10, 100))))
        await redis.aclose()
    print(f"{'per request':<24}{'p50 us':>10}{'p99 us':>10}")
    for name, times in rows:
        ordered = sorted(times)
        p99 = ordered[min(int(len(ordered) * 0.99), len(ordered) - 1)]
        print(f"{name:<24}{statistics.median(times):>10.1f}{p99:>10.1f}")
    base = statistics.median(rows[0][1])
    added = statistics.median(rows[1][1]) - base + statistics.median(rows[2][1])
    print(
        f"\nadded by API key + rate limit, embedded, p50: {added:.1f} us "
        f"(goal <= {GOAL_US:.0f} us: {'met' if added <= GOAL_US else 'not met'})"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--redis", default=None, metavar="URL")
    args = parser.parse_args(argv)
    asyncio.run(run(args.requests, args.redis))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
