"""The embedded backend: the engine runs in this process, on a thread of its own.

``LLMEngine`` is not thread-safe, so exactly one thread owns it: it loads the
model, applies the adds and aborts that the event loop queues for it, and
calls ``step()`` while there is work. It sleeps on a condition when idle, so
an idle server costs no CPU. Events go back to the event loop with
``call_soon_threadsafe`` into one ``asyncio.Queue`` per request; the event
loop never touches the engine. Anything the engine raises becomes an
``Error`` event for the requests it concerns, so a client never waits forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from api.backends.base import BackendHealth, ServedModel
from engine.config import EngineArgs
from shared.events import Error, Finish, InferenceEvent
from shared.registry import ModelSpec
from shared.wire import PreparedRequest

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)

EngineFactory = Callable[[], "LLMEngine"]


@dataclass(frozen=True, slots=True)
class _Add:
    request: PreparedRequest


@dataclass(frozen=True, slots=True)
class _Abort:
    request_id: str


def engine_args_for(
    spec: ModelSpec,
    *,
    dtype: str = "auto",
    max_model_len: int | None = None,
    max_num_seqs: int = 64,
    registry_file: str | None = None,
) -> EngineArgs:
    """Engine arguments that load ``spec`` from the same registry the API answers with.

    The registry's context length is the limit unless one is given.
    """
    return EngineArgs(
        model=spec.name,
        registry_file=registry_file,
        dtype=dtype,
        max_model_len=max_model_len or spec.context_length or None,
        max_num_seqs=max_num_seqs,
    )


def _default_factory(args: EngineArgs) -> EngineFactory:
    def build() -> LLMEngine:
        from engine.llm_engine import LLMEngine  # torch is imported only here

        return LLMEngine(args)

    return build


class EmbeddedBackend:
    """One engine, one thread; see the module docstring for the threading contract."""

    def __init__(
        self,
        spec: ModelSpec,
        engine_args: EngineArgs | None = None,
        engine_factory: EngineFactory | None = None,
    ) -> None:
        self._spec = spec
        self._factory = engine_factory or _default_factory(engine_args or engine_args_for(spec))
        self._commands: deque[_Add | _Abort] = deque()
        self._wake = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, asyncio.Queue[InferenceEvent]] = {}
        self._served: ServedModel | None = None
        self._health = BackendHealth(ready=False, detail="loading the model")

    # --- the event loop side -------------------------------------------------

    async def start(self) -> None:
        """Start the engine thread; the model loads there while the server answers."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="sluice-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Stop the thread and end every open stream with an ``Error``."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        for request_id, queue in list(self._streams.items()):
            queue.put_nowait(Error(request_id, "the server is shutting down", "overloaded"))

    def health(self) -> BackendHealth:
        return self._health

    def models(self) -> list[ServedModel]:
        return [self._served] if self._served is not None else []

    async def infer(self, request: PreparedRequest) -> AsyncIterator[InferenceEvent]:
        """Yield the request's events; leaving early aborts it in the engine."""
        request_id = request.request_id
        queue: asyncio.Queue[InferenceEvent] = asyncio.Queue()
        self._streams[request_id] = queue
        self._submit(_Add(request))
        finished = False
        try:
            while not finished:
                event = await queue.get()
                finished = isinstance(event, Finish | Error)
                yield event
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._submit(_Abort(request_id))

    def _submit(self, command: _Add | _Abort) -> None:
        with self._wake:
            self._commands.append(command)
            self._wake.notify()

    def _deliver(self, events: list[InferenceEvent]) -> None:
        """Runs on the event loop: fan a step's events out to their requests."""
        for event in events:
            queue = self._streams.get(event.request_id)
            if queue is not None:
                queue.put_nowait(event)

    # --- the engine thread ---------------------------------------------------

    def _run(self) -> None:
        try:
            engine = self._factory()
        except Exception as exc:  # a load failure is reported by /ready, not raised
            log.exception("loading the model failed")
            self._health = BackendHealth(ready=False, detail=f"loading the model failed: {exc}")
            self._fail_commands_until_stopped()
            return
        self._served = ServedModel(self._spec, engine.tokenizer, engine.max_model_len)
        self._publish(engine)
        while (commands := self._next_commands(engine)) is not None:
            self._apply(engine, commands)
            if engine.has_unfinished():
                self._step(engine)
            self._publish(engine)

    def _next_commands(self, engine: Any) -> list[_Add | _Abort] | None:
        """Sleep until there is a command or engine work; None when stopping."""
        with self._wake:
            while not self._commands and not engine.has_unfinished() and not self._stopping:
                self._wake.wait()
            if self._stopping:
                return None
            commands = list(self._commands)
            self._commands.clear()
        return commands

    def _apply(self, engine: Any, commands: list[_Add | _Abort]) -> None:
        for command in commands:
            if isinstance(command, _Abort):
                engine.abort(command.request_id)
                continue
            request = command.request
            try:
                engine.add_request(
                    request.request_id,
                    request.prompt_token_ids,
                    request.sampling,
                    request.priority,
                )
            except ValueError as exc:  # the engine refuses what it cannot run
                self._send([Error(request.request_id, str(exc), "invalid_request")])

    def _step(self, engine: Any) -> None:
        try:
            events = engine.step()
        except Exception as exc:
            log.exception("engine step failed")
            events = self._fail_running(engine, f"the engine failed: {exc}")
        if events:
            self._send(events)

    @staticmethod
    def _fail_running(engine: Any, message: str) -> list[InferenceEvent]:
        """End every request the engine holds with an Error; free their blocks."""
        request_ids = list(engine.sequences)
        for request_id in request_ids:
            engine.abort(request_id)  # the ABORT finishes that follow reach no one
        return [Error(request_id, message) for request_id in request_ids]

    def _fail_commands_until_stopped(self) -> None:
        """Without an engine, answer every add with an Error until stop()."""
        while True:
            with self._wake:
                while not self._commands and not self._stopping:
                    self._wake.wait()
                if self._stopping:
                    return
                commands = list(self._commands)
                self._commands.clear()
            detail = self._health.detail
            self._send(
                [Error(c.request.request_id, detail) for c in commands if isinstance(c, _Add)]
            )

    def _send(self, events: list[InferenceEvent]) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop closed since the check
            loop.call_soon_threadsafe(self._deliver, events)

    def _publish(self, engine: Any) -> None:
        """Refresh the health snapshot the event loop reads (one assignment)."""
        scheduler, stats = engine.scheduler, engine.stats
        self._health = BackendHealth(
            ready=True,
            running=len(scheduler.running),
            waiting=len(scheduler.waiting),
            aborted=stats.aborted,
            steps=stats.steps,
            generated_tokens=stats.tokens,
        )
