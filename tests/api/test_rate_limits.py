"""Per-key rate limits: the in-memory buckets and the Redis script agree, and Redis is exact.

Two limiters on two connections stand for two API replicas: a burst through
both never lets more through than the key allows.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
from redis.asyncio import Redis

from api.rate_limits import KeyLimits, MemoryRateLimiter, RedisRateLimiter

REDIS_URL = "redis://127.0.0.1:6379/0"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _key() -> str:
    return f"test-{uuid.uuid4().hex}"


async def _both(limiter_pairs):
    return [await limiter.acquire(*args) for limiter, args in limiter_pairs]


@pytest.mark.anyio
async def test_memory_and_redis_give_the_same_verdicts():
    limits = KeyLimits(requests_per_minute=3, tokens_per_minute=100, max_concurrent=2)
    redis = Redis.from_url(REDIS_URL)
    try:
        memory, shared = MemoryRateLimiter(), RedisRateLimiter(redis)
        key_m, key_r = _key(), _key()
        for tokens in (40, 40, 40, 10):
            m = await memory.acquire(key_m, limits, tokens)
            r = await shared.acquire(key_r, limits, tokens)
            assert (m.allowed, m.reason) == (r.allowed, r.reason), (tokens, m, r)
            assert m.remaining_requests == pytest.approx(r.remaining_requests, abs=0.05)
            assert m.remaining_tokens == pytest.approx(r.remaining_tokens, abs=1)
        # the third 40 is refused for tokens; the 10 for concurrency (two running)
        await memory.release(key_m, limits, 30)
        await shared.release(key_r, limits, 30)
        m = await memory.acquire(key_m, limits, 40)
        r = await shared.acquire(key_r, limits, 40)
        assert m.allowed and r.allowed  # a place and 30 unused tokens came back
    finally:
        await redis.aclose()


@pytest.mark.anyio
async def test_an_admission_without_a_concurrency_limit_holds_no_place():
    """An async job takes requests and tokens but none of the key's places at once."""
    held = KeyLimits(requests_per_minute=10, max_concurrent=1)
    placeless = KeyLimits(requests_per_minute=10)
    redis = Redis.from_url(REDIS_URL)
    try:
        for limiter in (MemoryRateLimiter(), RedisRateLimiter(redis)):
            key = _key()
            assert (await limiter.acquire(key, placeless, 0)).allowed
            assert (await limiter.acquire(key, held, 0)).allowed  # the job took no place
            refused = await limiter.acquire(key, held, 0)
            assert not refused.allowed and "1 requests at once" in refused.reason
            await limiter.release(key, placeless, 0)  # the job ends: the request keeps its place
            assert not (await limiter.acquire(key, held, 0)).allowed
            await limiter.release(key, held, 0)
            verdict = await limiter.acquire(key, held, 0)
            assert verdict.allowed  # three taken of ten; the refusals took none
            assert verdict.remaining_requests == pytest.approx(7, abs=0.05)
    finally:
        await redis.aclose()


@pytest.mark.anyio
async def test_two_replicas_share_one_limit_exactly():
    limits = KeyLimits(requests_per_minute=10)
    first, second = Redis.from_url(REDIS_URL), Redis.from_url(REDIS_URL)
    try:
        replicas = [RedisRateLimiter(first), RedisRateLimiter(second)]
        key = _key()
        verdicts = await asyncio.gather(
            *(replicas[i % 2].acquire(key, limits, 0) for i in range(40))
        )
        assert sum(v.allowed for v in verdicts) == 10
        refused = [v for v in verdicts if not v.allowed]
        assert all(4 < v.retry_after_s <= 6.1 for v in refused)  # one request per 6 s
        assert refused[0].headers(anthropic=False)["retry-after"] in ("5", "6", "7")
    finally:
        await first.aclose()
        await second.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("shared", [False, True])
async def test_a_request_bigger_than_the_token_limit_is_refused_for_good(shared: bool):
    """No wait lets it in, so its refusal says when to retry nowhere: a batch fails the line
    instead of waiting for a bucket that can never hold it."""
    redis = Redis.from_url(REDIS_URL)
    try:
        limiter = RedisRateLimiter(redis) if shared else MemoryRateLimiter()
        limits = KeyLimits(tokens_per_minute=100)
        verdict = await limiter.acquire(_key(), limits, 150)
        assert not verdict.allowed and "lower max_tokens" in verdict.reason
        assert verdict.retry_after_s is None
        assert not {"retry-after", "retry-after-ms"} & verdict.headers(anthropic=False).keys()
    finally:
        await redis.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("shared", [False, True])
async def test_a_share_given_back_whole_returns_its_request_too(shared: bool):
    """A refused batch of jobs spends none of its key's requests or tokens."""
    redis = Redis.from_url(REDIS_URL)
    try:
        limiter = RedisRateLimiter(redis) if shared else MemoryRateLimiter()
        key, limits = _key(), KeyLimits(requests_per_minute=2, tokens_per_minute=100)
        for _ in range(2):
            assert (await limiter.acquire(key, limits, 50)).allowed
        refused = await limiter.acquire(key, limits, 50)
        assert not refused.allowed and refused.retry_after_s > 0  # a wait does help here
        await limiter.release(key, limits, 50, unused_requests=1)  # one never ran
        again = await limiter.acquire(key, limits, 50)
        assert again.allowed
        assert again.remaining_requests == pytest.approx(0, abs=0.1)
    finally:
        await redis.aclose()


def test_the_headers_of_each_family():
    limiter = MemoryRateLimiter()
    limits = KeyLimits(requests_per_minute=60, tokens_per_minute=1000)
    verdict = asyncio.run(limiter.acquire(_key(), limits, 100))
    openai = verdict.headers(anthropic=False)
    assert openai["x-ratelimit-limit-requests"] == "60"
    assert openai["x-ratelimit-remaining-requests"] == "59"
    assert openai["x-ratelimit-remaining-tokens"] == "900"
    assert openai["x-ratelimit-reset-tokens"].endswith("s")
    anthropic = verdict.headers(anthropic=True)
    assert anthropic["anthropic-ratelimit-tokens-remaining"] == "900"
    assert anthropic["anthropic-ratelimit-requests-reset"].endswith("+00:00")
    assert "retry-after" not in openai
