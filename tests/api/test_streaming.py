"""StreamProcessor with scripted events, the SSE/whole drivers, and the embedded backend.

A recording builder stands in for a protocol, so each test reads as "these
events in, these builder calls out". The embedded backend runs a scripted
fake engine on its real thread, which is where its threading contract lives.
The last tests drive scripted events through the app, for the statuses an
engine error must get.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.backends.base import Backend, BackendHealth, ServedModel
from api.backends.embedded import EmbeddedBackend
from api.errors import ApiError
from api.output_parser import (
    HERMES_TOOL_CALL,
    THINK,
    ContentDelta,
    OutputParser,
    ParserConfig,
    ReasoningDelta,
    ToolCallStart,
)
from api.protocols.base import (
    FinishKind,
    GenerationRequest,
    LogprobEntry,
    ResponseBuilder,
    ResponseContext,
    SSEChunk,
    Usage,
)
from api.settings import Settings
from api.streaming import StreamProcessor, TokenPieces, collect, event_source, sse_stream
from shared.conversation import Conversation
from shared.events import (
    Accepted,
    Error,
    Finish,
    FinishReason,
    InferenceEvent,
    Ready,
    Text,
    TokenLogprob,
)
from shared.registry import default_registry
from shared.sampling import SamplingParams
from shared.tokenizer_loader import LoadedTokenizer, load_tokenizer
from shared.wire import PreparedRequest

RID = "req-1"


class RecordingBuilder(ResponseBuilder):
    """Records every call; each returns one chunk naming the call."""

    def __init__(self) -> None:
        super().__init__(
            GenerationRequest("m", Conversation([]), stop=["END"]),
            ResponseContext(RID, "m", 0, "fp"),
        )
        self.calls: list[tuple[Any, ...]] = []

    def start(self, usage: Usage) -> list[SSEChunk]:
        self.calls.append(("start", usage))
        return [SSEChunk({"call": "start"})]

    def delta(self, delta: Any, logprobs: list[LogprobEntry] | None = None) -> list[SSEChunk]:
        self.calls.append(("delta", delta, logprobs))
        return [SSEChunk({"call": "delta"})]

    def finish(self, kind: FinishKind, usage: Usage, stop_sequence: str | None) -> list[SSEChunk]:
        self.calls.append(("finish", kind, usage, stop_sequence))
        return [SSEChunk({"call": "finish"}, "done")]

    def response(self) -> dict[str, Any]:
        return {"calls": len(self.calls)}

    def deltas(self) -> list[Any]:
        return [call[1] for call in self.calls if call[0] == "delta"]

    def finished(self) -> tuple[Any, ...]:
        assert self.calls[-1][0] == "finish"
        return self.calls[-1][1:]


@pytest.fixture(scope="module")
def tokenizer() -> LoadedTokenizer:
    return load_tokenizer(default_registry().resolve("default").tokenizer)


def _processor(
    tokenizer: LoadedTokenizer, config: ParserConfig | None = None, **kwargs: Any
) -> tuple[StreamProcessor, RecordingBuilder]:
    builder = RecordingBuilder()
    parser = OutputParser(config or ParserConfig(), id_factory=lambda: "call_1")
    return StreamProcessor(builder, parser, tokenizer, **kwargs), builder


def _text(text: str, tokens: int = 1) -> Text:
    return Text(RID, text, list(range(tokens)))


def _push_all(processor: StreamProcessor, events: list[InferenceEvent]) -> list[SSEChunk]:
    return [chunk for event in events for chunk in processor.push(event)]


# --- StreamProcessor ------------------------------------------------------------------


def test_ready_text_finish_become_start_deltas_finish(tokenizer):
    processor, builder = _processor(tokenizer)
    chunks = _push_all(
        processor,
        [
            Ready(RID, 12, 4),
            _text("Hel"),
            _text("lo"),
            Finish(RID, FinishReason.LENGTH, 2),
        ],
    )
    assert [chunk.data["call"] for chunk in chunks] == ["start", "delta", "delta", "finish"]
    assert builder.calls[0] == ("start", Usage(prompt_tokens=12, cached_tokens=4))
    assert builder.deltas() == [ContentDelta("Hel"), ContentDelta("lo")]
    kind, usage, stop = builder.finished()
    assert (kind, stop) == ("length", None)
    assert usage == Usage(prompt_tokens=12, completion_tokens=2, cached_tokens=4)
    assert processor.done and processor.error is None


@pytest.mark.parametrize(
    ("finish", "expected"),
    [
        (Finish(RID, FinishReason.STOP, 1, stop=2), ("stop", None)),
        (Finish(RID, FinishReason.STOP, 1, stop="END"), ("stop_sequence", "END")),
        # a stop string preparation added (a ruled-out tool call's markup) is a plain stop
        (Finish(RID, FinishReason.STOP, 1, stop="<tool_call>"), ("stop", None)),
        (Finish(RID, FinishReason.LENGTH, 1), ("length", None)),
        (Finish(RID, FinishReason.ABORT, 1), ("abort", None)),
    ],
)
def test_finish_reasons_map_to_finish_kinds(tokenizer, finish, expected):
    processor, builder = _processor(tokenizer)
    _push_all(processor, [Ready(RID, 3, 0), _text("x"), finish])
    kind, _, stop = builder.finished()
    assert (kind, stop) == expected


def test_a_stop_after_a_tool_call_is_a_tool_calls_finish(tokenizer):
    config = ParserConfig(tool_calls=HERMES_TOOL_CALL)
    processor, builder = _processor(tokenizer, config)
    call = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    _push_all(processor, [Ready(RID, 3, 0), _text(call[:15]), _text(call[15:])])
    _push_all(processor, [Finish(RID, FinishReason.STOP, 2, stop=0)])
    assert ToolCallStart(0, "call_1", "f") in builder.deltas()
    assert builder.finished()[0] == "tool_calls"


def test_the_end_of_the_one_allowed_tool_call_ends_the_response(tokenizer):
    config = ParserConfig(tool_calls=HERMES_TOOL_CALL, single_tool_call=True)
    processor, builder = _processor(tokenizer, config)
    first = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    _push_all(processor, [Ready(RID, 3, 0), _text(first[:20]), _text(first[20:] + "\n<tool")])
    assert processor.done
    assert [d.name for d in builder.deltas() if isinstance(d, ToolCallStart)] == ["f"]
    assert builder.finished()[0] == "tool_calls"
    assert processor.push(_text('_call>{"name": "g"')) == []


def test_reasoning_tokens_are_counted_for_usage(tokenizer):
    processor, builder = _processor(tokenizer, ParserConfig(reasoning=THINK))
    events = [
        Ready(RID, 3, 0),
        _text("<think>"),
        _text("hmm", tokens=2),
        _text("</think>"),
        _text("Answer", tokens=3),
        Finish(RID, FinishReason.STOP, 7, stop=0),
    ]
    _push_all(processor, events)
    assert builder.deltas() == [ReasoningDelta("hmm"), ContentDelta("Answer")]
    usage = builder.finished()[1]
    assert (usage.completion_tokens, usage.reasoning_tokens) == (7, 3)


def test_finish_before_ready_still_starts_the_response(tokenizer):
    processor, builder = _processor(tokenizer, prompt_tokens=9)
    _push_all(processor, [Finish(RID, FinishReason.ABORT, 0)])
    assert builder.calls[0] == ("start", Usage(prompt_tokens=9))
    assert builder.finished()[0] == "abort"


@pytest.mark.parametrize(
    ("kind", "status"), [("invalid_request", 400), ("overloaded", 503), ("internal_error", 500)]
)
def test_an_error_event_becomes_a_stream_error_and_an_api_error(tokenizer, kind, status):
    processor, _ = _processor(tokenizer)
    chunks = _push_all(processor, [Ready(RID, 3, 0), Error(RID, "boom", kind)])
    assert chunks[-1].event == "error" and chunks[-1].data["error"]["message"] == "boom"
    assert processor.done and processor.error is not None
    assert (processor.error.status, processor.error.message) == (status, "boom")


def test_events_that_end_without_a_finish_are_an_error(tokenizer):
    processor, _ = _processor(tokenizer)
    _push_all(processor, [Ready(RID, 3, 0), _text("partial")])
    chunks = processor.finish()
    assert chunks and chunks[-1].event == "error"
    assert processor.error is not None and processor.error.status == 500


def test_logprobs_are_decoded_and_ride_on_content_deltas(tokenizer):
    ids = tokenizer.tokenizer.encode(" café", add_special_tokens=False).ids
    processor, builder = _processor(tokenizer, logprobs=True)
    logprobs = [TokenLogprob(token_id, -0.5, [(token_id, -0.5)]) for token_id in ids]
    text = Text(RID, " café", ids, logprobs)
    _push_all(processor, [Ready(RID, 3, 0), text, Finish(RID, FinishReason.LENGTH, len(ids))])
    (_, delta, entries) = next(call for call in builder.calls if call[0] == "delta")
    assert delta == ContentDelta(" café")
    assert b"".join(bytes(entry.token_bytes) for entry in entries) == " café".encode()
    assert all(entry.logprob == -0.5 and len(entry.top) == 1 for entry in entries)


def test_token_pieces_keep_the_bytes_of_half_a_character(tokenizer):
    pieces = TokenPieces(tokenizer.tokenizer)
    ids = tokenizer.tokenizer.encode("🙂", add_special_tokens=False).ids
    raw = b"".join(bytes(pieces.piece(token_id)[1]) for token_id in ids)
    assert raw == "🙂".encode()


# --- the drivers: SSE, whole responses, first-event errors -------------------------


class ScriptedEvents:
    """An async iterator over fixed events that records whether it was closed."""

    def __init__(self, events: list[InferenceEvent]) -> None:
        self._events = list(events)
        self.closed = False

    def __aiter__(self) -> ScriptedEvents:
        return self

    async def __anext__(self) -> InferenceEvent:
        if self.closed or not self._events:
            raise StopAsyncIteration
        return self._events.pop(0)

    async def aclose(self) -> None:
        self.closed = True


def _run(coroutine: Any) -> Any:
    return asyncio.run(coroutine)


async def _drain(stream: AsyncIterator[Any]) -> list[Any]:
    return [item async for item in stream]


def test_sse_stream_ends_with_the_done_marker_and_closes_the_events(tokenizer):
    processor, _ = _processor(tokenizer)
    events = ScriptedEvents([Ready(RID, 3, 0), _text("hi"), Finish(RID, FinishReason.STOP, 1)])
    sent = _run(_drain(sse_stream(processor, events, "[DONE]")))
    assert len(sent) == 3  # one write per event; the last one's with the done marker
    frames = sent[-1].split(b"\r\n\r\n")
    assert frames[-2:] == [b"data: [DONE]", b""]
    assert frames[-3].startswith(b"event: done\r\n")
    assert events.closed


def test_sse_stream_stops_reading_when_the_parser_stops(tokenizer):
    config = ParserConfig(tool_calls=HERMES_TOOL_CALL, single_tool_call=True)
    processor, _ = _processor(tokenizer, config)
    call = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    events = ScriptedEvents([Ready(RID, 3, 0), _text(call + " Two"), _text(" three")])
    _run(_drain(sse_stream(processor, events)))
    assert events.closed and events._events == [_text(" three")]  # not read: cancelled


def test_closing_the_sse_stream_early_closes_the_events(tokenizer):
    processor, _ = _processor(tokenizer)
    events = ScriptedEvents([Ready(RID, 3, 0), _text("a"), _text("b")])

    async def read_one_and_leave() -> None:
        stream = sse_stream(processor, events)
        await anext(stream)
        await stream.aclose()

    _run(read_one_and_leave())
    assert events.closed


def test_collect_returns_the_response_or_raises_the_error(tokenizer):
    processor, _ = _processor(tokenizer)
    events = ScriptedEvents([Ready(RID, 3, 0), _text("a"), Finish(RID, FinishReason.STOP, 1)])
    assert _run(collect(processor, events)) == {"calls": 3}
    assert events.closed
    processor, _ = _processor(tokenizer)
    with pytest.raises(ApiError) as raised:
        _run(collect(processor, ScriptedEvents([Error(RID, "no room", "overloaded")])))
    assert raised.value.status == 503


def test_event_source_turns_a_first_error_into_a_status(tokenizer):
    processor, _ = _processor(tokenizer)
    events = ScriptedEvents([Error(RID, "prompt too long", "invalid_request")])
    with pytest.raises(ApiError) as raised:
        _run(event_source(processor, events))
    assert raised.value.status == 400 and events.closed


# --- the embedded backend ----------------------------------------------------------


class _Stats:
    def __init__(self) -> None:
        self.aborted = self.steps = self.tokens = 0


class _Scheduler:
    def __init__(self) -> None:
        self.running: list[str] = []
        self.waiting: list[str] = []


class FakeEngine:
    """One text event per request per step, forever (until aborted); records its caller."""

    def __init__(self, fail_on_step: int | None = None) -> None:
        self.tokenizer = None
        self.image_processing = None
        self.max_model_len = 64
        self.sequences: dict[str, int] = {}
        self.scheduler = _Scheduler()
        self.stats = _Stats()
        self.threads: set[int] = set()
        self.aborted_at_step: dict[str, int] = {}
        self._pending: list[InferenceEvent] = []
        self._fail_on_step = fail_on_step

    def warm_up(self, background: bool = False) -> None:
        self.threads.add(threading.get_ident())

    def add_request(
        self,
        request_id: str,
        ids: list[int],
        params: Any,
        priority: int,
        *,
        generated_token_ids: list[int] | None = None,
        emitted_chars: int = 0,
        images: Any = (),
    ) -> None:
        self.threads.add(threading.get_ident())
        if not ids:
            raise ValueError("prompt_token_ids must not be empty")
        self.sequences[request_id] = 0
        if ids == BROKEN_PROMPT:  # in, then failing: a bug, not a refusal
            raise KeyError("a table the engine expected")

    def abort(self, request_id: str) -> bool:
        self.threads.add(threading.get_ident())
        if self.sequences.pop(request_id, None) is None:
            return False
        self.aborted_at_step[request_id] = self.stats.steps
        self.stats.aborted += 1
        self._pending.append(Finish(request_id, FinishReason.ABORT, 0))
        return True

    def has_unfinished(self) -> bool:
        return bool(self.sequences or self._pending)

    def step(self) -> list[InferenceEvent]:
        self.threads.add(threading.get_ident())
        self.stats.steps += 1
        if self.stats.steps == self._fail_on_step:
            raise RuntimeError("device lost")
        events, self._pending = self._pending, []
        for request_id, count in self.sequences.items():
            if count == 0:
                events.append(Ready(request_id, 3, 0))
            events.append(Text(request_id, "x", [1]))
            self.sequences[request_id] = count + 1
        self.stats.tokens += len(self.sequences)
        return events


BROKEN_PROMPT = [13, 13]


def _wire(request_id: str, prompt: list[int] | None = None) -> PreparedRequest:
    return PreparedRequest(
        request_id, "m", [1, 2, 3] if prompt is None else prompt, SamplingParams()
    )


async def _with_backend(engine: FakeEngine, body: Any) -> Any:
    spec = default_registry().resolve("default")
    backend = EmbeddedBackend(spec, engine_factory=lambda: engine)
    await backend.start()
    try:
        for _ in range(200):
            if backend.health().ready:
                break
            await asyncio.sleep(0.01)
        return await body(backend)
    finally:
        await backend.stop()


def test_leaving_a_stream_aborts_it_before_the_next_step():
    engine = FakeEngine()

    async def read_two_and_leave(backend: EmbeddedBackend) -> list[InferenceEvent]:
        events = backend.infer(_wire("a"))
        seen = [await anext(events) for _ in range(4)]
        steps_when_left = engine.stats.steps
        await events.aclose()
        for _ in range(200):
            if backend.health().aborted:
                break
            await asyncio.sleep(0.01)
        return [seen, steps_when_left]

    seen, steps_when_left = _run(_with_backend(engine, read_two_and_leave))
    assert [type(event) for event in seen] == [Accepted, Ready, Text, Text]
    assert engine.stats.aborted == 1 and not engine.sequences
    assert engine.aborted_at_step["a"] <= steps_when_left + 1  # within one step
    assert len(engine.threads) == 1 and threading.get_ident() not in engine.threads


def test_a_refused_request_and_a_failing_step_become_error_events():
    engine = FakeEngine(fail_on_step=2)

    async def run(backend: EmbeddedBackend) -> tuple[list[Any], list[Any]]:
        refused = [event async for event in backend.infer(_wire("bad", prompt=[]))]
        failed = [event async for event in backend.infer(_wire("b"))]
        return refused, failed

    refused, failed = _run(_with_backend(engine, run))
    assert isinstance(refused[-1], Error) and refused[-1].kind == "invalid_request"
    assert isinstance(failed[-1], Error) and "device lost" in failed[-1].message
    assert not engine.sequences  # the failed request's blocks were given back


def test_an_add_that_fails_unexpectedly_ends_its_request_and_nothing_else():
    engine = FakeEngine()

    async def run(backend: EmbeddedBackend) -> tuple[list[Any], list[Any]]:
        broken_events = backend.infer(_wire("broken", BROKEN_PROMPT))
        broken = [await asyncio.wait_for(anext(broken_events), 5)]
        events = backend.infer(_wire("next"))
        after = [await anext(events) for _ in range(3)]
        await events.aclose()
        return broken, after

    broken, after = _run(_with_backend(engine, run))
    assert isinstance(broken[-1], Error) and "a table the engine expected" in broken[-1].message
    assert [type(event) for event in after] == [Accepted, Ready, Text]
    assert "broken" not in engine.sequences  # taken out again


def test_the_engine_thread_sleeps_when_idle():
    engine = FakeEngine()

    async def idle(backend: EmbeddedBackend) -> int:
        await asyncio.sleep(0.2)
        return engine.stats.steps

    assert _run(_with_backend(engine, idle)) == 0


def test_a_model_that_fails_to_load_fails_the_backend_and_errors_requests():
    def broken() -> Any:
        raise FileNotFoundError("no weights")

    async def run() -> tuple[str, Any, list[Any]]:
        backend = EmbeddedBackend(default_registry().resolve("default"), engine_factory=broken)
        await backend.start()
        try:
            reason = await asyncio.wait_for(backend.failure(), 5)
            events = [event async for event in backend.infer(_wire("a"))]
            return reason, backend.health(), events
        finally:
            await backend.stop()

    reason, health, events = _run(run())
    assert "no weights" in reason
    assert health.failed and not health.ready and "no weights" in health.detail
    assert isinstance(events[-1], Error)


class DyingEngine(FakeEngine):
    """Its thread's loop raises once a request is in: the engine thread dies."""

    def has_unfinished(self) -> bool:
        if self.sequences:
            raise RuntimeError("the loop broke")
        return False


