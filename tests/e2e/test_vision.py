"""A vision model behind the server, through the official SDKs: images seen, fetched safely.

The server serves a random-weight Idefics3 checkpoint built by transformers
(``bench.vision_model``) and may fetch from 127.0.0.2 only
(``--image-allow``). Two recording image servers run: one on 127.0.0.2, whose
pictures the model sees, and one on 127.0.0.1, which every refused spelling
points at and which must receive no request at all.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest

from bench.vision_model import vision_model_options
from tests.image_server import ImageServer, image_server, png_bytes
from tests.servers import running_server

MAX_IMAGES = 3
IMAGE_TOKEN_BUDGET = 150  # one picture of these sizes (82 or 107 tokens) fits, two do not


@pytest.fixture(scope="module")
def allowed() -> Iterator[ImageServer]:
    with image_server("127.0.0.2") as server:
        yield server


@pytest.fixture(scope="module")
def forbidden() -> Iterator[ImageServer]:
    with image_server("127.0.0.1") as server:
        yield server


@pytest.fixture(scope="module")
def seer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    directory = tmp_path_factory.mktemp("seer")
    args = [*vision_model_options(directory), "--max-model-len", "1024"]
    args += ["--max-num-seqs", "4", "--image-allow", "127.0.0.2"]
    args += ["--max-images", str(MAX_IMAGES), "--image-fetch-timeout", "1"]
    args += ["--image-token-budget", str(IMAGE_TOKEN_BUDGET)]
    with running_server(args, directory) as base_url:
        yield base_url


@pytest.fixture
def client(seer: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{seer}/v1", api_key="sk-local", max_retries=0)


def data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


def pictured(*urls: str) -> list[dict]:
    parts: list[dict] = [{"type": "text", "text": "What is in this picture?"}]
    parts += [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return [{"role": "user", "content": parts}]


def ask(client: openai.OpenAI, *urls: str) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(
        model="seer", messages=pictured(*urls), max_tokens=8, temperature=0, logprobs=True
    )


def logprobs(completion: openai.types.chat.ChatCompletion) -> list[float]:
    content = completion.choices[0].logprobs.content  # type: ignore[union-attr]
    return [entry.logprob for entry in content or []]


def test_a_fetched_image_is_seen_like_the_same_image_inline(
    seer: str, client: openai.OpenAI, allowed: ImageServer
):
    allowed.image = png_bytes(48, 40, (20, 120, 220))
    fetched = ask(client, f"{allowed.base}/image.png")
    inline = ask(client, data_url(allowed.image))
    other = ask(client, data_url(png_bytes(48, 40, (250, 250, 0))))
    assert allowed.paths == ["/image.png"]
    assert fetched.choices[0].message.content == inline.choices[0].message.content
    assert logprobs(fetched) == pytest.approx(logprobs(inline), abs=1e-4)
    assert logprobs(other) != pytest.approx(logprobs(inline), abs=1e-3)  # the pixels count

    body = {"model": "seer", "messages": pictured(data_url(allowed.image))}
    tokenized = httpx.post(f"{seer}/v1/tokenize", json=body, timeout=30).json()
    text_only = {"model": "seer", "messages": pictured()}
    text_count = httpx.post(f"{seer}/v1/tokenize", json=text_only, timeout=30).json()["count"]
    assert fetched.usage is not None
    assert fetched.usage.prompt_tokens == tokenized["count"]  # the image's tokens included
    assert tokenized["count"] > text_count + 4 * 13  # 13 tiles of 4 tokens, and their markers


def test_anthropic_images_are_seen_and_counted(seer: str):
    client = anthropic.Anthropic(base_url=seer, api_key="sk-local", max_retries=0)
    source = {
        "type": "base64",
        "media_type": "image/png",
        "data": base64.b64encode(png_bytes()).decode(),
    }
    content = [{"type": "text", "text": "Describe it."}, {"type": "image", "source": source}]
    messages = [{"role": "user", "content": content}]
    counted = client.messages.count_tokens(model="seer", messages=messages)
    message = client.messages.create(model="seer", max_tokens=4, messages=messages)
    assert message.usage.input_tokens == counted.input_tokens > 40


def refused_urls(forbidden: ImageServer, allowed: ImageServer) -> list[str]:
    port = forbidden.port
    loopback = [
        f"http://127.0.0.1:{port}/image.png",
        f"http://localhost:{port}/image.png",
        f"http://[::1]:{port}/image.png",
        f"http://2130706433:{port}/image.png",  # decimal
        f"http://0x7f000001:{port}/image.png",  # hex
        f"http://0177.0.0.1:{port}/image.png",  # octal
        f"http://127.1:{port}/image.png",
        f"http://0.0.0.0:{port}/image.png",
        f"http://[::ffff:127.0.0.1]:{port}/image.png",
    ]
    private = [
        "http://10.0.0.1/image.png",
        "http://192.168.1.1/image.png",
        "http://172.16.0.1/image.png",
        "http://169.254.169.254/latest/meta-data/",
        "http://100.64.0.1/image.png",
        "http://[fd00:ec2::254]/image.png",
    ]
    redirect = f"{allowed.base}/redirect?to=http://127.0.0.1:{port}/image.png"
    return [*loopback, *private, redirect]


def test_refused_destinations_are_400s_and_never_reached(
    client: openai.OpenAI, forbidden: ImageServer, allowed: ImageServer
):
    for url in refused_urls(forbidden, allowed):
        with pytest.raises(openai.BadRequestError) as refused:
            ask(client, url)
        assert refused.value.code == "invalid_image_url", url
        assert "image 0" in refused.value.message, url
    for url in ("file:///etc/passwd", f"ftp://127.0.0.1:{forbidden.port}/image.png"):
        with pytest.raises(openai.BadRequestError) as refused:  # refused while parsing
            ask(client, url)
        assert "must be an http(s) URL" in refused.value.message
    assert forbidden.paths == []


@pytest.mark.parametrize(
    ("path", "status", "code"),
    [
        ("/status/404", 502, "image_fetch_failed"),
        ("/status/500", 502, "image_fetch_failed"),
        ("/slow", 504, "image_fetch_timeout"),
        ("/garbage.png", 400, "invalid_image"),
        ("/page.html", 400, "invalid_image_url"),
    ],
)
def test_fetch_failures_are_5xx_and_bad_images_400(
    client: openai.OpenAI, allowed: ImageServer, path: str, status: int, code: str
):
    with pytest.raises(openai.APIStatusError) as failed:
        ask(client, data_url(png_bytes()), f"{allowed.base}{path}")
    assert failed.value.status_code == status
    assert failed.value.code == code
    assert "image 1" in failed.value.message  # by position


def test_too_many_images_is_a_400_naming_the_limit(client: openai.OpenAI):
    urls = [data_url(png_bytes(8, 8, (i, i, i))) for i in range(MAX_IMAGES + 1)]
    with pytest.raises(openai.BadRequestError) as refused:
        ask(client, *urls)
    assert refused.value.code == "limit_exceeded"
    assert "--max-images" in refused.value.message and str(MAX_IMAGES) in refused.value.message


def test_a_vision_model_sees_images_in_the_anthropic_error_shape_too(seer: str, allowed):
    client = anthropic.Anthropic(base_url=seer, api_key="sk-local", max_retries=0)
    image = {"type": "image", "source": {"type": "url", "url": f"{allowed.base}/status/500"}}
    with pytest.raises(anthropic.APIStatusError) as failed:
        client.messages.create(
            model="seer", max_tokens=4, messages=[{"role": "user", "content": [image]}]
        )
    assert failed.value.status_code == 502
    assert failed.value.body["type"] == "error"
    assert "image 0" in failed.value.body["error"]["message"]


def test_images_over_the_server_s_token_budget_are_a_400(client: openai.OpenAI):
    with pytest.raises(openai.BadRequestError) as refused:
        ask(client, data_url(png_bytes(48, 40)), data_url(png_bytes(32, 24)))
    assert "--image-token-budget" in refused.value.message
    assert f"budget of {IMAGE_TOKEN_BUDGET}" in refused.value.message


def test_the_responses_api_sees_images_too(client: openai.OpenAI):
    image = data_url(png_bytes(48, 40, (20, 120, 220)))
    content = [
        {"type": "input_text", "text": "What is in this picture?"},
        {"type": "input_image", "image_url": image, "detail": "auto"},
    ]
    response = client.responses.create(
        model="seer",
        input=[{"role": "user", "content": content}],
        max_output_tokens=8,
        temperature=0,
    )
    chat = ask(client, image)
    assert response.output_text == chat.choices[0].message.content
    assert response.usage is not None and chat.usage is not None
    assert response.usage.input_tokens == chat.usage.prompt_tokens
