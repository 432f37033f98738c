"""Per-key rate limits: requests and tokens per minute, and requests at once.

Each per-minute limit is a bucket that holds at most a minute's allowance and
refills continuously at that rate, so a client refused now is told to the
millisecond when it may retry (``Retry-After``) instead of waiting for a
window to turn over. A request takes one request and its token reservation
(prompt tokens plus the resolved ``max_tokens``) at admission, and gives back
what it did not use when it ends; it holds one of the key's concurrent places
until then. Under limits without ``max_concurrent`` nothing counts places: an
async job, which holds no connection, is limited that way. In embedded mode
the buckets live in this process; with Redis one script per admission checks
and takes from all three at once, so any number of API replicas share a key's
limits exactly. A request's share (``KeyShare``) is taken by the script that
queues it (``api.backends.request_queue``), which runs the same checks
(``rate_limit.lua``), so it costs no round trip of its own; an async job's is
taken on its own before its batch is queued.

Refusals and admissions carry the headers clients read: OpenAI's
``x-ratelimit-{limit,remaining,reset}-{requests,tokens}`` and, on
``/v1/messages``, Anthropic's ``anthropic-ratelimit-{requests,tokens}-*``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Protocol

from api.errors import ApiError
from shared import keys, lua

if TYPE_CHECKING:
    from redis.asyncio import Redis

MINUTE_S = 60.0
CONCURRENCY_TTL_S = 3600  # a concurrent place whose release was lost frees itself after this

RATE_LIMIT = lua.load("api", "rate_limit")  # defines rate_acquire() for the scripts that admit
_ACQUIRE = lua.load("api", "rate_acquire", RATE_LIMIT)
_RELEASE = lua.load("api", "rate_release")


@dataclass(frozen=True, slots=True)
class KeyLimits:
    """A key's limits; None is unlimited."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None

    @property
    def any(self) -> bool:
        return any(
            v is not None
            for v in (self.requests_per_minute, self.tokens_per_minute, self.max_concurrent)
        )


@dataclass(slots=True)
class Verdict:
    """One admission's outcome, with what is left of each limit (None: no such limit).

    ``retry_after_s`` is None on a refusal no wait can lift (a request larger than a
    minute's tokens): it carries no ``Retry-After``, so no client or batch waits for it.
    """

    allowed: bool
    retry_after_s: float | None = 0.0
    limits: KeyLimits = field(default_factory=KeyLimits)
    remaining_requests: float | None = None
    remaining_tokens: float | None = None
    reason: str = ""

    def headers(self, anthropic: bool) -> dict[str, str]:
        """The rate-limit headers of the protocol's family."""
        out: dict[str, str] = {}
        now = time.time()
        for kind, limit, remaining in (
            ("requests", self.limits.requests_per_minute, self.remaining_requests),
            ("tokens", self.limits.tokens_per_minute, self.remaining_tokens),
        ):
            if limit is None or remaining is None:
                continue
            left = max(int(remaining), 0)
            full_in = (limit - max(remaining, 0.0)) * MINUTE_S / limit  # until the bucket is full
            if anthropic:
                out[f"anthropic-ratelimit-{kind}-limit"] = str(limit)
                out[f"anthropic-ratelimit-{kind}-remaining"] = str(left)
                reset = datetime.fromtimestamp(now + full_in, UTC)
                out[f"anthropic-ratelimit-{kind}-reset"] = reset.isoformat(timespec="seconds")
            else:
                out[f"x-ratelimit-limit-{kind}"] = str(limit)
                out[f"x-ratelimit-remaining-{kind}"] = str(left)
                out[f"x-ratelimit-reset-{kind}"] = _duration(full_in)
        if not self.allowed and self.retry_after_s is not None:
            out["retry-after"] = str(max(math.ceil(self.retry_after_s), 1))
            out["retry-after-ms"] = str(max(math.ceil(self.retry_after_s * 1000), 1))
        return out


