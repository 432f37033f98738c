"""Images for DeepSeek V4.1, prepared in the three protocols: each ``<｜image｜>`` becomes as
many image tokens as deepseek-recipe's own resolution of the same body counts, the prompt's
ids are the reference's with each placeholder so expanded, ``max_tokens`` is resolved from
that count, and each image crosses to the worker as the recipe's fitted bytes."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import deepseek_recipe as recipe
import pytest
from PIL import Image

from api.errors import ApiError
from api.images.budget import ImageTokenBudget
from api.preparation import PreparationContext, encode_request, prepare
from api.protocols import chat_completions, messages, responses
from shared.images.deepseek import image_tokens
from tests.deepseek_models import V4_TOKENIZER, preparation_context

PRO, FLASH = "DeepSeek-V4-Pro", "DeepSeek-V4.1-Flash"
IMAGE_ID = 129264
CONTEXT = 1 << 20
REQUESTS = {
    chat_completions.PROTOCOL: recipe.ChatCompletionRequest,
    responses.PROTOCOL: recipe.ResponsesRequest,
    messages.PROTOCOL: recipe.MessagesRequest,
}
TYPED = "Is <｜image｜> an image? <｜User｜>"  # the image token's spelling, typed: text


def picture(size: tuple[int, int], kind: str = "PNG", mode: str = "RGB") -> bytes:
    """A gradient, so fitting and re-encoding have something to keep."""
    width, height = size
    image = Image.linear_gradient("L").resize(size).convert(mode)
    image.paste(Image.new(mode, (width // 3 or 1, height // 3 or 1), "white"), (0, 0))
    buffer = io.BytesIO()
    image.save(buffer, kind)
    return buffer.getvalue()


PICTURES = {
    "photo": ("image/jpeg", picture((640, 480), "JPEG")),
    "tiny": ("image/png", picture((10, 10))),
    "wide": ("image/webp", picture((1200, 80), "WEBP")),
    "tall": ("image/gif", picture((60, 900), "GIF", "L")),
}


def _url(name: str) -> str:
    media, data = PICTURES[name]
    return f"data:{media};base64," + base64.b64encode(data).decode()


def _chat(name: str, detail: str | None = None) -> dict[str, Any]:
    image: dict[str, Any] = {"url": _url(name)}
    if detail is not None:
        image["detail"] = detail
    return {"type": "image_url", "image_url": image}


def _anthropic(name: str) -> dict[str, Any]:
    media, data = PICTURES[name]
    source = {"type": "base64", "media_type": media, "data": base64.b64encode(data).decode()}
    return {"type": "image", "source": source}


def _chat_bodies() -> list[dict[str, Any]]:
    text = {"type": "text", "text": "What is in it?"}
    call = {"id": "c1", "type": "function", "function": {"name": "look", "arguments": "{}"}}
    conversations = [
        [{"role": "user", "content": [text, _chat("photo")]}],
        [{"role": "user", "content": [_chat("tiny")]}],
        [{"role": "user", "content": [_chat("wide", "low"), text, _chat("tall", "high")]}],
        [{"role": "user", "content": [{"type": "text", "text": TYPED}, _chat("photo", "auto")]}],
        [
            {"role": "system", "content": "Describe pictures."},
            {"role": "user", "content": [_chat("tiny"), _chat("tiny", "low")]},
            {"role": "assistant", "content": "Two red squares.", "reasoning_content": "Look."},
            {"role": "user", "content": [text, _chat("photo", "original")]},
        ],
        [
            {"role": "user", "content": "Take a look."},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "A picture came back."},
            {"role": "user", "content": [text, _chat("tall")]},
        ],
    ]
    options: list[dict[str, Any]] = [{}, {"reasoning_effort": "none"}, {"max_tokens": 300}]
    return [{"messages": m, **o} for m in conversations for o in options]


def _responses_bodies() -> list[dict[str, Any]]:
    text = {"type": "input_text", "text": TYPED}
    image = {"type": "input_image", "image_url": _url("photo")}
    low = {"type": "input_image", "image_url": _url("wide"), "detail": "low"}
    tiny = {"type": "input_image", "image_url": _url("tiny"), "detail": "high"}
    inputs = [
        [{"role": "user", "content": [text, image]}],
        [{"role": "user", "content": [low, tiny, text]}],
    ]
    return [{"input": i, **o} for i in inputs for o in ({}, {"instructions": "Be brief."})]


def _messages_bodies() -> list[dict[str, Any]]:
    text = {"type": "text", "text": TYPED}
    use = {"type": "tool_use", "id": "t1", "name": "look", "input": {}}
    result = {"type": "tool_result", "tool_use_id": "t1", "content": [text, _anthropic("tall")]}
    conversations = [
        [{"role": "user", "content": [_anthropic("photo"), text]}],
        [{"role": "user", "content": [_anthropic("tiny"), _anthropic("wide")]}],
        [
            {"role": "user", "content": "Look at it."},
            {"role": "assistant", "content": [use]},
            {"role": "user", "content": [result]},
        ],
    ]
    options: list[dict[str, Any]] = [{}, {"thinking": {"type": "disabled"}}]
    return [{"messages": m, "max_tokens": 512, **o} for m in conversations for o in options]


CORPUS = [
    *((chat_completions.PROTOCOL, body) for body in _chat_bodies()),
    *((responses.PROTOCOL, body) for body in _responses_bodies()),
    *((messages.PROTOCOL, body) for body in _messages_bodies()),
]


@pytest.fixture(scope="module")
def context(tmp_path_factory: pytest.TempPathFactory) -> PreparationContext:
    return preparation_context(tmp_path_factory.mktemp("deepseek"), CONTEXT)


def _reference(
    protocol: Any, body: dict[str, Any], tokenizer: Path
) -> tuple[list[int], int, list[bytes]]:
    """deepseek-recipe's prompt ids for ``body`` with each placeholder expanded to its image's
    count, its ``max_tokens`` for that prompt, and its fitted images."""
    converted = REQUESTS[protocol](json.dumps(body)).convert(recipe.ConversionOptions())
    encoding = recipe.DeepseekV41Encoding()
    ids = encoding.with_tokenizer(
        recipe.Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
    ).encode(converted.conversation)
    sources = encoding.render_conversation(converted.conversation).image_sources
    resolver = recipe.ImageResolver(recipe.ReqwestImageFetcher(), recipe.OpenCvImagePreprocessor())
    resolved = resolver.resolve(sources, recipe.ImageQuota())
    counts = iter(1 + recipe.MultiModalData([i]).image_token_adjustment() for i in resolved.images)
    expanded = [
        n for token in ids for n in ([token] * next(counts) if token == IMAGE_ID else [token])
    ]
    assert len(expanded) == len(ids) + resolved.image_token_adjustment()
    max_tokens = converted.resolve_max_tokens(len(expanded), CONTEXT)
    return expanded, max_tokens, [image.data for image in resolved.images]


def test_each_protocol_s_images_are_the_reference_s(context: PreparationContext) -> None:
    tokenizer = context.models[FLASH].spec.tokenizer
    assert len(CORPUS) >= 20
    for protocol, body in CORPUS:
        body = {"model": FLASH, **body}
        wire = prepare(protocol, body, context).wire
        ids, max_tokens, fitted = _reference(protocol, body, tokenizer)
        assert wire.prompt_token_ids == ids, (
            protocol.path,
            body["messages" if "messages" in body else "input"],
        )
        assert wire.sampling.max_tokens == max_tokens
        assert [base64.b64decode(image.data) for image in wire.images] == fitted
        for image in wire.images:  # each span is one image's run of image tokens
            assert set(ids[image.start : image.end]) == {IMAGE_ID}
        assert sum(image.end - image.start for image in wire.images) == ids.count(IMAGE_ID)


def test_count_tokens_counts_each_image_s_tokens(context: PreparationContext) -> None:
    tokenizer = context.models[FLASH].spec.tokenizer
    for body in _messages_bodies():
        body = {"model": FLASH, **body}
        counted = encode_request(messages.parse_count_tokens(body), context)
        ids, _, _ = _reference(messages.PROTOCOL, body, tokenizer)
        assert len(counted.token_ids) == len(ids) and ids.count(IMAGE_ID) > 0


def test_an_image_token_count_follows_the_fitted_size(context: PreparationContext) -> None:
    """Low detail fits a photo smaller, so it takes fewer tokens; each count is the
    specification's for the fitted size."""
    counts = {}
    for detail in ("low", "high"):
        body = {"model": FLASH, "messages": [{"role": "user", "content": [_chat("photo", detail)]}]}
        [image] = prepare(chat_completions.PROTOCOL, body, context).wire.images
        fitted = Image.open(io.BytesIO(base64.b64decode(image.data)))
        assert fitted.format == "WEBP"
        counts[detail] = image.end - image.start
        assert counts[detail] == image_tokens(fitted.size)
    assert counts["low"] < counts["high"]


