"""Several choices in one response: ``n`` in Chat Completions and Completions, and several
prompts in Completions. One generation per choice.

The protocol splits the body into one body per choice (``Protocol.choice_bodies``:
per prompt, ``n`` each, seeded ``seed + i``). Each is prepared and run as a
request of its own (its own engine request id, its choice's ``index`` in the
chunks); the response joins them. Whole: the first choice's body with every
choice, in order, and the usage joined (a prompt's tokens counted once however
many choices it has). Streamed: the choices' chunks interleave as they come,
each choice's finish chunk ends it, then one usage chunk (when asked for) and
``[DONE]``. The request holds one admission place and one share of its key's
limits, sized for every choice; the client leaving, or one choice failing,
ends them all.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import anyio
from fastapi import Request, Response
from fastapi.responses import JSONResponse

from api.access_log import AccessRecord
from api.auth import caller_key
from api.errors import bad_request
from api.preparation import Prepared, new_request_id
from api.protocols.base import Protocol, SSEChunk, Usage
from api.protocols.openai_common import MAX_CHOICES, chat_usage
from api.serving import Serving
from api.sse import SSEResponse
from api.streaming import StreamProcessor, collect, sse_event
from shared.events import InferenceEvent


class JoinedUsage:
    """What the access log reads of a response: every choice's completion tokens summed, and
    the prompt tokens of each choice that ``counts_prompt`` (one per distinct prompt)."""

    def __init__(self, processors: list[StreamProcessor], counts_prompt: list[bool]) -> None:
        self.processors = processors
        self.counts_prompt = counts_prompt

    @property
    def usage(self) -> Usage:
        total = Usage()
        for processor, counts in zip(self.processors, self.counts_prompt, strict=True):
            usage = processor.usage
            total.completion_tokens += usage.completion_tokens
            if counts:
                total.prompt_tokens += usage.prompt_tokens
                total.cached_tokens += usage.cached_tokens
        return total


def choice_bodies(protocol: Protocol, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The body of each choice ``body`` asks for (``[body]`` for a single one)."""
    if protocol.choice_bodies is None:
        return [body]
    bodies = protocol.choice_bodies(body)
    if len(bodies) > MAX_CHOICES:
        raise bad_request(
            f"a request may ask for at most {MAX_CHOICES} choices (prompts times n), "
            f"got {len(bodies)}",
            "n",
            "limit_exceeded",
        )
    return bodies


async def start(
    serving: Serving,
    protocol: Protocol,
    request: Request,
    bodies: list[dict[str, Any]],
    arrived: float,
    per_prompt: int = 1,
) -> Awaitable[Response]:
    """Admit, prepare and start every choice's generation (``per_prompt`` of them for each
    prompt, in order); the answer, to await."""
    access: AccessRecord = request.state.access
    access.place = await serving.admit(bodies[0])
    key = caller_key(request)
    response_id = new_request_id(protocol)
    prepared: list[Prepared] = []
    for index, body in enumerate(bodies):
        ready = await serving.prepare(protocol, body, f"{response_id}-{index}", key)
        ready.context.request_id, ready.context.choice = response_id, index
        prepared.append(ready)
    first = prepared[0]
    include_usage = first.request.include_usage
    for ready in prepared:
        ready.request.include_usage = False  # one usage chunk for all, at the end
    wire = [ready.wire for ready in prepared]
    tokens = sum(len(w.prompt_token_ids) + w.sampling.max_tokens for w in wire)
    access.rate_limits = await serving.limit(key, first, tokens=tokens)
    runs = [
        serving.run(ready, arrived, access.rate_limits if index == 0 else None)
        for index, ready in enumerate(prepared)
    ]
    counts_prompt = [index % per_prompt == 0 for index in range(len(prepared))]
    joined = JoinedUsage([processor for processor, _ in runs], counts_prompt)
    access.model, access.processor = first.request.model, joined  # type: ignore[assignment]
    access.response_id = response_id
    if first.request.stream:
        return _streamed(runs, first, joined, include_usage)
    return _whole(runs, joined)


async def _streamed(
    runs: list[tuple[StreamProcessor, AsyncIterator[InferenceEvent]]],
    first: Prepared,
    joined: JoinedUsage,
    include_usage: bool,
) -> Response:
    return SSEResponse(_interleaved(runs, first, joined, include_usage), sep="\n")


async def _whole(
    runs: list[tuple[StreamProcessor, AsyncIterator[InferenceEvent]]], joined: JoinedUsage
) -> Response:
    """Every choice's body, collected together; a failing choice cancels the others."""
    bodies: list[dict[str, Any]] = [{} for _ in runs]

    async def one(index: int) -> None:
        processor, events = runs[index]
        bodies[index] = await collect(processor, events)

    async with anyio.create_task_group() as group:
        for index in range(len(runs)):
            group.start_soon(one, index)
    body = bodies[0]
    body["choices"] = [choice for each in bodies for choice in each["choices"]]
    body["usage"] = chat_usage(joined.usage)
    return JSONResponse(body)


async def _interleaved(
    runs: list[tuple[StreamProcessor, AsyncIterator[InferenceEvent]]],
    first: Prepared,
    joined: JoinedUsage,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    """The choices' chunks as they come.

    Each choice is pumped by a task of its own, which closes its events however it
    ends; this generator cancels them when it is closed early (the client left).
    No task group spans a ``yield``: the generator may be closed from another task.
    """
    chunks: asyncio.Queue[SSEChunk | None] = asyncio.Queue()  # None: a choice ended

    async def pump(processor: StreamProcessor, events: AsyncIterator[InferenceEvent]) -> None:
        try:
            async for event in events:
                for chunk in processor.push(event):
                    chunks.put_nowait(chunk)
                if processor.done:
                    break
            for chunk in processor.finish():
                chunks.put_nowait(chunk)
        finally:
            with anyio.CancelScope(shield=True):
                await events.aclose()  # type: ignore[attr-defined]
            processor.close()
            chunks.put_nowait(None)

    tasks = [asyncio.create_task(pump(processor, events)) for processor, events in runs]
    try:
        ended = 0
        while ended < len(tasks):
            chunk = await chunks.get()
            if chunk is None:
                ended += 1
            else:
                yield sse_event(chunk)
        if include_usage:
            yield sse_event(SSEChunk(_usage_chunk(first, joined)))
        yield sse_event(SSEChunk(first.protocol.done_marker or "[DONE]"))
    finally:
        for task in tasks:
            task.cancel()


def _usage_chunk(first: Prepared, joined: JoinedUsage) -> dict[str, Any]:
    context = first.context
    return {
        "id": context.request_id,
        "object": first.protocol.chunk_object,
        "created": context.created,
        "model": context.model,
        "system_fingerprint": context.system_fingerprint,
        "choices": [],
        "usage": chat_usage(joined.usage),
    }
