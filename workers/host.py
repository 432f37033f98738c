"""The worker's engine host: runs jobs on the engine thread and publishes their events.

Task threads (one per Celery job) hand a ``Run`` to the host and block until
it resolves. Everything that touches the engine happens on the engine
thread (``engine.engine_thread.EngineThread``): adds, cancels, hand-backs and
stopping runs whose writes failed. Adding a request, ending every run after a
failed step and reading the engine's load are ``engine.engine_host``'s, as in
embedded mode; this module owns the runs, the outbox and its fencing, drains,
cancels and hand-backs. After each step the engine thread hands every run's
events to the ``Outbox`` (on an engine whose model computes in another
process, while the next step computes, ``EngineThread.defer``, unless they
carry first tokens), which sends them (fenced) at once or with the write
after the one in flight, and reads the reply on a thread of its own while
the engine steps on.

Runs resolve on one thread, the outbox's, after every write put before
their end: a run that finished when the write of its end came back (it
frees its job's Celery slot at once, not after the step in progress), and
a run another thread took out (fenced, handed back, unpublished) when its
last writes have ended. A run resolves with an ``Outcome`` that tells its
task what to do with the message: ``FINISHED`` and ``FENCED`` are acked (the
stream has its end, or a newer attempt owns the request); ``HANDED_BACK``
and ``UNPUBLISHED`` are requeued, so another worker resumes the request
from its stream.

The engine thread may die (an exception no step or command catches): its
runs can then never finish, and nothing is left to run the commands that
would hand them back. The host's watchdog is the one place that watches
for it: it hands every run back at once, from its own thread, marks the host
draining and calls ``on_engine_death`` (the worker shuts itself down).

Each run is known to the engine as ``<request id>/<attempt>``, so that a
request redelivered to the worker that still runs its stale attempt gets a
sequence of its own, and the abort event of a dropped run can never be
mistaken for its successor's.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

import redis

from engine.engine_host import add_request, end_after_failed_step, read_load
from engine.engine_thread import EngineThread
from shared.engine_metrics import EngineLoad
from shared.events import Accepted, Error, Finish, InferenceEvent, Ready
from shared.wire import PreparedRequest
from workers.broker.intake import Intake
from workers.outbox import Attempt, Outbox
from workers.publisher import Batch, EventPublisher

if TYPE_CHECKING:
    from engine.block_manager import CacheChanges
    from engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)

EARLY_CANCEL_MEMORY_S = 30.0
"""How long a cancel for a request not running here is kept for a run that may follow.

A task reads the cancel flag before it submits its run; a cancel published
in between reaches the engine thread before the run does. The window is
milliseconds; every cancel of every worker passes through here, so the
memory is kept short."""

ENGINE_CHECK_S = 1.0
"""How often the host's watchdog looks at the engine thread."""


class Outcome(Enum):
    FINISHED = "finished"  # a Finish or Error is in the stream
    FENCED = "fenced"  # a newer attempt owns the request
    HANDED_BACK = "handed_back"  # stopped by a drain; another worker resumes it
    UNPUBLISHED = "unpublished"  # Redis refused its events; another worker resumes it


@dataclass(slots=True)
class Resume:
    """What earlier attempts already streamed: the engine continues from there."""

    generated_token_ids: list[int]
    emitted_chars: int


@dataclass(eq=False, slots=True)
class Run:
    """One attempt at one request, from submission until its outcome."""

    request: PreparedRequest
    attempt: int
    resume: Resume | None = None
    origin: str | None = None  # the API process waiting for it (``shared.wire.QueuedRequest``)
    outcome: Outcome | None = None
    next_seq: int = 1  # the sequence number of the next event this attempt writes
    ended: bool = False  # its Finish or Error is published (written, or on its way)
    _done: threading.Event = field(default_factory=threading.Event)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def engine_id(self) -> str:
        return engine_id(self.request.request_id, self.attempt)

    def resolve(self, outcome: Outcome) -> None:
        self.outcome = outcome
        self._done.set()

    def wait(self, timeout: float | None = None) -> Outcome | None:
        """The outcome, or None if it is not known within ``timeout`` seconds.

        With no timeout, the outcome: every run resolves, the engine thread's
        death included (the host's watchdog hands its runs back).
        """
        self._done.wait(timeout)
        return self.outcome


def engine_id(request_id: str, attempt: int) -> str:
    return f"{request_id}/{attempt}"


