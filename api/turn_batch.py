"""Batching for the event loop: the calls of one loop turn share one round trip.

Queueing a job (its place in the in-flight set, and its message) sits on a
burst's path to its first token. Each call joins the batch of
the current turn; the batch runs on the next turn, while the loop goes on,
so batches never wait for one another's replies (a busy loop reads those
late).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")


class TurnBatcher(Generic[Item, Result]):
    """``put(item)`` is settled with ``run_batch([..., item, ...])``'s answer for it.

    ``run_batch`` returns one result per item, in order; if it raises, every
    future of that batch gets the exception.
    """

    def __init__(self, run_batch: Callable[[list[Item]], Awaitable[Sequence[Result]]]) -> None:
        self._run_batch = run_batch
        self._pending: list[tuple[Item, asyncio.Future[Result]]] = []
        self._batches: set[asyncio.Task[None]] = set()

    def put(self, item: Item) -> asyncio.Future[Result]:
        """Join this turn's batch; await the future (shielded, if the caller may leave)."""
        future: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        self._pending.append((item, future))
        if len(self._pending) == 1:  # the first of this turn: run them all next turn
            batch = asyncio.create_task(self._run())
            self._batches.add(batch)
            batch.add_done_callback(self._batches.discard)
        return future

    async def _run(self) -> None:
        batch, self._pending = self._pending, []
        try:
            results = await self._run_batch([item for item, _ in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"{len(results)} results for a batch of {len(batch)}")
        except Exception as exc:  # every caller of the batch hears it; the next batch tries again
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
        else:
            for (_, future), result in zip(batch, results, strict=True):
                if not future.done():
                    future.set_result(result)