class RateLimiter(Protocol):
    async def acquire(self, key: str, limits: KeyLimits, tokens: int) -> Verdict:
        """Take one request, ``tokens`` tokens and a concurrent place, or refuse."""
        ...

    async def release(
        self, key: str, limits: KeyLimits, unused_tokens: int, unused_requests: int = 0
    ) -> None:
        """The request ended: give back its place and the tokens it reserved but did not use
        (and its request, ``unused_requests`` 1, when it never ran)."""
        ...


class MemoryRateLimiter:
    """This process's buckets (embedded mode)."""

    def __init__(self) -> None:
        self._buckets: dict[tuple[str, str], tuple[float, float]] = {}  # level, at
        self._running: dict[str, int] = {}

    async def acquire(self, key: str, limits: KeyLimits, tokens: int) -> Verdict:
        now = time.monotonic()
        requests = self._level(key, "requests", limits.requests_per_minute, now)
        token_level = self._level(key, "tokens", limits.tokens_per_minute, now)
        running = self._running.get(key, 0)
        verdict = _judge(limits, requests, token_level, running, tokens)
        if verdict.allowed:  # take, and report what is left after
            if requests is not None:
                verdict.remaining_requests = requests - 1
                self._buckets[(key, "requests")] = (requests - 1, now)
            if token_level is not None:
                verdict.remaining_tokens = token_level - tokens
                self._buckets[(key, "tokens")] = (token_level - tokens, now)
            if limits.max_concurrent is not None:
                self._running[key] = running + 1
        return verdict

    async def release(
        self, key: str, limits: KeyLimits, unused_tokens: int, unused_requests: int = 0
    ) -> None:
        if limits.max_concurrent is not None:
            self._running[key] = max(self._running.get(key, 0) - 1, 0)
        self._refill(key, "tokens", limits.tokens_per_minute, unused_tokens)
        self._refill(key, "requests", limits.requests_per_minute, unused_requests)

    def _refill(self, key: str, kind: str, limit: int | None, amount: int) -> None:
        if limit is None or amount <= 0:
            return
        now = time.monotonic()
        level = self._level(key, kind, limit, now)
        assert level is not None
        self._buckets[(key, kind)] = (min(level + amount, limit), now)

    def _level(self, key: str, kind: str, limit: int | None, now: float) -> float | None:
        if limit is None:
            return None
        level, at = self._buckets.get((key, kind), (float(limit), now))
        return min(level + (now - at) * limit / MINUTE_S, float(limit))


class RedisRateLimiter:
    """Buckets in Redis, shared by every API replica; one script per admission.

    The request queue's submit script runs the same checks (``RATE_LIMIT``, its prelude)
    for a request whose share rides on its submission.
    """

    def __init__(self, redis: Redis) -> None:
        self._redis = redis
        self._acquire = _ACQUIRE.bind(redis)
        self._release = _RELEASE.bind(redis)

    async def acquire(self, key: str, limits: KeyLimits, tokens: int) -> Verdict:
        share = KeyShare(key, limits, tokens)
        return share.verdict(await self._acquire(keys=share.script_keys, args=share.script_args))

    async def release(
        self, key: str, limits: KeyLimits, unused_tokens: int, unused_requests: int = 0
    ) -> None:
        await self._release(
            keys=_keys(key),
            args=[
                _arg(limits.tokens_per_minute),
                max(unused_tokens, 0),
                MINUTE_S,
                _arg(limits.max_concurrent),
                _arg(limits.requests_per_minute),
                max(unused_requests, 0),
            ],
        )


@dataclass(frozen=True, slots=True)
class KeyShare:
    """What one request takes of its key's limits: a request, ``tokens`` tokens and, under a
    ``max_concurrent`` limit, a place; as the Redis scripts (``rate_acquire``) read it.
    """

    key: str
    limits: KeyLimits
    tokens: int

    @property
    def script_keys(self) -> list[str]:
        return _keys(self.key)

    @property
    def script_args(self) -> list[int | float]:
        limits = self.limits
        return [
            _arg(limits.requests_per_minute),
            _arg(limits.tokens_per_minute),
            _arg(limits.max_concurrent),
            self.tokens,
            MINUTE_S,
            CONCURRENCY_TTL_S,
        ]

    def verdict(self, reply: list) -> Verdict:
        """The verdict in ``rate_acquire``'s reply: allowed, requests, tokens, retry, reason."""
        allowed, requests, token_level, retry_after, reason = reply
        limits = self.limits
        return Verdict(
            bool(int(allowed)),
            None if float(retry_after) < 0 else float(retry_after),
            limits,
            None if limits.requests_per_minute is None else float(requests),
            None if limits.tokens_per_minute is None else float(token_level),
            reason.decode() if isinstance(reason, bytes) else str(reason),
        )


