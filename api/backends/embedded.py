"""The embedded backend: the engine runs in this process, on a thread of its own.

``LLMEngine`` is not thread-safe, so one ``engine.engine_thread.EngineThread`` owns it:
it applies the adds and aborts that the event loop queues for it and steps
while there is work, sleeping when idle. What any host does with the engine,
adding a request, ending every request after a failed step and reading the
load, is ``engine.engine_host``'s; this module owns the rest: delivery to the
event loop, admission and deadlines. The model loads on a worker thread
while the server already answers (``/ready`` says 503 until then, and while
the engine thread compiles its decode step). A model that fails to load, or an
engine thread that dies, ends the backend for good: ``failure()`` returns the
reason and the server stops. Events go
back to the event loop with ``call_soon_threadsafe`` into one ``asyncio.Queue``
per request; the event loop never touches the engine. Anything the engine
raises becomes an ``Error`` event for the requests it concerns, so a client
never waits forever.

Admission and deadlines are distributed mode's (``api.limits.Limits``):
at most ``max_inflight`` requests admitted and not ended (a 429 before any
preparation), and a request the engine has not started by its queue
deadline, or without a first token or an end by theirs, ends with that
deadline's ``Error`` and leaves the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client.registry import Collector

from api.backends.base import Backend, BackendHealth, Place, ServedModel
from api.error_kinds import api_error, rate_limited_message
from api.limits import Limits
from engine.config import EngineArgs
from engine.engine_host import add_request, end_after_failed_step, read_load
from shared.engine_metrics import EngineLoad, EngineLoadCollector
from shared.engine_options import EngineOptions
from shared.events import Error, Finish, InferenceEvent, Ready, Text
from shared.generation_config import sampling_defaults
from shared.heap import freeze_startup_heap
from shared.registry import ModelSpec
from shared.wire import Deadlines, PreparedRequest

if TYPE_CHECKING:
    from engine.engine_thread import EngineThread
    from engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)

EngineFactory = Callable[[], "LLMEngine"]


def _default_factory(args: EngineArgs) -> EngineFactory:
    def build() -> LLMEngine:
        from engine.llm_engine import LLMEngine  # torch is imported only here

        return LLMEngine(args)

    return build


class EmbeddedBackend(Backend):
    """One engine, one thread; see the module docstring for the threading contract."""

    def __init__(
        self,
        spec: ModelSpec,
        engine_args: EngineArgs | None = None,
        engine_factory: EngineFactory | None = None,
        limits: Limits | None = None,
    ) -> None:
        self._spec = spec
        self._limits = limits or Limits()
        self._admitted = 0  # admitted and not yet ended
        self._factory = engine_factory or _default_factory(
            engine_args or EngineArgs.serving(spec, EngineOptions())
        )
        self._host: EngineThread | None = None
        self._loading: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, asyncio.Queue[InferenceEvent | _Expired]] = {}
        self._served: ServedModel | None = None
        self._health = BackendHealth(ready=False, detail="loading the model")
        self._engine_load = EngineLoad()
        self._failed: asyncio.Future[str] | None = None

    async def start(self) -> None:
        """Load the model off the event loop; the server answers meanwhile."""
        self._loop = asyncio.get_running_loop()
        self._failed = self._loop.create_future()
        self._loading = asyncio.create_task(self._load())

    async def stop(self) -> None:
        """Stop the engine thread and end every open stream with an ``Error``."""
        if self._loading is not None:
            with contextlib.suppress(Exception):
                await self._loading
        if self._host is not None:
            await asyncio.to_thread(self._host.stop)
        for request_id, queue in list(self._streams.items()):
            queue.put_nowait(Error(request_id, "the server is shutting down", "overloaded"))

    def health(self) -> BackendHealth:
        return self._health

    async def failure(self) -> str:
        assert self._failed is not None, "start() first"
        return await asyncio.shield(self._failed)

    def _fail(self, detail: str) -> None:
        """Runs on the event loop: the backend can serve no more."""
        self._health = BackendHealth(ready=False, detail=detail, failed=True)
        if self._failed is not None and not self._failed.done():
            self._failed.set_result(detail)

    def models(self) -> list[ServedModel]:
        return [self._served] if self._served is not None else []

    def metrics_collector(self) -> Collector:
        return EngineLoadCollector(self._spec.served_name, lambda: self._engine_load)

    async def admit(self, model: str | None = None) -> Place:
        """A place among the ``max_inflight`` requests admitted and not ended, or a 429."""
        bound = self._limits.max_inflight
        if self._admitted >= bound:
            raise api_error("rate_limited", rate_limited_message(bound))
        self._admitted += 1
        return _EmbeddedPlace(self)

    async def infer(self, request: PreparedRequest) -> AsyncIterator[InferenceEvent]:
        """Yield the request's events; leaving early aborts it in the engine."""
        request_id = request.request_id
        if self._host is None or self._health.failed:
            yield Error(request_id, self._health.detail, "overloaded")
            return
        queue: asyncio.Queue[InferenceEvent | _Expired] = asyncio.Queue()
        self._streams[request_id] = queue
        self._host.call(lambda engine: self._add(engine, request))
        alarm = _Alarm(queue, self._limits.deadlines(request.created or time.time()))
        started = first_token = finished = False
        try:
            while not finished:
                alarm.set(started, first_token)
                event = await queue.get()
                if isinstance(event, _Expired):
                    if event is alarm.armed:
                        yield Error(
                            request_id, _DEADLINE_MESSAGES[event.kind](self._limits), event.kind
                        )
                        return
                    continue  # a deadline the request met before its alarm was taken out
                started = started or isinstance(event, Ready)  # accepted, it may wait in the engine
                first_token = first_token or (isinstance(event, Text) and bool(event.token_ids))
                finished = isinstance(event, Finish | Error)
                yield event
        finally:
            alarm.cancel()
            self._streams.pop(request_id, None)
            if not finished and self._host is not None:
                self._host.call(lambda engine: engine.abort(request_id))

    def _release(self) -> None:
        self._admitted -= 1

    async def _load(self) -> None:
        from engine.engine_thread import EngineThread

        try:
            engine = await asyncio.to_thread(self._factory)
        except Exception as exc:
            log.exception("loading the model failed")
            self._fail(f"loading the model failed: {exc}")
            return
        self._served = ServedModel(
            self._spec,
            engine.tokenizer,
            engine.max_model_len,
            engine.image_processing,
            sampling_defaults(self._spec.weights),
        )
        self._host = EngineThread(
            engine, self._on_events, self._on_step_failure, on_death=self._on_death
        )
        self._health = BackendHealth(ready=False, detail="compiling the decode step")
        self._host.call(self._publish)  # ready once the engine thread has warmed up
        self._host.start()
        freeze_startup_heap()

    def _deliver(self, events: list[InferenceEvent]) -> None:
        """Runs on the event loop: fan a step's events out to their requests."""
        for event in events:
            queue = self._streams.get(event.request_id)
            if queue is not None:
                queue.put_nowait(event)

    # --- on the engine thread --------------------------------------------------

    def _add(self, engine: LLMEngine, request: PreparedRequest) -> None:
        self._send([add_request(engine, request)])

    def _on_events(self, engine: LLMEngine, events: list[InferenceEvent]) -> None:
        if events:
            self._send(events)
        self._publish(engine)

    def _on_step_failure(self, engine: LLMEngine, exc: Exception) -> None:
        """End every request the engine holds with an Error; free their blocks."""
        self._send(end_after_failed_step(engine, exc))

    def _on_death(self, exc: BaseException) -> None:
        """End every open stream, and the backend: nothing steps the engine any more."""
        detail = f"the engine died: {exc!r}"
        if self._loop is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._fail, detail)
        self._send([Error(request_id, detail) for request_id in list(self._streams)])

    def _send(self, events: list[InferenceEvent]) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop closed since the check
            loop.call_soon_threadsafe(self._deliver, events)

    def _publish(self, engine: LLMEngine) -> None:
        """Refresh the snapshots the event loop reads (one assignment each)."""
        load = self._engine_load = read_load(engine, EngineLoad)
        self._health = BackendHealth(
            ready=True,
            aborted=load.aborted,
            steps=load.steps,
            generated_tokens=load.generated_tokens,
        )


