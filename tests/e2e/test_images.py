"""Images sent to text-only models through the official SDKs: refused, or read as a placeholder.

The session's server serves the default model, which refuses images. A
second server serves the same GGUF under an entry with ``images =
"placeholder"``: each image becomes the text ``[Unsupported Image]`` and is
never fetched, which the recording image server proves.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest

from shared.registry import smollm2_gguf_path
from tests.image_server import ImageServer, image_server, png_bytes
from tests.servers import running_server

QUESTION = "What is in this picture?"


@pytest.fixture(scope="module")
def served_images() -> Iterator[ImageServer]:
    with image_server() as server:
        yield server


@pytest.fixture(scope="module")
def blind(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    directory = tmp_path_factory.mktemp("blind")
    config = directory / "models.toml"
    config.write_text(
        f'[models.blind]\nweights = "{smollm2_gguf_path()}"\nprompt_format = "chatml"\n'
        'images = "placeholder"\n'
    )
    args = ["--config", str(config), "--model", "blind", "--max-model-len", "1024"]
    args += ["--max-num-seqs", "2", "--image-allow", "127.0.0.1"]
    with running_server(args, directory) as base_url:
        yield base_url


def _image_message(url: str) -> list[dict]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": QUESTION},
                {"type": "image_url", "image_url": {"url": url}},
            ],
        }
    ]


def test_a_placeholder_model_answers_without_fetching_the_image(
    blind: str, served_images: ImageServer
):
    """Even with the image server allowed, a model that cannot see never fetches."""
    client = openai.OpenAI(base_url=f"{blind}/v1", api_key="sk-local", max_retries=0)
    options = {"model": "blind", "max_tokens": 12, "temperature": 0}
    pictured = client.chat.completions.create(
        messages=_image_message(f"{served_images.base}/image.png"), **options
    )
    spelled = client.chat.completions.create(
        messages=[{"role": "user", "content": QUESTION + "[Unsupported Image]"}], **options
    )
    assert pictured.choices[0].message.content == spelled.choices[0].message.content
    assert pictured.usage.prompt_tokens == spelled.usage.prompt_tokens
    assert served_images.paths == []


def test_tokenize_shows_the_placeholder_as_plain_text(blind: str):
    url = "data:image/png;base64," + base64.b64encode(png_bytes()).decode()
    body = {"model": "blind", "messages": _image_message(url)}
    tokenized = httpx.post(f"{blind}/v1/tokenize", json=body, timeout=30).json()
    start = tokenized["prompt"].index(QUESTION + "[Unsupported Image]")
    assert not any(s <= start < e for s, e in tokenized["special_ranges"])


def test_a_placeholder_model_answers_anthropic_images_too(blind: str):
    client = anthropic.Anthropic(base_url=blind, api_key="sk-local", max_retries=0)
    image = {
        "type": "image",
        "source": {
            "type": "base64",
            "media_type": "image/png",
            "data": base64.b64encode(png_bytes()).decode(),
        },
    }
    message = client.messages.create(
        model="blind",
        max_tokens=8,
        messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION}, image]}],
    )
    assert message.content and message.usage.output_tokens > 0


def test_a_model_that_refuses_images_answers_each_protocol_with_its_own_400(
    openai_client: openai.OpenAI, anthropic_client: anthropic.Anthropic, served_images: ImageServer
):
    url = f"{served_images.base}/image.png"
    with pytest.raises(openai.BadRequestError) as refused:
        openai_client.chat.completions.create(
            model="default", max_tokens=4, messages=_image_message(url)
        )
    assert "does not accept images" in refused.value.message
    with pytest.raises(anthropic.BadRequestError) as refused_too:
        anthropic_client.messages.create(
            model="default",
            max_tokens=4,
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image", "source": {"type": "url", "url": url}}],
                }
            ],
        )
    assert refused_too.value.body["error"]["type"] == "invalid_request_error"
    assert "does not accept images" in refused_too.value.body["error"]["message"]
    assert served_images.paths == []