class RateLimitTicket:
    """A request's share of its key's limits: taken at admission, the unused part given back
    at its end (``release``), and the headers to answer with (``headers``).
    """

    def __init__(self, limiter: RateLimiter, share: KeyShare, anthropic: bool) -> None:
        self._limiter, self._anthropic = limiter, anthropic
        self.share = share
        self.headers: dict[str, str] = {}
        self.taken = False  # a share never taken (refused, or never submitted) is not given back

    @property
    def reserved(self) -> int:
        """Tokens taken at admission: the prompt and the resolved ``max_tokens``."""
        return self.share.tokens

    def take(self, verdict: Verdict) -> None:
        """Record the admission's verdict: a 429 with the rate-limit headers if it refused."""
        self.headers = verdict.headers(self._anthropic)
        self.taken = verdict.allowed
        if not verdict.allowed:
            raise ApiError(
                429, verdict.reason, "rate_limit_exceeded", None, "rate_limit_exceeded",
                self.headers,
            )  # fmt: skip

    async def release(self, used_tokens: int) -> None:
        if not self.taken:
            return
        self.taken = False
        share = self.share
        await self._limiter.release(share.key, share.limits, share.tokens - used_tokens)

    async def give_back(self) -> None:
        """The request never ran (its batch was refused): all of the share goes back, the
        request itself included."""
        if not self.taken:
            return
        self.taken = False
        share = self.share
        await self._limiter.release(share.key, share.limits, share.tokens, unused_requests=1)


def _judge(
    limits: KeyLimits,
    requests: float | None,
    tokens_level: float | None,
    running: int,
    tokens: int,
) -> Verdict:
    """The verdict on levels already refilled to now; the Redis script mirrors it."""
    verdict = Verdict(True, 0.0, limits, requests, tokens_level)
    if limits.tokens_per_minute is not None and tokens > limits.tokens_per_minute:
        verdict.allowed, verdict.retry_after_s = False, None
        verdict.reason = (
            f"this request needs {tokens} tokens (prompt and max_tokens), more than the key's "
            f"{limits.tokens_per_minute} tokens per minute; lower max_tokens"
        )
        return verdict
    waits: list[tuple[float, str]] = []
    if requests is not None and limits.requests_per_minute is not None and requests < 1:
        rate = limits.requests_per_minute / MINUTE_S
        waits.append(((1 - requests) / rate, f"{limits.requests_per_minute} requests per minute"))
    if tokens_level is not None and limits.tokens_per_minute is not None and tokens_level < tokens:
        rate = limits.tokens_per_minute / MINUTE_S
        waits.append(
            ((tokens - tokens_level) / rate, f"{limits.tokens_per_minute} tokens per minute")
        )
    if limits.max_concurrent is not None and running >= limits.max_concurrent:
        waits.append((1.0, f"{limits.max_concurrent} requests at once"))
    if waits:
        wait, what = max(waits)
        verdict.allowed, verdict.retry_after_s = False, wait
        verdict.reason = f"rate limit reached: this key may make {what}"
    return verdict


def _keys(key: str) -> list[str]:
    return [
        keys.rate_bucket(key, "requests"),
        keys.rate_bucket(key, "tokens"),
        keys.rate_running(key),
    ]


def _arg(limit: int | None) -> int:
    return -1 if limit is None else limit


def _duration(seconds: float) -> str:
    """OpenAI's spelling of a reset time: ``1m30s``, ``2.5s``, ``120ms``."""
    if seconds < 1:
        return f"{max(int(seconds * 1000), 0)}ms"
    minutes, rest = divmod(seconds, 60)
    return f"{int(minutes)}m{rest:.0f}s" if minutes else f"{rest:.3g}s"
