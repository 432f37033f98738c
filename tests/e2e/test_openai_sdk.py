"""The official ``openai`` SDK against a real server: Chat Completions and Responses.

Greedy decoding (temperature 0) makes the text a function of the prompt, so a
streamed and a whole response must agree exactly, and a stop string taken
from a whole response must cut a second one at that place.
"""

from __future__ import annotations

import httpx
import pytest
from openai import OpenAI

MODEL = "default"
MESSAGES = [{"role": "user", "content": "Write one sentence about the sea."}]
MAX_TOKENS = 12

pytestmark = pytest.mark.slow


def _chat(client: OpenAI, **kwargs):
    options = {"model": MODEL, "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0}
    return client.chat.completions.create(**{**options, **kwargs})


def _stream_chat(client: OpenAI, **kwargs) -> tuple[str, str | None, object, int]:
    """(text, finish reason, usage, number of chunks) of a streamed completion."""
    text, finish, usage, count = "", None, None, 0
    for chunk in _chat(client, stream=True, **kwargs):
        count += 1
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish, usage, count


def test_chat_stream_and_whole_agree(openai_client: OpenAI):
    whole = _chat(openai_client)
    text, finish, usage, count = _stream_chat(openai_client, stream_options={"include_usage": True})
    choice = whole.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content and text == choice.message.content
    assert finish == choice.finish_reason == "length"
    assert whole.usage.completion_tokens == MAX_TOKENS
    assert usage is not None
    assert usage.prompt_tokens == whole.usage.prompt_tokens > 0
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert whole.id.startswith("chatcmpl-") and whole.model == MODEL
    assert count > 2  # streamed token by token, not in one piece


def test_chat_stream_without_include_usage_has_no_usage_chunk(openai_client: OpenAI):
    _, _, usage, _ = _stream_chat(openai_client, max_tokens=3)
    assert usage is None


def test_chat_stream_ends_with_done(http: httpx.Client):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"


def test_chat_stop_sequence(openai_client: OpenAI):
    full = _chat(openai_client, max_tokens=16).choices[0].message.content
    words = full.split(" ")
    stop = " " + words[3]  # the fourth word, with its leading space
    expected = full[: full.index(stop)]
    whole = _chat(openai_client, max_tokens=16, stop=[stop])
    assert whole.choices[0].finish_reason == "stop"
    assert whole.choices[0].message.content == expected
    text, finish, _, _ = _stream_chat(openai_client, max_tokens=16, stop=[stop])
    assert (text, finish) == (expected, "stop")


def test_responses_stream_and_whole_agree(openai_client: OpenAI):
    options = {"model": MODEL, "input": MESSAGES[0]["content"], "temperature": 0}
    whole = openai_client.responses.create(max_output_tokens=MAX_TOKENS, **options)
    assert whole.status == "incomplete"
    assert whole.incomplete_details.reason == "max_output_tokens"
    assert whole.output_text
    assert whole.usage.output_tokens == MAX_TOKENS

    deltas, final = [], None
    for event in openai_client.responses.create(
        max_output_tokens=MAX_TOKENS, stream=True, **options
    ):
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert final is not None and final.status == "incomplete"
    assert "".join(deltas) == final.output_text == whole.output_text
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_chat_and_responses_say_the_same(openai_client: OpenAI):
    chat = _chat(openai_client).choices[0].message.content
    response = openai_client.responses.create(
        model=MODEL, input=MESSAGES, max_output_tokens=MAX_TOKENS, temperature=0
    )
    assert response.output_text == chat


def test_chat_n_choices_stream_as_they_answer_whole(openai_client: OpenAI):
    """``n=3`` seeded: three choices, each its own seed's draw, streamed as answered whole."""
    sampled = {"max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": 5}
    whole = _chat(openai_client, n=3, **sampled)
    alone = [_chat(openai_client, **{**sampled, "seed": 5 + i}) for i in range(3)]
    texts = [choice.message.content for choice in whole.choices]
    assert [choice.index for choice in whole.choices] == [0, 1, 2]
    assert texts == [reply.choices[0].message.content for reply in alone]
    assert whole.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert whole.usage.completion_tokens == sum(r.usage.completion_tokens for r in alone)
    chunks = list(
        _chat(openai_client, n=3, stream=True, stream_options={"include_usage": True}, **sampled)
    )
    streamed: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + (choice.delta.content or "")
    assert streamed == dict(enumerate(texts))
    assert {chunk.id for chunk in chunks} == {chunks[0].id}
    assert chunks[-1].object == "chat.completion.chunk"
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_models_lists_the_model_once_with_its_aliases(openai_client: OpenAI):
    (model,) = openai_client.models.list()
    assert model.id == "smollm2-135m-instruct"
    assert model.model_extra == {"root": model.id, "aliases": ["default"], "max_model_len": 2048}


def test_tokenize_matches_the_prompt_usage(http: httpx.Client, openai_client: OpenAI):
    tokens = http.post("/v1/tokenize", json={"model": MODEL, "messages": MESSAGES}).json()
    assert tokens["count"] == len(tokens["token_ids"])
    assert tokens["prompt"].endswith("<|im_start|>assistant\n")
    specials = {tokens["prompt"][start:end] for start, end in tokens["special_ranges"]}
    assert specials == {"<|im_start|>", "<|im_end|>"}
    assert tokens["count"] == _chat(openai_client, max_tokens=1).usage.prompt_tokens


def test_chat_logprobs_cover_every_token(openai_client: OpenAI):
    whole = _chat(openai_client, max_tokens=6, logprobs=True, top_logprobs=2)
    choice = whole.choices[0]
    entries = choice.logprobs.content
    assert len(entries) == whole.usage.completion_tokens == 6
    assert b"".join(bytes(entry.bytes) for entry in entries).decode() == choice.message.content
    assert all(entry.logprob <= 0 and len(entry.top_logprobs) == 2 for entry in entries)
    assert all(entry.top_logprobs[0].logprob >= entry.logprob - 1e-4 for entry in entries)