def test_an_engine_thread_that_dies_fails_the_backend_and_ends_open_streams():
    engine = DyingEngine()

    async def run(backend: EmbeddedBackend) -> tuple[list[Any], str]:
        events = [event async for event in backend.infer(_wire("a"))]
        return events, await asyncio.wait_for(backend.failure(), 5)

    events, reason = _run(_with_backend(engine, run))
    assert isinstance(events[-1], Error) and "the loop broke" in events[-1].message
    assert "the engine died" in reason and "the loop broke" in reason


# --- through the app: engine errors get a status and the protocol's shape --------------


class ScriptedBackend(Backend):
    """A backend that answers every request with the same scripted events."""

    def __init__(self, events: list[InferenceEvent], ready: bool = True) -> None:
        spec = default_registry().resolve("default")
        self._served = ServedModel(spec, load_tokenizer(spec.tokenizer), 512)
        self._events = events
        self._ready = ready

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def health(self) -> BackendHealth:
        return BackendHealth(ready=self._ready, detail="" if self._ready else "loading the model")

    def models(self) -> list[ServedModel]:
        return [self._served]

    async def infer(self, request: PreparedRequest) -> AsyncIterator[InferenceEvent]:
        for event in self._events:
            yield replace(event, request_id=request.request_id)


def _post(backend: ScriptedBackend, path: str, **body: Any) -> Any:
    app = create_app(Settings(), backend=backend)
    payload = {"model": "default", "messages": [{"role": "user", "content": "Hi"}], **body}
    with TestClient(app) as client:
        return client.post(path, json={"max_tokens": 4, **payload})


