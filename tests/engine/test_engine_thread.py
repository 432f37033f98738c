"""``EngineThread``: the one thread that steps an engine survives what its callbacks raise.

The engine here is a stand-in with the methods the thread calls (``warm_up``
once, then ``has_unfinished`` and ``step`` between commands): what is under
test is the thread's loop, not a model.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from engine.engine_thread import EngineThread


class FailingOnce:
    """Work for one step per ``add``; the first step raises."""

    def __init__(self) -> None:
        self.pending: list[str] = []
        self.steps = 0
        self.warmed_on: int | None = None  # the thread that warmed it up

    def warm_up(self, background: bool = False) -> None:
        time.sleep(0.2)  # as compiling takes a while
        self.warmed_on = threading.get_ident()

    def add(self, name: str) -> None:
        self.pending.append(name)

    def has_unfinished(self) -> bool:
        return bool(self.pending)

    def step(self) -> list[Any]:
        self.steps += 1
        done, self.pending = self.pending, []
        if self.steps == 1:
            raise RuntimeError("device lost")
        return done


def test_the_thread_outlives_a_failure_in_its_step_failure_handler():
    engine = FailingOnce()
    served: list[str] = []
    handled = threading.Event()
    second = threading.Event()

    def on_events(engine: Any, events: list[Any]) -> None:
        served.extend(events)
        second.set()

    def on_step_failure(engine: Any, exc: Exception) -> None:
        handled.set()
        raise RuntimeError("a bug in the handler")

    thread = EngineThread(engine, on_events, on_step_failure)  # type: ignore[arg-type]
    thread.start()
    try:
        thread.call(lambda engine: engine.add("first"))
        assert handled.wait(5)
        thread.call(lambda engine: engine.add("second"))
        assert second.wait(5), "the thread stopped stepping"
        assert thread.is_alive() and served == ["second"]
    finally:
        thread.stop(timeout=5)


def test_waiting_for_warm_up_returns_once_the_engine_thread_has_warmed_up():
    engine = FailingOnce()
    thread = EngineThread(engine, lambda *_: None, lambda *_: None)  # type: ignore[arg-type]
    thread.start()
    try:
        thread.wait_warm()
        assert engine.warmed_on == thread._thread.ident
    finally:
        thread.stop(timeout=5)
