"""From inference events to protocol chunks, for streamed and whole responses alike.

``StreamProcessor`` is the one place that reads engine events: text goes
through the ``OutputParser`` (reasoning, tool calls, stop strings across chunk
boundaries), each parsed delta goes to the protocol's ``ResponseBuilder``, and
the finish reason is worked out once. ``sse_stream`` and ``collect`` drive the
same processor, which is why a streamed and a whole response say the same.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from dataclasses import replace
from functools import lru_cache

import anyio
from tokenizers import Tokenizer, decoders

from api.error_kinds import error_for
from api.errors import ApiError
from api.output_parser import (
    ContentDelta,
    Delta,
    OutputParser,
    ReasoningDelta,
    ToolCallsDone,
    ToolCallStart,
)
from api.protocols.base import FinishKind, LogprobEntry, ResponseBuilder, SSEChunk, Usage
from api.sse import SSEResponse
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
from shared.tokenizer_loader import LoadedTokenizer

_LINE_BREAK = re.compile(r"\r\n|\r|\n")  # where SSE splits a field into lines


class StreamProcessor:
    """Turns one request's events into protocol chunks.

    ``push`` each event, then ``finish`` when the events run out, and
    ``close`` when done (idempotent; later events are ignored). ``done`` turns
    true once the response is complete, possibly before the engine says so: the
    end of the one tool call a request allowed ends the response at once, and
    the caller
    should then stop reading (which cancels the request). After an ``Error``
    event, ``error`` holds it as an ``ApiError``.
    """

    def __init__(
        self,
        builder: ResponseBuilder,
        parser: OutputParser,
        tokenizer: LoadedTokenizer,
        *,
        prompt_tokens: int = 0,
        logprobs: bool = False,
        first_prompt_token: int | None = None,
    ) -> None:
        self._builder = builder
        self._parser = parser
        self._pieces = TokenPieces(tokenizer.tokenizer) if logprobs else None
        self._first_prompt_token = first_prompt_token  # for prompt logprobs
        self._usage = Usage(prompt_tokens=prompt_tokens)
        self._started = False
        self._in_reasoning = False
        self._tool_calls = False
        self._calls_done = False  # the one tool call allowed has ended
        self._pending_logprobs: list[LogprobEntry] = []
        self.done = False
        self.error: ApiError | None = None

    def push(self, event: InferenceEvent) -> list[SSEChunk]:
        if self.done:
            return []
        match event:
            case Accepted():
                return []  # the response may start; its first chunks wait for Ready
            case Ready():
                self._usage.prompt_tokens = event.prompt_tokens
                self._usage.cached_tokens = event.cached_tokens
                self._prompt_logprobs(event)
                return self._start()
            case Text():
                return self._text(event)
            case Finish():
                return self._finish(event)
            case Error():
                return self._error(event)
        raise TypeError(f"unknown inference event {event!r}")

    def finish(self) -> list[SSEChunk]:
        """The events ran out; a response that never saw its end reports an error."""
        if self.done:
            return []
        return self._error(Error("", "the generation ended without a finish event"))

    def close(self) -> None:
        self.done = True

    def response(self) -> dict:
        """The whole (non-stream) response; valid once ``done`` without ``error``."""
        return self._builder.response()

    @property
    def usage(self) -> Usage:
        return replace(self._usage)

    def _start(self) -> list[SSEChunk]:
        if self._started:
            return []
        self._started = True
        return self._builder.start(replace(self._usage))

    def _prompt_logprobs(self, event: Ready) -> None:
        pieces, first = self._pieces, self._first_prompt_token
        if pieces is None or first is None or event.prompt_logprobs is None:
            return
        entries = [pieces.entry(logprob) for logprob in event.prompt_logprobs]
        self._builder.prompt_logprobs(pieces.piece(first), entries)

    def _text(self, event: Text) -> list[SSEChunk]:
        chunks = self._start()
        self._usage.completion_tokens += len(event.token_ids)
        if self._pieces is not None and event.logprobs:
            self._pending_logprobs += [self._pieces.entry(lp) for lp in event.logprobs]
        deltas = self._parser.push(event.text) if event.text else []
        chunks += self._emit(deltas)
        if self._in_reasoning or any(isinstance(d, ReasoningDelta) for d in deltas):
            self._usage.reasoning_tokens += len(event.token_ids)
        if self._calls_done:  # the one tool call allowed has ended: so has the turn
            chunks += self._emit(self._parser.finish())
            chunks += self._complete("tool_calls", None)
        return chunks

    def _finish(self, event: Finish) -> list[SSEChunk]:
        chunks = self._start() + self._emit(self._parser.finish())
        self._usage.completion_tokens = max(event.completion_tokens, self._usage.completion_tokens)
        kind, stop = self._finish_kind(event)
        return chunks + self._complete(kind, stop)

    def _finish_kind(self, event: Finish) -> tuple[FinishKind, str | None]:
        if event.reason is FinishReason.STOP and event.stop in self._builder.request.stop:
            return "stop_sequence", event.stop  # not a stop the client did not ask for
        if event.reason is FinishReason.STOP:
            return ("tool_calls" if self._tool_calls else "stop"), None
        if event.reason is FinishReason.LENGTH:
            return "length", None
        return "abort", None

    def _complete(self, kind: FinishKind, stop: str | None) -> list[SSEChunk]:
        self.done = True
        return self._builder.finish(kind, replace(self._usage), stop)

    def _error(self, event: Error) -> list[SSEChunk]:
        self.error = error_for(event)  # the one table of kinds → statuses
        self.done = True
        return self._builder.stream_error(self.error)

    def _emit(self, deltas: list[Delta]) -> list[SSEChunk]:
        """Hand parsed deltas to the builder; logprobs ride on the next content delta."""
        chunks: list[SSEChunk] = []
        for delta in deltas:
            if isinstance(delta, ToolCallsDone):
                self._calls_done = True
                continue
            self._in_reasoning = isinstance(delta, ReasoningDelta)
            self._tool_calls = self._tool_calls or isinstance(delta, ToolCallStart)
            logprobs = None
            if isinstance(delta, ContentDelta) and self._pieces is not None:
                logprobs, self._pending_logprobs = self._pending_logprobs, []
            elif self._pieces is not None:
                self._pending_logprobs = []  # those tokens were reasoning or markup
            chunks += self._builder.delta(delta, logprobs)
        return chunks


class TokenPieces:
    """Token ids to the text and exact bytes clients expect in logprobs.

    A byte-level BPE token can be half a UTF-8 character, which decoding alone
    would turn into U+FFFD; its spelling maps back to the true bytes.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._byte_level = isinstance(tokenizer.decoder, decoders.ByteLevel)

    def entry(self, logprob: TokenLogprob) -> LogprobEntry:
        token, token_bytes = self.piece(logprob.token_id)
        top = [(*self.piece(token_id), value) for token_id, value in logprob.top]
        return LogprobEntry(token, token_bytes, logprob.logprob, top)

    def piece(self, token_id: int) -> tuple[str, list[int]]:
        spelling = self._tokenizer.id_to_token(token_id) or ""
        alphabet = _byte_alphabet()
        if self._byte_level and spelling and all(char in alphabet for char in spelling):
            raw = bytes(alphabet[char] for char in spelling)
        else:
            raw = self._tokenizer.decode([token_id], skip_special_tokens=False).encode()
        return raw.decode("utf-8", errors="replace"), list(raw)


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-to-character table, inverted: spelling character → byte."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    table = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in table:
            table[byte] = chr(256 + extra)
            extra += 1
    return {char: byte for byte, char in table.items()}