def test_an_engine_error_in_a_whole_response_is_rendered_by_the_protocol():
    backend = ScriptedBackend([Ready(RID, 3, 0), Error(RID, "no KV blocks left", "overloaded")])
    chat = _post(backend, "/v1/chat/completions")
    assert chat.status_code == 503
    assert chat.json()["error"]["message"] == "no KV blocks left"
    messages = _post(backend, "/v1/messages")
    assert messages.status_code == 503
    assert messages.json()["type"] == "error"
    assert messages.json()["error"]["type"] == "overloaded_error"


def test_a_stream_refused_at_once_gets_a_status_not_a_200():
    backend = ScriptedBackend([Error(RID, "prompt too long", "invalid_request")])
    response = _post(backend, "/v1/chat/completions", stream=True)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "prompt too long"


def test_generation_before_the_model_is_ready_is_a_503():
    response = _post(ScriptedBackend([], ready=False), "/v1/messages")
    assert response.status_code == 503
    assert response.headers["retry-after"] == "5"
    assert response.json()["error"]["type"] == "overloaded_error"


@pytest.mark.parametrize(
    ("data", "event"),
    [
        ({"choices": [{"delta": {"content": "a\nb \u2028 ü"}}]}, None),
        ({"type": "content_block_delta", "delta": {"text": "x"}}, "content_block_delta"),
        ("[DONE]", None),
        ("two\nlines\r\nand\rthree", "message"),
        ("", None),
    ],
)
def test_sse_frames_are_the_bytes_sse_starlette_writes(data, event):
    from sse_starlette import ServerSentEvent

    from api.protocols.base import SSEChunk
    from api.streaming import chunk_data, sse_event

    chunk = SSEChunk(data, event) if event else SSEChunk(data)
    assert sse_event(chunk) == ServerSentEvent(data=chunk_data(chunk), event=event).encode()