def test_images_take_their_tokens_from_the_budget_until_the_request_ends(
    context: PreparationContext,
) -> None:
    budget = ImageTokenBudget(4096)
    body = {
        "model": FLASH,
        "messages": [{"role": "user", "content": [_chat("photo"), _chat("tiny")]}],
    }
    with_budget = PreparationContext(context.registry, context.models, context.images, budget)
    prepared = prepare(chat_completions.PROTOCOL, body, with_budget)
    assert budget.used == sum(image.end - image.start for image in prepared.wire.images) > 0
    prepared.release()
    assert budget.used == 0


def test_an_image_the_preprocessing_refuses_is_a_400_naming_it(context: PreparationContext) -> None:
    huge = picture((8200, 16), "PNG", "L")  # wider than the specification takes
    url = "data:image/png;base64," + base64.b64encode(huge).decode()
    content = [_chat("tiny"), {"type": "image_url", "image_url": {"url": url}}]
    body = {"model": FLASH, "messages": [{"role": "user", "content": content}]}
    with pytest.raises(ApiError) as refused:
        prepare(chat_completions.PROTOCOL, body, context)
    assert refused.value.status == 400 and refused.value.message.startswith("image 1 ")
    assert "preprocessing" in refused.value.message


def test_v4_puts_unsupported_image_in_an_image_s_place(context: PreparationContext) -> None:
    content = [
        {"type": "text", "text": "What is this?"},
        _chat("tiny"),
        {"type": "text", "text": "Thanks"},
    ]
    body = {"model": PRO, "messages": [{"role": "user", "content": content}]}
    wire = prepare(chat_completions.PROTOCOL, body, context).wire
    converted = recipe.ChatCompletionRequest(json.dumps(body)).convert(recipe.ConversionOptions())
    tokenizer = recipe.Tokenizer.from_file(str(V4_TOKENIZER / "tokenizer.json"))
    ids = recipe.DeepseekV4Encoding().with_tokenizer(tokenizer).encode(converted.conversation)
    assert wire.prompt_token_ids == ids and not wire.images
    assert wire.sampling.max_tokens == converted.resolve_max_tokens(len(ids), CONTEXT)