def chunk_data(chunk: SSEChunk) -> str:
    """The text of a chunk's ``data:`` field."""
    data = chunk.data
    return (
        data
        if isinstance(data, str)
        else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    )


def sse_event(chunk: SSEChunk) -> bytes:
    """The chunk as an SSE frame: the bytes ``ServerSentEvent(data, event).encode()`` writes,
    built directly, since it runs once per streamed token."""
    data = chunk_data(chunk)
    lines = _LINE_BREAK.split(data) if "\n" in data or "\r" in data else (data,)
    event = "" if chunk.event is None else f"event: {chunk.event}\r\n"
    return (event + "".join(f"data: {line}\r\n" for line in lines) + "\r\n").encode()


def sse_events(chunks: list[SSEChunk]) -> bytes:
    """The chunks as consecutive SSE frames, for one write."""
    return b"".join(map(sse_event, chunks))


async def sse_stream(
    processor: StreamProcessor,
    events: AsyncIterator[InferenceEvent],
    done_marker: str | None = None,
    first: list[SSEChunk] | None = None,
) -> AsyncIterator[bytes]:
    """The SSE body of one streamed response: one write per event, its chunks together
    (a response's last event, its end and the done marker in one).

    Ownership: this generator owns ``events`` and ``processor``. However it
    ends (finished, a parser stop, the client gone and the response task
    cancelled) its ``finally`` closes ``events`` inside a shielded cancel
    scope, so the close runs to completion even during cancellation, and
    closing the backend's iterator is what cancels the request in the engine.
    ``first`` holds the chunks of events the caller already pushed.
    """
    try:
        if first:
            yield sse_events(first)
        last: list[SSEChunk] = []
        if not processor.done:
            async for event in events:
                chunks = processor.push(event)
                if processor.done:
                    last = chunks
                    break
                if chunks:
                    yield sse_events(chunks)
        last += processor.finish()
        if done_marker is not None:
            last.append(SSEChunk(done_marker))
        if last:
            yield sse_events(last)
    finally:
        with anyio.CancelScope(shield=True):
            await _aclose(events)
        processor.close()


