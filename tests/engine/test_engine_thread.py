"""``EngineThread``: the one thread that steps an engine survives what its callbacks raise,
runs its queued commands in batches, each followed by ``on_commands`` before the step, and
runs deferred work while the next step's model computes, before any later command.

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


class Recording:
    """Work for one step per ``add``; every call noted in ``calls``, in order."""

    def __init__(self) -> None:
        self.pending: list[str] = []
        self.calls: list[str] = []

    def warm_up(self, background: bool = False) -> None:
        pass

    def add(self, name: str) -> None:
        self.pending.append(name)
        self.calls.append(name)

    def has_unfinished(self) -> bool:
        return bool(self.pending)

    def step(self) -> list[Any]:
        self.calls.append("step")
        done, self.pending = self.pending, []
        return done


def test_on_commands_runs_once_after_each_batch_of_commands_and_before_the_step():
    engine = Recording()
    stepped = threading.Event()
    blocking, release = threading.Event(), threading.Event()

    def first(engine: Any) -> None:
        engine.add("a")
        blocking.set()
        assert release.wait(5)

    def on_events(engine: Any, events: list[Any]) -> None:
        if "d" in events:
            stepped.set()

    thread = EngineThread(
        engine,  # type: ignore[arg-type]
        on_events,
        lambda *_: None,
        on_commands=lambda engine: engine.calls.append("sent"),
    )
    thread.start()
    try:
        thread.call(first)
        assert blocking.wait(5)
        for name in "bcd":  # queued while the thread runs ``first``: the next batch
            thread.call(lambda engine, name=name: engine.add(name))
        release.set()
        assert stepped.wait(5)
        assert engine.calls == ["a", "sent", "step", "b", "c", "d", "sent", "step"]
    finally:
        thread.stop(timeout=5)


class Overlapping(Recording):
    """As ``Recording``, for an engine whose model computes elsewhere: each step calls
    ``while_running`` between handing its work over and taking its result."""

    def __init__(self) -> None:
        super().__init__()
        self.while_running: Any = None
        self.left: dict[str, int] = {}  # steps of work left per request

    def add(self, name: str, steps: int = 1) -> None:
        super().add(name)
        self.left[name] = steps

    def has_unfinished(self) -> bool:
        return bool(self.left)

    def step(self) -> list[Any]:
        self.calls.append("handed over")
        self.while_running()
        self.calls.append("step")
        names = list(self.left)
        for name in names:
            self.left[name] -= 1
            if not self.left[name]:
                del self.left[name]
        return names


def test_deferred_work_runs_while_the_next_step_computes_and_before_the_next_commands():
    engine = Overlapping()
    idle = threading.Event()
    thread: EngineThread

    def on_events(engine: Any, events: list[Any]) -> None:
        written = f"write {engine.calls.count('step')}"
        thread.defer(lambda: engine.calls.append(written))
        if engine.calls.count("step") == 2:  # a command the third step must wait for
            thread.call(lambda engine: engine.add("b"))
        if not engine.has_unfinished():
            thread.call(lambda engine: idle.set())

    thread = EngineThread(engine, on_events, lambda *_: None)  # type: ignore[arg-type]
    thread.start()
    try:
        thread.call(lambda engine: engine.add("a", steps=3))
        assert idle.wait(5)
        assert engine.calls == [
            "a",
            "handed over", "step",  # the first step: nothing deferred yet
            "handed over", "write 1", "step",  # the first step's write, while the second runs
            "write 2", "b",  # a command: what was deferred goes first
            "handed over", "step",  # the third step ends both requests: no step follows
            "write 3",
        ]  # fmt: skip
    finally:
        thread.stop(timeout=5)


def test_deferred_work_runs_at_once_on_an_engine_that_computes_on_the_thread():
    engine = Recording()
    stepped = threading.Event()
    thread: EngineThread

    def on_events(engine: Any, events: list[Any]) -> None:
        thread.defer(lambda: engine.calls.append("write"))
        engine.calls.append("handled")
        stepped.set()

    thread = EngineThread(engine, on_events, lambda *_: None)  # type: ignore[arg-type]
    thread.start()
    try:
        thread.call(lambda engine: engine.add("a"))
        assert stepped.wait(5)
        assert engine.calls == ["a", "step", "write", "handled"]
    finally:
        thread.stop(timeout=5)