@dataclass(frozen=True, slots=True, kw_only=True)
class HostSnapshot(EngineLoad):
    """The engine's load (``engine.engine_host.read_load``) with this host's own numbers,
    as of the last step or command (read by the heartbeat and ``/metrics``)."""

    capacity: int
    max_model_len: int
    block_size: int = 0
    intake_open: bool = True  # False while the engine waits for KV blocks
    runs: int = 0


class WorkerHost:
    """Engine thread + run table + fenced publishing; see the module docstring."""

    def __init__(
        self,
        engine: LLMEngine,
        publisher: EventPublisher,
        on_engine_death: Callable[[], None] = lambda: None,
        engine_check_s: float = ENGINE_CHECK_S,
        on_cache_changes: Callable[[CacheChanges], None] | None = None,
    ) -> None:
        self._outbox = Outbox(publisher, self._on_written)
        self._thread = EngineThread(
            engine, self._on_events, self._on_step_failure, on_commands=self._send_added
        )
        # By engine id, from submission until taken out (dict operations are atomic): task
        # threads add runs (under _idle), whichever thread ends a run takes it out.
        self._runs: dict[str, Run] = {}
        self._current: dict[str, Run] = {}  # by request id, once in the engine; under _idle
        self._early_cancels: dict[str, float] = {}  # request id -> when; engine thread only
        # The runs this batch of commands added, with what to send for each once the batch
        # has run; engine thread only.
        self._added: list[tuple[Run, list[InferenceEvent]]] = []
        self._idle = threading.Condition()  # notified whenever a run is taken out
        self._lost = False  # the watchdog found the engine thread dead; under _idle
        self.draining = False
        self.intake = Intake()  # closed while the engine waits for KV blocks
        self.snapshot = self._take_snapshot(engine)
        self._on_engine_death = on_engine_death
        self._on_cache_changes = on_cache_changes
        if on_cache_changes is not None:
            engine.block_manager.track_changes()  # before the engine thread starts
        self._engine_check_s = engine_check_s
        self._unwatched = threading.Event()  # set to stop the watchdog
        self._watchdog = threading.Thread(target=self._watch, name="sluice-watchdog", daemon=True)
        self._started = False
        self._stopped = False
        self._died = False  # the engine thread was dead when ``stop`` came

    # --- any thread ----------------------------------------------------------

    def start(self) -> None:
        """Start the threads; return once the engine has compiled, before any job is taken."""
        self._outbox.start()
        self._thread.start()
        self._started = True  # only now: a thread not yet started is not a dead one
        self._watchdog.start()
        self._thread.wait_warm()

    def stop(self, timeout: float | None = None) -> None:
        """Stop watching and stepping, then write what the last steps produced."""
        self._unwatched.set()  # first: the engine thread is about to end on purpose
        if self._watchdog.is_alive():
            self._watchdog.join(timeout)
        self._died = self.engine_died()  # a stop must not hide an earlier death
        self._stopped = True  # before the thread ends, so that its end is no death
        self._thread.stop(timeout)
        self._outbox.stop(timeout)

    def engine_died(self) -> bool:
        """Whether the engine thread ended without ``stop``: nothing here runs any more.

        ``is_alive`` alone cannot tell, being False before ``start`` and after
        ``stop`` as well. The reads are ordered (``start`` and ``stop`` write
        in the opposite order) so that neither a start nor a stop happening
        meanwhile looks like a death, nor hides one.
        """
        started = self._started
        alive = self._thread.is_alive()
        return (started and not alive and not self._stopped) or self._died

    def submit(self, run: Run) -> None:
        """Hand ``run`` to the engine thread; it resolves however that thread ends."""
        with self._idle:
            lost = self._lost
            if not lost:
                self._runs[run.engine_id] = run
        if lost:  # nothing would ever run it
            self._outbox.call_soon(lambda: run.resolve(Outcome.HANDED_BACK))
            return
        self._thread.call(lambda engine: self._add(engine, run))

    def cancel(self, request_id: str) -> None:
        """Abort ``request_id`` if this worker runs it; its Finish(abort) is published."""
        self._thread.call(lambda engine: self._cancel(engine, request_id))

    def running(self) -> dict[str, str | None]:
        """The requests running here now, with their origins (a copy; it may change at once)."""
        with self._idle:
            return {request_id: run.origin for request_id, run in self._current.items()}

    def drain(self, grace_s: float) -> int:
        """Stop taking work, wait up to ``grace_s`` for runs to end, hand back the rest.

        Returns how many runs were handed back. Their tasks requeue their
        messages; nothing is published for them, so the client sees the
        next worker's tokens continue the stream. Once the engine thread is
        dead the watchdog hands every run back, which ends the wait.
        """
        self.draining = True
        with self._idle:
            self._idle.wait_for(lambda: not self._current, timeout=grace_s)
            remaining = len(self._current)
        if remaining:
            log.warning("drain grace of %.0f s is over: handing back %d runs", grace_s, remaining)
            self._thread.call(self._hand_back_all)
        return remaining

    # --- the watchdog thread ------------------------------------------------------

    def _watch(self) -> None:
        """Look at the engine thread every ``engine_check_s``; a thread's death notifies no one."""
        while not self._unwatched.wait(self._engine_check_s):
            if self.engine_died():
                self._engine_lost()
                return

    def _engine_lost(self) -> None:
        """Hand every run back from this thread, take no more, and tell the worker.

        ``_hand_back_all`` would be queued for a thread that no longer runs
        commands. The engine is not touched: it may have died mid-step, and
        the process is about to exit. ``_untrack`` takes each run out once,
        whichever thread comes first.
        """
        log.error("the engine thread died: handing back every run and taking no more jobs")
        self.draining = True
        with self._idle:
            self._lost = True
        for run in list(self._runs.values()):
            self._untrack(run, Outcome.HANDED_BACK)
        self.snapshot = dataclasses.replace(
            self.snapshot, running=0, waiting=0, runs=len(self._runs)
        )
        self._on_engine_death()

    # --- the engine thread ---------------------------------------------------

    def _add(self, engine: LLMEngine, run: Run) -> None:
        if run.engine_id not in self._runs:  # handed back before it got here
            return
        if self.draining:  # a job that arrived as the drain began: the next worker runs it
            self._untrack(run, Outcome.HANDED_BACK)
            return
        stale = self._current.get(run.request_id)
        if stale is not None:  # redelivered here while the old attempt still ran
            self._drop(engine, stale, Outcome.FENCED)
        resume = run.resume or Resume([], 0)
        with self._idle:
            self._current[run.request_id] = run
        answer = add_request(  # tracked already: unresolved, it would hold its slot for good
            engine,
            run.request,
            run.engine_id,
            generated_token_ids=resume.generated_token_ids,
            emitted_chars=resume.emitted_chars,
        )
        # A resumed request's client has its Accepted (and Ready) from an earlier attempt.
        sent = isinstance(answer, Error) or run.resume is None
        self._added.append((run, [answer] if sent else []))
        cancelled_early = self._early_cancels.pop(run.request_id, None) is not None
        if isinstance(answer, Accepted) and cancelled_early:
            self._cancel(engine, run.request_id)

    def _send_added(self, engine: LLMEngine) -> None:
        """After a batch of commands: what its adds answered, in one write, and the load.

        A burst's jobs arrive together and are added between two steps; one
        write and one snapshot for all of them keep the outbox thread and the
        snapshot from costing the next step's start once per job.
        """
        if not self._added:
            return
        added, self._added = self._added, []
        answers = [(run, events) for run, events in added if events]
        if answers:
            self._publish(answers)
        self._refresh(engine)

    def _cancel(self, engine: LLMEngine, request_id: str) -> None:
        run = self._current.get(request_id)
        if run is None:
            self._remember_cancel(request_id)
        elif engine.abort(run.engine_id):
            log.info("cancelled %s (attempt %d)", request_id, run.attempt)
            self._refresh(engine)

    def _remember_cancel(self, request_id: str) -> None:
        """Keep a cancel for a run that may still be on its way (oldest first, pruned)."""
        now = time.monotonic()
        cancels = self._early_cancels
        cancels.pop(request_id, None)
        cancels[request_id] = now
        for oldest, when in list(cancels.items()):
            if when >= now - EARLY_CANCEL_MEMORY_S:
                break
            del cancels[oldest]

    def _hand_back_all(self, engine: LLMEngine) -> None:
        for run in list(self._runs.values()):
            self._drop(engine, run, Outcome.HANDED_BACK)
        self._refresh(engine)

    def _on_events(self, engine: LLMEngine, events: list[InferenceEvent]) -> None:
        by_run: dict[str, tuple[Run, list[InferenceEvent]]] = {}
        first_tokens = False
        for event in events:
            run = self._runs.get(event.request_id)
            if run is None or run.ended:  # dropped here (fenced, handed back), or ended
                continue
            if isinstance(event, Ready):
                if run.resume is not None:
                    continue  # the client has its Ready from the first attempt
                first_tokens = True
            by_run.setdefault(run.engine_id, (run, []))[1].append(event)
        self._publish(list(by_run.values()), at_once=first_tokens)
        self._refresh(engine)

    def _on_step_failure(self, engine: LLMEngine, exc: Exception) -> None:
        """End every run with an Error: a failed step leaves the batch's state unknown.

        Every run not yet ended gets one, in the engine or not: a run cancelled
        just before the step lost its Finish(abort) with the step's events.
        """
        runs = [run for run in self._runs.values() if not run.ended]
        errors = end_after_failed_step(engine, exc, [run.request_id for run in runs])
        self._publish([(run, [error]) for run, error in zip(runs, errors, strict=True)])
        self._refresh(engine)

    def _publish(self, runs: list[tuple[Run, list[InferenceEvent]]], at_once: bool = False) -> None:
        """Queue the events for the outbox; ``_settle`` sees how their write went.

        The write waits for the next step's hand-over (``EngineThread.defer``)
        unless ``at_once``: first tokens go now, ahead of the next step's
        scheduling. A step that prefills a burst ends the wait of every client
        in it, and the write delays the next step once per request, not per
        token.

        Takes the runs themselves, not their ids: the outbox thread untracks a
        run whose Finish it wrote at any moment, also between a lookup here
        and this call.
        """
        batches = []
        for run, events in runs:
            batches.append(Batch(run.request_id, run.attempt, run.next_seq, events))
            run.next_seq += len(events)
            run.ended = run.ended or isinstance(events[-1], Finish | Error)
        if at_once:
            self._thread.run_deferred()  # the writes deferred before these go first
            self._outbox.put(batches)
        else:
            self._thread.defer(lambda: self._outbox.put(batches))

    def _on_written(
        self, batches: list[Batch], fenced: set[Attempt], error: redis.RedisError | None
    ) -> None:
        """The outbox thread's report: finished runs resolve here, the rest on the engine thread."""
        if error is None:
            resolved = False
            for batch in batches:
                key = (batch.request_id, batch.attempt)
                if key not in fenced and isinstance(batch.events[-1], Finish | Error):
                    run = self._runs.get(engine_id(*key))
                    if run is not None:
                        self._untrack(run, Outcome.FINISHED)
                        resolved = True
            if not fenced:
                if resolved:  # the snapshot counts the runs; the engine thread takes it
                    self._thread.call(self._refresh)
                return
        self._thread.call(lambda engine: self._settle(engine, batches, fenced, error))

    def _settle(
        self,
        engine: LLMEngine,
        batches: list[Batch],
        fenced: set[Attempt],
        error: redis.RedisError | None,
    ) -> None:
        """Stop the runs whose writes were refused or fenced out."""
        if error is not None:
            log.error("publishing events failed (%s): stopping %d runs", error, len(batches))
        for batch in batches:
            run = self._runs.get(engine_id(batch.request_id, batch.attempt))
            if run is None:  # already dropped here
                continue
            if error is not None:
                self._drop(engine, run, Outcome.UNPUBLISHED)
            elif (batch.request_id, batch.attempt) in fenced:
                log.warning("%s attempt %d is stale: stopping it", run.request_id, run.attempt)
                self._drop(engine, run, Outcome.FENCED)
        self._refresh(engine)

    def _drop(self, engine: LLMEngine, run: Run, outcome: Outcome) -> None:
        """Stop a run here without publishing anything more for it."""
        engine.abort(run.engine_id)
        self._untrack(run, outcome)

    def _untrack(self, run: Run, outcome: Outcome) -> bool:
        """Take the run out; it resolves on the outbox thread. False if already taken out."""
        if self._runs.pop(run.engine_id, None) is None:
            return False
        with self._idle:
            if self._current.get(run.request_id) is run:
                del self._current[run.request_id]
            self._idle.notify_all()
        self._outbox.call_soon(lambda: run.resolve(outcome))
        return True

    def _refresh(self, engine: LLMEngine) -> None:
        self.snapshot = self._take_snapshot(engine)
        self.intake.set(not engine.scheduler.kv_bound)
        if self._on_cache_changes is not None:
            self._on_cache_changes(engine.block_manager.take_changes())

    def _take_snapshot(self, engine: LLMEngine) -> HostSnapshot:
        return read_load(
            engine,
            HostSnapshot,
            capacity=engine.args.max_num_seqs,
            max_model_len=engine.max_model_len,
            block_size=engine.block_manager.block_size,
            intake_open=not engine.scheduler.kv_bound,
            runs=len(self._runs),
        )
