"""The image-token budget: reserved from the headers before decoding, held while a request
runs, given back however it ends; a 503 past it, a 400 for what never fits."""

from __future__ import annotations

import asyncio
import base64
import gc
import io
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from PIL import Image

import api.images.resolution as resolution
from api.auth import ApiKey
from api.backends.base import Backend, BackendHealth, ServedModel
from api.errors import ApiError
from api.images.budget import DecodingBudget, ImageTokenBudget
from api.images.resolution import ImageOptions
from api.preparation import PreparationContext, prepare
from api.protocols import chat_completions
from api.serving import Serving
from api.settings import Settings
from bench.vision_model import make_idefics3
from shared.events import Finish, FinishReason, InferenceEvent, Ready, Text
from shared.images.layout import image_ids
from shared.images.loading import load_image_processing
from shared.registry import ModelRegistry, ModelSpec
from shared.tokenizer_loader import load_tokenizer
from shared.wire import PreparedRequest
from tests.image_server import png_bytes


async def generation(gate: asyncio.Event) -> AsyncIterator[InferenceEvent]:
    yield Text("r", "a", [1])
    await gate.wait()
    yield Finish("r", FinishReason.STOP, 1)


def test_the_budget_is_held_while_a_request_runs_and_refuses_past_it():
    async def scenario() -> None:
        budget, gate = ImageTokenBudget(100), asyncio.Event()
        first = budget.reserve(60).held_during(generation(gate))
        assert isinstance(await anext(first), Text) and budget.used == 60
        with pytest.raises(ApiError) as refused:
            budget.reserve(50)
        assert refused.value.status == 503 and refused.value.headers == {"Retry-After": "1"}
        assert "retry later" in refused.value.message and budget.used == 60
        fits = budget.reserve(40).held_during(generation(gate))
        assert isinstance(await anext(fits), Text) and budget.used == 100
        gate.set()
        assert isinstance([e async for e in first][-1], Finish)
        assert isinstance([e async for e in fits][-1], Finish)
        assert budget.used == 0
        assert budget.reserve(50).tokens == 50

    asyncio.run(scenario())


def test_images_that_can_never_fit_are_the_client_s_to_change():
    budget = ImageTokenBudget(100)
    with pytest.raises(ApiError) as refused:
        budget.reserve(110)
    assert (refused.value.status, refused.value.code) == (400, "limit_exceeded")
    assert "110 image tokens" in refused.value.message
    assert "budget of 100 (--image-token-budget)" in refused.value.message
    assert budget.used == 0


def test_a_closed_stream_gives_its_tokens_back():
    async def scenario() -> int:
        budget = ImageTokenBudget(100)
        events = budget.reserve(60).held_during(generation(asyncio.Event()))
        await anext(events)
        await events.aclose()
        return budget.used

    assert asyncio.run(scenario()) == 0


def test_a_reservation_settles_to_its_exact_count_up_or_down():
    budget = ImageTokenBudget(100)
    tokens, other = budget.reserve(50), budget.reserve(30)
    tokens.settle(65)  # images that took more than expected take the rest, while it is free
    assert (tokens.tokens, budget.used) == (65, 95)
    with pytest.raises(ApiError) as busy:
        tokens.settle(75)
    assert busy.value.status == 503 and (tokens.tokens, budget.used) == (65, 95)
    other.release()
    with pytest.raises(ApiError) as never:
        tokens.settle(101)
    assert never.value.status == 400 and "101 image tokens" in never.value.message
    tokens.settle(10)
    assert budget.used == 10
    tokens.release()
    assert budget.used == 0


def test_a_reservation_is_given_back_once_however_it_ends():
    budget = ImageTokenBudget(100)
    tokens = budget.reserve(60)
    tokens.settle(45)
    assert (tokens.tokens, budget.used) == (45, 45)
    tokens.release()
    tokens.release()
    assert budget.used == 0
    never_run = budget.reserve(70).held_during(generation(asyncio.Event()))  # never started
    assert budget.used == 70
    del never_run
    gc.collect()
    assert budget.used == 0  # dropped unreleased: given back when collected


