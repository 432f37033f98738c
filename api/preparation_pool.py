"""Where preparation's CPU work runs: a few threads, a bounded queue, a deadline per step.

Rendering, tokenizing and checking a grammar hold a thread for milliseconds, a
pathological prompt for seconds. The pool runs at most ``threads`` of them at
once and lets at most ``max_waiting`` more wait; one more is a 503 at once, so
overload shows as a quick refusal instead of a growing queue. A step that has
not finished ``timeout_s`` after it was submitted (waiting included) is a 503
too: its caller is answered then, while the thread finishes the step and its
result is dropped. The pool's size counts that thread until it is free, so an
abandoned step never lets more than ``threads`` run at once.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from api.errors import ApiError

T = TypeVar("T")

DEFAULT_PREPARE_TIMEOUT_S = 30.0
DEFAULT_MAX_WAITING = 256


class PreparationPool:
    """Runs preparation steps off the event loop, ``threads`` at a time, under a deadline."""

    def __init__(
        self,
        threads: int,
        max_waiting: int = DEFAULT_MAX_WAITING,
        timeout_s: float = DEFAULT_PREPARE_TIMEOUT_S,
    ) -> None:
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="prepare")
        self._capacity = threads + max_waiting
        self._pending = 0  # submitted and not finished: running, waiting or abandoned
        self._lock = threading.Lock()  # steps finish on their own threads
        self.timeout_s = timeout_s

    @property
    def pending(self) -> int:
        """Steps submitted and not yet finished (running, waiting, or abandoned and running)."""
        return self._pending

    async def run(self, function: Callable[..., T], *args: Any) -> T:
        """``function(*args)`` on a pool thread; a 503 if the queue is full or the step too slow."""
        if self._pending >= self._capacity:
            raise _overloaded(
                f"The server is preparing {self._pending} requests, its most; retry shortly."
            )
        context = contextvars.copy_context()  # the caller's request id reaches the step's logs
        with self._lock:
            self._pending += 1
        future: Future[T] = self._executor.submit(context.run, function, *args)
        future.add_done_callback(self._finished)
        try:
            # On timeout the wrapper is cancelled, which cancels a step still queued.
            async with asyncio.timeout(self.timeout_s):
                return await asyncio.wrap_future(future)
        except TimeoutError:
            raise _overloaded(
                f"Preparing the request took longer than {self.timeout_s:g}s "
                "(the prepare timeout); retry shortly."
            ) from None

    def _finished(self, _: Future) -> None:
        with self._lock:
            self._pending -= 1

    def close(self) -> None:
        """Stop taking steps; steps already running finish on their threads."""
        self._executor.shutdown(wait=False, cancel_futures=True)


def _overloaded(message: str) -> ApiError:
    return ApiError(503, message, "overloaded_error", headers={"Retry-After": "1"})
