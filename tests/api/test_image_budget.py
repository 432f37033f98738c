"""The image-token budget: held while a request runs, a 503 past it, a 400 for what never fits."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from api.images.budget import ImageTokenBudget
from shared.events import Error, Finish, FinishReason, InferenceEvent, Text
from shared.sampling import SamplingParams
from shared.wire import PreparedRequest, WireImage


def request(request_id: str, *spans: int) -> PreparedRequest:
    images = [WireImage("", "00", 10 * i, 10 * i + n) for i, n in enumerate(spans)]
    return PreparedRequest(request_id, "m", [1] * 100, SamplingParams(), images=images)


async def generation(request_id: str, gate: asyncio.Event) -> AsyncIterator[InferenceEvent]:
    yield Text(request_id, "a", [1])
    await gate.wait()
    yield Finish(request_id, FinishReason.STOP, 1)


def test_the_budget_is_held_while_a_request_runs_and_refuses_past_it():
    async def scenario() -> None:
        budget, gate = ImageTokenBudget(100), asyncio.Event()
        first = budget.hold(request("a", 60), generation("a", gate))
        assert isinstance(await anext(first), Text) and budget.used == 60
        refused = [e async for e in budget.hold(request("b", 50), generation("b", gate))]
        assert len(refused) == 1 and isinstance(refused[0], Error)
        assert refused[0].kind == "overloaded" and "retry later" in refused[0].message
        fits = budget.hold(request("c", 40), generation("c", gate))
        assert isinstance(await anext(fits), Text) and budget.used == 100
        gate.set()
        assert isinstance([e async for e in first][-1], Finish)
        assert isinstance([e async for e in fits][-1], Finish)
        assert budget.used == 0
        after = [e async for e in budget.hold(request("d", 50), generation("d", gate))]
        assert isinstance(after[-1], Finish)

    asyncio.run(scenario())


def test_images_that_can_never_fit_are_the_client_s_to_change():
    async def scenario() -> Error:
        budget = ImageTokenBudget(100)
        events = [
            e async for e in budget.hold(request("a", 60, 50), generation("a", asyncio.Event()))
        ]
        assert len(events) == 1 and budget.used == 0
        assert isinstance(events[0], Error)
        return events[0]

    error = asyncio.run(scenario())
    assert error.kind == "invalid_request"
    assert "110 image tokens" in error.message and "--image-token-budget" in error.message


def test_a_closed_stream_gives_its_tokens_back():
    async def scenario() -> int:
        budget = ImageTokenBudget(100)
        events = budget.hold(request("a", 60), generation("a", asyncio.Event()))
        await anext(events)
        await events.aclose()
        return budget.used

    assert asyncio.run(scenario()) == 0