def test_threads_reserving_at_once_never_exceed_the_budget():
    budget, seen = ImageTokenBudget(100), []

    def churn() -> None:
        for _ in range(2000):
            try:
                tokens = budget.reserve(30)
            except ApiError:
                continue
            seen.append(budget.used)
            tokens.release()

    threads = [threading.Thread(target=churn) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert seen and max(seen) <= 100 and budget.used == 0


# --- reserved by preparation, before decoding --------------------------------------


@pytest.fixture(scope="module")
def seer(tmp_path_factory: pytest.TempPathFactory) -> ServedModel:
    weights = make_idefics3(tmp_path_factory.mktemp("vlm"), weights=False)
    spec = ModelSpec("seer", weights, capabilities=frozenset({"images"}))
    return ServedModel(spec, load_tokenizer(weights), 600, load_image_processing(weights))


def context(
    seer: ServedModel, budget: ImageTokenBudget, images: ImageOptions | None = None
) -> PreparationContext:
    registry = ModelRegistry([seer.spec])
    return PreparationContext(registry, {"seer": seer}, images or ImageOptions(), budget)


def body(*images: bytes, **fields: Any) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": "What is it?"}]
    for data in images:
        url = "data:image/png;base64," + base64.b64encode(data).decode()
        parts.append({"type": "image_url", "image_url": {"url": url}})
    return {"model": "seer", "messages": [{"role": "user", "content": parts}], **fields}


def span(seer: ServedModel, size: tuple[int, int]) -> int:
    assert seer.image_processing is not None
    return len(image_ids(size, seer.image_processing, seer.tokenizer))


@pytest.fixture
def no_decoding(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Fails the test if preparation decodes an image; the images it would have decoded."""
    decoded: list[bytes] = []

    def decode(image: Image.Image, data: bytes) -> None:
        decoded.append(data)
        raise AssertionError("an image was decoded")

    monkeypatch.setattr(resolution.DecodedImage, "of", decode)
    return decoded


def test_a_prepared_request_holds_its_images_exact_tokens(seer: ServedModel):
    budget = ImageTokenBudget(1000)
    prepared = prepare(chat_completions.PROTOCOL, body(png_bytes(48, 40)), context(seer, budget))
    (image,) = prepared.wire.images
    assert image.end - image.start == span(seer, (48, 40))
    assert prepared.image_tokens is not None
    assert budget.used == prepared.image_tokens.tokens == image.end - image.start
    prepared.release()
    assert budget.used == 0


def test_a_turned_image_reserves_either_way_up_then_keeps_what_it_takes(seer: ServedModel):
    """The header gives 300x40; the EXIF orientation, read while decoding, turns it 40x300."""
    exif = Image.Exif()
    exif[0x0112] = 6
    buffer = io.BytesIO()
    Image.new("RGB", (300, 40), (9, 9, 9)).save(buffer, "PNG", exif=exif)
    either = max(span(seer, (300, 40)), span(seer, (40, 300)))
    assert span(seer, (300, 40)) != span(seer, (40, 300))  # rows and columns differ
    budget = ImageTokenBudget(either)
    prepared = prepare(chat_completions.PROTOCOL, body(buffer.getvalue()), context(seer, budget))
    (image,) = prepared.wire.images
    assert image.end - image.start == span(seer, (40, 300)) == budget.used
    prepared.release()


def test_low_detail_is_refused_by_a_model_that_reads_images_at_full_resolution(
    seer: ServedModel, no_decoding: list[bytes]
):
    budget = ImageTokenBudget(1000)
    request = body(png_bytes(48, 40))
    request["messages"][0]["content"][1]["image_url"]["detail"] = "low"
    with pytest.raises(ApiError) as refused:
        prepare(chat_completions.PROTOCOL, request, context(seer, budget))
    assert refused.value.status == 400 and refused.value.param == "detail"
    assert "detail 'low' is not supported by model 'seer'" in refused.value.message
    assert no_decoding == [] and budget.used == 0


def test_images_over_the_budget_left_are_a_503_before_any_is_decoded(
    seer: ServedModel, no_decoding: list[bytes]
):
    budget = ImageTokenBudget(span(seer, (7000, 7000)) + 10)
    others = budget.reserve(20)  # another request runs
    huge = io.BytesIO()
    Image.new("1", (7000, 7000)).save(huge, "PNG")
    started = time.process_time()
    with pytest.raises(ApiError) as refused:
        prepare(chat_completions.PROTOCOL, body(huge.getvalue()), context(seer, budget))
    assert time.process_time() - started < 1  # the header only: decoding takes seconds
    assert refused.value.status == 503 and refused.value.headers == {"Retry-After": "1"}
    assert "--image-token-budget" in refused.value.message
    assert no_decoding == [] and budget.used == 20
    others.release()


def test_images_over_the_whole_budget_are_a_400_before_any_is_decoded(
    seer: ServedModel, no_decoding: list[bytes]
):
    budget = ImageTokenBudget(150)
    with pytest.raises(ApiError) as refused:
        images = body(png_bytes(48, 40), png_bytes(32, 24))
        prepare(chat_completions.PROTOCOL, images, context(seer, budget))
    assert refused.value.status == 400 and "budget of 150" in refused.value.message
    assert no_decoding == [] and budget.used == 0


def test_the_reservation_is_given_back_when_decoding_fails(seer: ServedModel):
    budget = ImageTokenBudget(1000)
    buffer = io.BytesIO()
    Image.effect_noise((64, 64), 50).convert("RGB").save(buffer, "PNG")
    truncated = buffer.getvalue()[:-200]  # a sound header, pixels cut short
    with pytest.raises(ApiError) as refused:
        prepare(chat_completions.PROTOCOL, body(truncated), context(seer, budget))
    assert (refused.value.status, refused.value.code) == (400, "invalid_image")
    assert budget.used == 0


def test_the_reservation_is_given_back_when_decoding_finds_no_room(seer: ServedModel):
    budget, decoding = ImageTokenBudget(1000), DecodingBudget(1000, wait_s=0.05)
    images = ImageOptions(decoding=decoding)
    with decoding.holding(1000, time.monotonic() + 1), pytest.raises(ApiError) as refused:
        prepare(chat_completions.PROTOCOL, body(png_bytes()), context(seer, budget, images))
    assert refused.value.status == 503 and budget.used == 0


def test_the_reservation_is_given_back_when_a_later_step_fails(seer: ServedModel):
    budget = ImageTokenBudget(1000)
    with pytest.raises(ApiError) as refused:
        too_long = body(png_bytes(), max_tokens=600)
        prepare(chat_completions.PROTOCOL, too_long, context(seer, budget))
    assert refused.value.code == "context_length_exceeded" and budget.used == 0


def test_counting_tokens_reserves_none(seer: ServedModel):
    from api.preparation import encode_request

    budget = ImageTokenBudget(1)
    request = chat_completions.PROTOCOL.parse(body(png_bytes()))
    encoded = encode_request(request, context(seer, budget))
    assert encoded.images and encoded.image_tokens is None and budget.used == 0


# --- held by the server until the request ends -------------------------------------


class GatedBackend(Backend):
    """Serves ``seer``; each request yields once, then waits for ``gate`` to finish."""

    def __init__(self, seer: ServedModel) -> None:
        self.seer = seer
        self.gate = asyncio.Event()

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def health(self) -> BackendHealth:
        return BackendHealth(ready=True)

    def models(self) -> list[ServedModel]:
        return [self.seer]

    async def infer(self, request: PreparedRequest) -> AsyncIterator[InferenceEvent]:
        yield Ready(request.request_id, len(request.prompt_token_ids), 0)
        await self.gate.wait()
        yield Finish(request.request_id, FinishReason.STOP, 0)


def test_the_server_holds_the_reservation_until_the_request_ends(seer: ServedModel):
    async def scenario() -> None:
        backend = GatedBackend(seer)
        serving = Serving(ModelRegistry([seer.spec]), backend, Settings(image_token_budget=500))
        budget = serving.image_tokens
        prepared = await serving.prepare(chat_completions.PROTOCOL, body(png_bytes()), "a")
        held = budget.used
        assert held == prepared.image_tokens.tokens > 0  # type: ignore[union-attr]
        _, events = serving.run(prepared, time.monotonic())
        await anext(events)
        assert budget.used == held  # running
        backend.gate.set()
        assert [event async for event in events] and budget.used == 0

        elsewhere = ApiKey("k", b"", models=frozenset({"another"}))
        with pytest.raises(ApiError) as refused:
            await serving.prepare(chat_completions.PROTOCOL, body(png_bytes()), "b", elsewhere)
        assert refused.value.status == 404 and budget.used == 0
        serving.pool.close()

    asyncio.run(scenario())


def test_the_server_decodes_within_one_budget_that_waits_as_long_as_preparation(
    seer: ServedModel,
):
    backend = GatedBackend(seer)
    serving = Serving(ModelRegistry([seer.spec]), backend, Settings(prepare_timeout_s=7.0))
    context = serving.context()
    assert context.images.decoding is serving.images.decoding
    assert context.images.decoding.wait_s == 7.0 and context.image_tokens is serving.image_tokens
    serving.pool.close()
