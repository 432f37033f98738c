"""One thread that owns an ``LLMEngine``, and a queue of work for it.

``LLMEngine`` is not thread-safe, so exactly one thread touches it. Other
threads never call the engine; they queue a command, a function of the
engine, and the thread runs the queued commands between steps, in order.
While the engine has work the thread steps it and hands each step's events
to ``on_events``; when it has none the thread sleeps on a condition, so an
idle host costs no CPU, and returns the C heap's free pages to the system
first, so an idle host holds no more memory than before its last burst.
Once warm, it drops the pages of libtorch's code that only the start ran
(``shared.heap.drop_code_pages``).
Callbacks run on the engine thread: they may call the engine directly but
must not block for long, since every request waits for them. ``on_commands``
runs after each batch of queued commands, before the step: a host sends what
the batch produced in one write rather than one per command, which a burst's
adds would otherwise make while the next step waits for them.

A callback may ``defer`` work that needs not precede the next step (writing
a step's events). An engine whose model computes in another process
(``workers.vllm_engine``) has a ``while_running`` hook, which it calls once
each step has handed its model work over: deferred work runs there, on this
thread, while the model computes, rather than between the steps, where each
step would wait for it. Deferred work runs in the order deferred, and before
anything that may have to follow it: the next commands, the handling of a
failed step, and the thread's end; when no step follows it runs at once; and
when a callback calls ``run_deferred``, ahead of work it wants out sooner. On
an engine that computes on this thread, ``defer`` runs the work at once.

This module owns the thread and the order of work on it; what a host does
with the engine in its commands and callbacks (adding a request, ending every
request after a failed step, reading the load) is ``engine.engine_host``'s,
and the rest is the host's: ``api.backends.embedded`` or ``workers.host``.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import sys
import threading
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from shared.events import InferenceEvent
from shared.heap import drop_code_pages, return_free_memory

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)

Command = Callable[["LLMEngine"], None]
EventsHandler = Callable[["LLMEngine", list[InferenceEvent]], None]
StepFailureHandler = Callable[["LLMEngine", Exception], None]
CommandsHandler = Callable[["LLMEngine"], None]
DeathHandler = Callable[[BaseException], None]


class EngineThread:
    """Runs ``engine.step()`` on a thread of its own; see the module docstring."""

    def __init__(
        self,
        engine: LLMEngine,
        on_events: EventsHandler,
        on_step_failure: StepFailureHandler,
        name: str = "sluice-engine",
        on_death: DeathHandler | None = None,
        on_commands: CommandsHandler | None = None,
    ) -> None:
        self.engine = engine
        self._on_events = on_events
        self._on_step_failure = on_step_failure
        self._on_commands = on_commands
        self._on_death = on_death  # called on the thread when something ends it early
        self._commands: deque[Command] = deque()
        self._deferred: list[Callable[[], None]] = []  # engine thread only
        self._overlaps = hasattr(engine, "while_running")  # see ``defer``
        self._wake = threading.Condition()
        self._stopping = False
        self._warm = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def call(self, command: Command) -> None:
        """Run ``command(engine)`` on the engine thread before its next step."""
        with self._wake:
            self._commands.append(command)
            self._wake.notify()

    def defer(self, work: Callable[[], None]) -> None:
        """Run ``work``, which must not touch the engine, while the next step's model
        computes (see the module docstring). Engine thread only."""
        if self._overlaps:
            self._deferred.append(work)
        else:
            work()

    def stop(self, timeout: float | None = None) -> None:
        """Stop after the current step; queued commands that have not run are dropped."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def wait_warm(self) -> None:
        """Block until the thread has warmed the engine up (compiled it), or has died."""
        while not self._warm.wait(1.0) and self._thread.is_alive():
            pass

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # logged and handed on: the thread ends here
            log.exception("the engine thread died")
            if self._on_death is not None:
                self._on_death(exc)

    def _serve(self) -> None:
        _name_os_thread(self._thread.name)
        engine = self.engine
        engine.warm_up(background=True)  # commands queued meanwhile wait for it
        drop_code_pages()
        if self._overlaps:
            engine.while_running = self.run_deferred
        self._warm.set()
        while (commands := self._next_commands()) is not None:
            if commands:
                self.run_deferred()
            for command in commands:
                self._apply(command)
            if self._on_commands is not None:
                self._apply(self._on_commands)
            stepped = engine.has_unfinished()
            if stepped:
                self._step()
            if not engine.has_unfinished():  # no step follows
                self.run_deferred()
                if stepped:  # drained: hand back what the steps freed
                    return_free_memory()
        self.run_deferred()

    def _next_commands(self) -> list[Command] | None:
        """Sleep until there is a command or engine work; None when stopping."""
        with self._wake:
            while not self._commands and not self.engine.has_unfinished() and not self._stopping:
                self._wake.wait()
            if self._stopping:
                return None
            commands = list(self._commands)
            self._commands.clear()
        return commands

    def _apply(self, command: Command) -> None:
        try:
            command(self.engine)
        except Exception:  # one bad command must not take the engine thread down
            log.exception("an engine command failed")

    def run_deferred(self) -> None:
        """Run the deferred work now, in the order deferred: before work that must follow it
        sooner than the next step's hand-over. Engine thread only."""
        if not self._deferred:  # every step asks
            return
        deferred, self._deferred = self._deferred, []
        for work in deferred:
            try:
                work()
            except Exception:  # one failed write must not take the engine thread down
                log.exception("deferred work failed")

    def _step(self) -> None:
        try:
            events = self.engine.step()
        except Exception as exc:
            log.exception("engine step failed")
            self.run_deferred()
            try:
                self._on_step_failure(self.engine, exc)
            except Exception:  # the thread must live on to serve the next requests
                log.exception("handling a failed step failed")
            return
        self.run_deferred()  # left when the step handed no model work over
        try:
            self._on_events(self.engine, events)
        except Exception:
            log.exception("handling the events of a step failed")


_PR_SET_NAME = 15


def _name_os_thread(name: str) -> None:
    """Give the calling thread ``name`` in the OS (Linux; its first 15 bytes), so ``top -H``
    and ``/proc/<pid>/task/*/comm`` tell the engine's CPU from the rest of the process.

    Threads the engine thread starts, OpenMP's workers among them, inherit the name.
    """
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):  # no prctl: the name is a nicety
        ctypes.CDLL(None).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