async def event_source(
    processor: StreamProcessor,
    events: AsyncIterator[InferenceEvent],
    done_marker: str | None = None,
) -> SSEResponse:
    """The streamed response, once the first event has come: most often ``Accepted``,
    as an engine takes the request in, before its prompt is computed.

    Waiting for it lets a request the backend refuses (an ``Error`` first: a
    prompt the engine cannot run, no worker by the queue deadline) get a real
    status code and the protocol's error body instead of an error inside a 200
    stream. Not waiting for more lets the response's start go out while the
    prompt is computed, not in the same moment as its first token and every
    other stream's of that step. The wait can be long (a job queued behind busy
    workers) and no one but the caller can see the client leave meanwhile, so
    the caller cancels this when it does (``api.app._unless_client_leaves``);
    ``events`` is closed on that exit too, which cancels the request before it
    runs. Once the response is returned, ``sse_stream`` owns ``events``.
    """
    try:
        first = await anext(events, None)
        chunks = processor.push(first) if first is not None else []
    except BaseException:
        with anyio.CancelScope(shield=True):
            await _aclose(events)
        raise
    if processor.error is not None:
        with anyio.CancelScope(shield=True):
            await _aclose(events)
        raise processor.error
    return SSEResponse(sse_stream(processor, events, done_marker, chunks), sep="\n")


async def collect(processor: StreamProcessor, events: AsyncIterator[InferenceEvent]) -> dict:
    """The whole response body, or the ``ApiError`` an ``Error`` event carried.

    Owns ``events`` like ``sse_stream`` does: closed in a shielded scope on
    every exit, which cancels the request if it did not finish.
    """
    try:
        async for event in events:
            processor.push(event)
            if processor.done:
                break
        processor.finish()
    finally:
        with anyio.CancelScope(shield=True):
            await _aclose(events)
        processor.close()
    if processor.error is not None:
        raise processor.error
    return processor.response()


async def _aclose(events: AsyncIterator[InferenceEvent]) -> None:
    close = getattr(events, "aclose", None)
    if close is not None:
        await close()
