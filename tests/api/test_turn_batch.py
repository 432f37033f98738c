"""The calls of one event-loop turn share a batch; batches never wait for one another."""

from __future__ import annotations

import asyncio

import pytest

from api.turn_batch import TurnBatcher


def test_one_turn_is_one_batch_and_the_next_turn_does_not_wait_for_it() -> None:
    async def main() -> tuple[list[list[int]], list[int]]:
        batches: list[list[int]] = []
        release = asyncio.Event()

        async def run(items: list[int]) -> list[int]:
            batches.append(items)
            if items[0] == 0:
                await release.wait()  # the first batch's reply is slow
            return [item * 10 for item in items]

        batcher: TurnBatcher[int, int] = TurnBatcher(run)
        first = [batcher.put(item) for item in range(3)]
        await asyncio.sleep(0)
        second = [batcher.put(item) for item in range(3, 5)]
        late = await asyncio.gather(*second)  # answered while the first batch is still out
        release.set()
        return batches, [*await asyncio.gather(*first), *late]

    batches, results = asyncio.run(main())
    assert batches == [[0, 1, 2], [3, 4]]
    assert results == [0, 10, 20, 30, 40]


def test_a_failed_or_short_batch_fails_its_callers() -> None:
    async def main() -> None:
        batcher: TurnBatcher[int, int] = TurnBatcher(lambda items: _answer([]))
        with pytest.raises(RuntimeError, match="0 results for a batch of 2"):
            await asyncio.gather(batcher.put(1), batcher.put(2))

    asyncio.run(main())


async def _answer(results: list[int]) -> list[int]:
    return results
