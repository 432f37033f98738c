"""The preparation pool: a bounded queue, a deadline per step, and a bound that holds after it."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from api.errors import ApiError
from api.preparation_pool import PreparationPool


def _blocked(gate: threading.Event, running: list[int]) -> str:
    running.append(1)
    gate.wait(10)
    running.pop()
    return "done"


def test_a_step_runs_off_the_loop_and_returns_its_result() -> None:
    async def scene() -> tuple[str, bool]:
        pool = PreparationPool(threads=2)
        loop_thread = threading.get_ident()
        on_other = await pool.run(lambda: threading.get_ident() != loop_thread)
        return await pool.run(str.upper, "ok"), on_other

    assert asyncio.run(scene()) == ("OK", True)


def test_a_full_queue_is_a_503_at_once() -> None:
    async def scene() -> tuple[ApiError, float, str]:
        pool = PreparationPool(threads=1, max_waiting=1)
        gate, running = threading.Event(), []
        first = asyncio.create_task(pool.run(_blocked, gate, running))
        second = asyncio.create_task(pool.run(_blocked, gate, running))
        await asyncio.sleep(0.1)
        started = time.monotonic()
        with pytest.raises(ApiError) as refused:
            await pool.run(str.upper, "third")
        refused_s = time.monotonic() - started
        gate.set()
        await asyncio.gather(first, second)
        return refused.value, refused_s, await pool.run(str.upper, "after")

    error, seconds, after = asyncio.run(scene())
    assert error.status == 503 and error.headers == {"Retry-After": "1"}
    assert "preparing 2 requests" in error.message
    assert seconds < 0.05 and after == "AFTER"


def test_a_slow_step_is_a_503_at_its_deadline_and_still_holds_its_thread() -> None:
    async def scene() -> None:
        pool = PreparationPool(threads=1, max_waiting=0, timeout_s=0.2)
        gate, running = threading.Event(), []
        started = time.monotonic()
        with pytest.raises(ApiError) as late:
            await pool.run(_blocked, gate, running)
        assert 0.2 <= time.monotonic() - started < 1.0
        assert late.value.status == 503 and "prepare timeout" in late.value.message
        # The abandoned step still runs: it counts against the bound until it ends.
        assert running == [1] and pool.pending == 1
        with pytest.raises(ApiError, match="preparing 1 requests"):
            await pool.run(str.upper, "refused")
        gate.set()
        for _ in range(100):
            if pool.pending == 0:
                break
            await asyncio.sleep(0.01)
        assert pool.pending == 0 and await pool.run(str.upper, "x") == "X"

    asyncio.run(scene())


def test_a_step_that_waited_past_its_deadline_never_runs() -> None:
    async def scene() -> list[str]:
        pool = PreparationPool(threads=1, max_waiting=4, timeout_s=0.2)
        gate, running, ran = threading.Event(), [], []
        first = asyncio.create_task(pool.run(_blocked, gate, running))
        await asyncio.sleep(0.05)
        with pytest.raises(ApiError):
            await pool.run(ran.append, "queued")  # waits behind the first, past its deadline
        gate.set()
        with pytest.raises(ApiError):
            await first
        await asyncio.sleep(0.1)
        return ran

    assert asyncio.run(scene()) == []
