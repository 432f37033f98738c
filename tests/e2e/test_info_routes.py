"""The routes that answer about the server: a model by name, the version, and vLLM's
``/tokenize`` and ``/detokenize`` against the token ids a generation gets."""

from __future__ import annotations

import httpx
import openai
import pytest
from openai import OpenAI

MODEL = "default"
MESSAGES = [{"role": "user", "content": "Write one sentence about the sea."}]

pytestmark = pytest.mark.slow


def test_a_model_is_retrieved_by_name_or_alias(openai_client: OpenAI):
    by_alias = openai_client.models.retrieve(MODEL)
    assert by_alias.id == "smollm2-135m-instruct" and by_alias.object == "model"
    assert openai_client.models.retrieve(by_alias.id) == by_alias
    with pytest.raises(openai.NotFoundError) as caught:
        openai_client.models.retrieve("no-such-model")
    assert caught.value.body["code"] == "model_not_found"


def test_version_names_the_package(http: httpx.Client):
    answer = http.get("/version")
    assert answer.status_code == 200 and answer.json()["version"]


def test_tokenize_gives_a_completion_s_prompt_ids(http: httpx.Client, openai_client: OpenAI):
    answer = http.post("/tokenize", json={"prompt": "The sea is", "return_token_strs": True})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert set(body) == {"count", "max_model_len", "tokens", "token_strs"}
    assert body["count"] == len(body["tokens"]) == len(body["token_strs"])
    assert body["max_model_len"] == 2048
    usage = openai_client.completions.create(model=MODEL, prompt="The sea is", max_tokens=1).usage
    assert usage.prompt_tokens == body["count"]
    assert "".join(body["token_strs"]).replace("Ġ", " ") == "The sea is"


def test_tokenize_gives_a_chat_s_prompt_ids(http: httpx.Client):
    ours = http.post("/v1/tokenize", json={"model": MODEL, "messages": MESSAGES}).json()
    vllm = http.post("/tokenize", json={"model": MODEL, "messages": MESSAGES}).json()
    assert vllm["tokens"] == ours["token_ids"] and vllm["token_strs"] is None


def test_detokenize_inverts_tokenize(http: httpx.Client):
    text = "Lighthouses <|im_end|> keep ships off the rocks."
    tokens = http.post("/tokenize", json={"prompt": text}).json()["tokens"]
    answer = http.post("/detokenize", json={"model": MODEL, "tokens": tokens})
    assert answer.json() == {"prompt": text}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {"prompt": "a", "messages": MESSAGES}, "prompt"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "temperature": 2}, "temperature"),
        ("/tokenize", {"model": "nope", "prompt": "a"}, "model"),
        ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
        ("/detokenize", {"tokens": "12"}, "tokens"),
        ("/detokenize", {"tokens": [1], "skip": True}, "skip"),
    ],
)
def test_bad_bodies_are_400s_naming_the_field(http: httpx.Client, path, body, param):
    answer = http.post(path, json=body)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param
