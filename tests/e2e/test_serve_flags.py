"""vLLM's serve flags on a real server: a proxy's root path, an access log that leaves
successful probes out at INFO, the served model's names, its chat template and its reasoning
parser."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.servers import running_server

pytestmark = pytest.mark.slow


# ChatML with a line of its own in every turn, and a generation prompt that opens reasoning
# as DeepSeek-R1's template does.
TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n"
    "[house style] {{ message.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)


@pytest.fixture(scope="module")
def named(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    log_dir = tmp_path_factory.mktemp("named")
    template = log_dir / "template.jinja"
    template.write_text(TEMPLATE)
    args = [
        "--root-path", "/llm",
        "--max-model-len", "1024", "--max-num-seqs", "2",
        "--served-model-name", "house-model", "house-alias",
        "--chat-template", str(template), "--reasoning-parser", "deepseek_r1",
    ]  # fmt: skip
    with running_server(args, log_dir, {"SLUICE_ENFORCE_EAGER": "1"}) as base_url:
        yield base_url, log_dir / "server.log"


def test_the_root_path_and_the_quiet_probes(named: tuple[str, Path]):
    base_url, log = named
    assert httpx.get(f"{base_url}/openapi.json").json()["servers"] == [{"url": "/llm"}]
    for _ in range(3):
        assert httpx.get(f"{base_url}/ready").status_code == 200
    assert httpx.post(f"{base_url}/tokenize", json={"prompt": "Hi"}).status_code == 200

    def logged(request: str) -> list[str]:  # paths as the client asked, the root path included
        lines = log.read_text().splitlines()
        return [line for line in lines if f" {request} " in line and "status=200" in line]

    deadline = time.monotonic() + 10  # a line is written once its response has gone out
    while not logged("POST /llm/tokenize") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert logged("POST /llm/tokenize") and not logged("GET /llm/ready")


def test_the_served_names_replace_the_model_s_own(named: tuple[str, Path]):
    base_url, _ = named
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused")
    [model] = client.models.list().data
    assert (model.id, model.aliases, model.root) == (  # type: ignore[attr-defined]
        "house-model",
        ["house-alias"],
        "smollm2-135m-instruct",
    )
    assert client.models.retrieve("house-alias").id == "house-model"
    for old_name in ("default", "smollm2-135m-instruct"):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(
                model=old_name, messages=[{"role": "user", "content": "Hi"}], max_tokens=1
            )
        assert refused.value.code == "model_not_found"
        assert "house-model" in str(refused.value)
    answer = client.chat.completions.create(
        model="house-alias", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
    )
    assert answer.model == "house-alias" and answer.usage.completion_tokens == 4
    metrics = httpx.get(f"{base_url}/metrics").text
    assert 'vllm:request_success_total{finished_reason="length",model_name="house-model"}' in (
        metrics
    )


def test_the_chat_template_renders_the_prompt_and_opens_reasoning(named: tuple[str, Path]):
    base_url, _ = named
    messages = [{"role": "user", "content": "Hi"}]
    tokenized = httpx.post(
        f"{base_url}/tokenize",
        json={"model": "house-model", "messages": messages, "return_token_strs": True},
    ).json()
    prompt = "".join(tokenized["token_strs"]).replace("Ġ", " ").replace("Ċ", "\n")
    turn = "<|im_start|>user\n[house style] Hi<|im_end|>\n"
    assert prompt == turn + "<|im_start|>assistant\n<think>\n"
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused")
    answer = client.chat.completions.create(
        model="house-model", messages=messages, max_tokens=6, temperature=0
    )
    message = answer.choices[0].message
    # The template opened <think>: what the model writes is reasoning until it closes it.
    assert message.reasoning_content and not message.content  # type: ignore[attr-defined]
