"""Group commit for threads: overlapping calls share batches; each caller gets its own answer."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import pytest

from workers.coalescer import Coalescer


class Recorder:
    """A batch function that takes its time, so that calls pile up behind it."""

    def __init__(self, delay_s: float = 0.05, fail_first: bool = False) -> None:
        self.batches: list[list[int]] = []
        self.delay_s = delay_s
        self.fail_first = fail_first
        self.lock = threading.Lock()

    def __call__(self, items: Sequence[int]) -> list[int]:
        time.sleep(self.delay_s)
        with self.lock:
            self.batches.append(list(items))
            if self.fail_first and len(self.batches) == 1:
                raise ConnectionError("redis went away")
        return [item * 10 for item in items]


def _call_together(coalescer: Coalescer[int, int], count: int) -> list[int | BaseException]:
    start = threading.Barrier(count)

    def call(item: int) -> int | BaseException:
        start.wait()
        try:
            return coalescer(item)
        except ConnectionError as exc:
            return exc

    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(call, range(count)))


def test_overlapping_calls_share_a_few_batches_and_get_their_own_results() -> None:
    recorder = Recorder()

    results = _call_together(Coalescer(recorder), 24)

    assert results == [item * 10 for item in range(24)]
    assert sorted(item for batch in recorder.batches for item in batch) == list(range(24))
    assert len(recorder.batches) <= 3  # the first alone, the rest behind it


def test_calls_that_do_not_overlap_run_alone() -> None:
    recorder = Recorder(delay_s=0)
    coalescer = Coalescer(recorder)

    assert [coalescer(item) for item in range(3)] == [0, 10, 20]
    assert recorder.batches == [[0], [1], [2]]


def test_a_failed_batch_fails_its_callers_only() -> None:
    recorder = Recorder(fail_first=True)

    results = _call_together(Coalescer(recorder), 12)

    failed = {item for item, result in enumerate(results) if isinstance(result, ConnectionError)}
    assert failed == set(recorder.batches[0])
    assert all(results[item] == item * 10 for item in range(12) if item not in failed)


def test_a_batch_function_that_loses_results_fails_the_batch() -> None:
    coalescer: Coalescer[int, int] = Coalescer(lambda items: [])

    with pytest.raises(RuntimeError, match="0 results for a batch of 1"):
        coalescer(1)
