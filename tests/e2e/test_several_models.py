"""Several models behind one embedded API: the ``model`` field chooses the engine.

The default model and a tiny one (random weights, real architecture, saved as
an HF directory) are served by one ``sluice serve``, each on an engine of its
own; the official SDK picks one by name or alias.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI

from tests.engine.test_registry_models import make_tiny_model
from tests.servers import running_server


def several_models_options(directory: Path) -> list[str]:
    """A registry with a tiny model beside the built-in one, and both served."""
    weights = make_tiny_model(directory / "tiny")
    config = directory / "models.toml"
    config.write_text(
        f'[models.tiny-llama]\naliases = ["tiny"]\nweights = "{weights}"\n'
        'prompt_format = "chatml"\ncontext_length = 256\n'
    )
    return ["--config", str(config), "--model", "default", "--model", "tiny"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    options = several_models_options(tmp_path_factory.mktemp("models"))
    args = [*options, "--max-num-seqs", "2"]  # each model's own context length
    env = {"SLUICE_ENFORCE_EAGER": "1"}
    with running_server(args, tmp_path_factory.mktemp("log"), env) as url:
        yield url


@pytest.fixture(scope="module")
def client(server: str) -> OpenAI:
    return OpenAI(base_url=f"{server}/v1", api_key="sk-local", max_retries=0, timeout=60)


def ask(client: OpenAI, model: str) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Name a colour."}],
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )


def test_models_are_listed_once_each_with_their_aliases(server: str) -> None:
    listed = httpx.get(f"{server}/v1/models").json()["data"]
    by_id = {model["id"]: model for model in listed}
    assert set(by_id) == {"smollm2-135m-instruct", "tiny-llama"}
    assert by_id["smollm2-135m-instruct"]["aliases"] == ["default"]
    assert by_id["tiny-llama"]["aliases"] == ["tiny"]
    assert by_id["tiny-llama"]["max_model_len"] == 256
    assert by_id["smollm2-135m-instruct"]["max_model_len"] == 8192


def test_the_model_field_chooses_the_engine(server: str, client: OpenAI) -> None:
    answers = {name: ask(client, name) for name in ("default", "tiny", "tiny-llama")}
    assert (
        answers["tiny"].choices[0].message.content
        == answers["tiny-llama"].choices[0].message.content
    )
    assert (
        answers["default"].choices[0].message.content != answers["tiny"].choices[0].message.content
    )
    for name, answer in answers.items():
        assert answer.model == name
        assert answer.usage is not None and answer.usage.completion_tokens == 6
    metrics = httpx.get(f"{server}/metrics").text
    for model in ("smollm2-135m-instruct", "tiny-llama"):
        assert f'vllm:generation_tokens_total{{model_name="{model}"}}' in metrics


def test_an_unknown_model_names_every_served_one(client: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        ask(client, "nope")
    message = str(refused.value)
    for name in ("default", "smollm2-135m-instruct", "tiny", "tiny-llama"):
        assert name in message
