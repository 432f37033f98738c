"""The admission bound under a burst: one shared count, and no overshoot."""

from __future__ import annotations

import asyncio

from api.admission import Admission, FleetSnapshot, Limits, WorkerLoad
from api.errors import ApiError

LIVE = FleetSnapshot(workers=(WorkerLoad("w1", "m", capacity=8),), taken_at=1.0)


def test_a_burst_shares_the_count_and_stays_within_the_bound() -> None:
    async def main() -> tuple[int, list[str], int]:
        queries = 0

        async def outstanding() -> int:  # what Redis's in-flight set would hold
            nonlocal queries
            queries += 1
            await asyncio.sleep(0.01)
            return 2

        admission = Admission(Limits(max_inflight=5), lambda: LIVE, outstanding)
        release = asyncio.Event()

        async def request() -> str:
            try:
                async with admission.admit():
                    await release.wait()  # still preparing when the others are admitted
                    return "admitted"
            except ApiError as error:
                return str(error.status)

        burst = [asyncio.create_task(request()) for _ in range(10)]
        await asyncio.sleep(0.05)
        release.set()
        outcomes = await asyncio.gather(*burst)
        return queries, outcomes, admission._pending

    queries, outcomes, pending = asyncio.run(main())
    assert queries == 1
    assert outcomes.count("admitted") == 3  # 2 outstanding + 3 = the bound of 5
    assert outcomes.count("429") == 7
    assert pending == 0


def test_a_failed_count_fails_every_waiter_and_the_next_one_asks_again() -> None:
    async def main() -> tuple[list[str], int]:
        calls = 0

        async def outstanding() -> int:
            nonlocal calls
            calls += 1
            await asyncio.sleep(0.01)
            if calls == 1:
                raise ApiError(503, "Redis is unreachable", "overloaded_error")
            return 0

        admission = Admission(Limits(max_inflight=5), lambda: LIVE, outstanding)

        async def request() -> str:
            try:
                async with admission.admit():
                    return "admitted"
            except ApiError as error:
                return str(error.status)

        first = await asyncio.gather(*(request() for _ in range(3)))
        return [*first, await request()], calls

    outcomes, calls = asyncio.run(main())
    assert outcomes == ["503", "503", "503", "admitted"]
    assert calls == 2