class _EmbeddedPlace(Place):
    def __init__(self, backend: EmbeddedBackend) -> None:
        self._backend: EmbeddedBackend | None = backend

    def release(self) -> None:
        if self._backend is not None:
            self._backend._release()
            self._backend = None


_DEADLINE_MESSAGES: dict[str, Callable[[Limits], str]] = {
    "queue_timeout": lambda limits: (
        f"The engine did not start the request within {limits.queue_timeout_s:g}s "
        "(it is busy); retry later."
    ),
    "first_token_timeout": lambda limits: (
        f"No first token within {limits.first_token_timeout_s:g}s of the request's arrival."
    ),
    "total_timeout": lambda limits: (
        f"The generation did not end within {limits.total_timeout_s:g}s of its arrival."
    ),
}


@dataclass(slots=True, eq=False)
class _Expired:
    """Put into a request's queue when the deadline its next event had to beat passes."""

    kind: str


class _Alarm:
    """One timer per deadline a request's events must beat, not one per event.

    The deadline moves only when the request starts and when its first token
    comes, so a stream of tokens arms no timer at all; a timer that fires
    puts ``armed`` into the queue, behind the events that came in time.
    """

    def __init__(self, queue: asyncio.Queue, deadlines: Deadlines) -> None:
        self._queue = queue
        self._deadlines = deadlines
        self._progress: tuple[bool, bool] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.armed: _Expired | None = None

    def set(self, started: bool, first_token: bool) -> None:
        if (started, first_token) == self._progress:
            return
        self._progress = (started, first_token)
        self.cancel()
        at, kind = self._deadlines.pending(started, first_token)
        self.armed = _Expired(kind)
        if at is None:  # no deadline left to meet
            return
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(max(at - time.time(), 0), self._queue.put_nowait, self.armed)

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
