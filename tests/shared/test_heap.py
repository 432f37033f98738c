"""``freeze_startup_heap``: startup garbage is freed, the rest is out of the collector's view."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from shared.heap import freeze_startup_heap


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def cycle() -> weakref.ref[Node]:
    """A reference cycle nothing else refers to: only the collector can free it."""
    first, second = Node(), Node()
    first.other, second.other = second, first
    return weakref.ref(first)


@pytest.fixture(autouse=True)
def thawed() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_startup_garbage_is_collected_before_the_freeze() -> None:
    garbage = cycle()
    kept = Node()
    frozen = freeze_startup_heap()
    assert garbage() is None  # frozen garbage would never be freed
    assert 0 < gc.get_freeze_count() <= frozen  # other threads' frozen objects may die since
    assert gc.is_tracked(kept)


def test_a_full_collection_scans_only_what_came_after() -> None:
    freeze_startup_heap()
    tracked_after_freeze = len(gc.get_objects())
    later = cycle()
    assert tracked_after_freeze < gc.get_freeze_count()  # the permanent generation is not listed
    gc.collect()
    assert later() is None  # garbage made while serving is still freed
