"""The errors a failed store round trip raises, without importing a store client.

Embedded mode keeps jobs and batches in process memory and never loads the
Redis client (about 7 MiB resident); distributed mode has loaded it before
its first round trip. So the tuple holds ``RedisError`` exactly when
``redis`` is loaded, and an ``except store_errors()`` clause written once
serves both modes.
"""

from __future__ import annotations

import sys


def store_errors() -> tuple[type[Exception], ...]:
    """``OSError``, and ``redis.exceptions.RedisError`` once the Redis client is loaded."""
    redis_exceptions = sys.modules.get("redis.exceptions")
    if redis_exceptions is None:
        return (OSError,)
    return (OSError, redis_exceptions.RedisError)


def store_unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` is the Redis client's: the shared store failed, not the request."""
    redis_exceptions = sys.modules.get("redis.exceptions")
    return redis_exceptions is not None and isinstance(exc, redis_exceptions.RedisError)
