"""Every protocol, streamed and whole, through Redis and a worker: same text as offline.

Greedy decoding makes the text a function of the prompt ids, so every path
(queue, worker engine, event stream, multiplexed reader, protocol builder)
must reproduce ``engine.LLM`` on the ids the server itself tokenized.
"""

from __future__ import annotations

import pytest
from anthropic import Anthropic
from openai import OpenAI

from shared.constraints import grammar_of
from shared.sampling import StructuredOutputs
from tests.distributed.conftest import Greedy, stream_chat, tokenize

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

MESSAGES = [{"role": "user", "content": "Write one sentence about the sea."}]
MAX_TOKENS = 16
GREEDY = {"extra_body": {"temperature": 0}}  # the Anthropic SDK has no temperature argument


@pytest.fixture
def expected(api: str, reference: Greedy) -> str:
    return reference(tokenize(api, MESSAGES), MAX_TOKENS)


def test_chat_completions(openai_client: OpenAI, expected: str):
    whole = openai_client.chat.completions.create(
        model="default", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0
    )
    assert whole.choices[0].message.content == expected
    assert whole.usage.completion_tokens == MAX_TOKENS
    deltas = list(stream_chat(openai_client, MESSAGES, MAX_TOKENS))
    assert "".join(text for _, text, _ in deltas) == expected
    assert deltas[-1][2] == "length"


def test_responses(openai_client: OpenAI, expected: str):
    options = {"model": "default", "input": MESSAGES, "max_output_tokens": MAX_TOKENS}
    whole = openai_client.responses.create(temperature=0, **options)
    assert whole.output_text == expected
    text, final = "", None
    for event in openai_client.responses.create(temperature=0, stream=True, **options):
        if event.type == "response.output_text.delta":
            text += event.delta
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert text == expected and final is not None and final.output_text == expected


def test_messages(anthropic_client: Anthropic, expected: str):
    options = {"model": "default", "messages": MESSAGES, "max_tokens": MAX_TOKENS, **GREEDY}
    whole = anthropic_client.messages.create(**options)
    assert whole.content[0].text == expected
    assert whole.stop_reason == "max_tokens"
    with anthropic_client.messages.stream(**options) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == expected and final.usage.output_tokens == MAX_TOKENS


def test_completions(api: str, openai_client: OpenAI, expected: str):
    """The chat's own prompt ids as a raw prompt: the same text; its prompt scored through Redis."""
    ids = tokenize(api, MESSAGES)
    options = {"model": "default", "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0}
    whole = openai_client.completions.create(echo=True, logprobs=1, **options)
    choice = whole.choices[0]
    prompt_text = choice.logprobs.tokens[: len(ids)]
    assert choice.text == "".join(prompt_text) + expected
    scores = choice.logprobs.token_logprobs
    assert len(scores) == len(ids) + MAX_TOKENS and scores[0] is None
    assert all(score <= 0 for score in scores[1:])
    assert all(len(top) >= 1 for top in choice.logprobs.top_logprobs[1:])
    streamed = openai_client.completions.create(stream=True, **options)
    assert "".join(c.text for chunk in streamed for c in chunk.choices) == expected


SCHEMA = {
    "type": "object",
    "properties": {
        "sea": {"type": "string", "maxLength": 20},
        "waves": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["sea", "waves"],
    "additionalProperties": False,
}


def test_a_constrained_request_matches_offline(
    api: str, openai_client: OpenAI, reference: Greedy
) -> None:
    """The constraint crosses Redis with the job and the worker's engine enforces it."""
    grammar = grammar_of(StructuredOutputs(json=SCHEMA))
    expected = reference(tokenize(api, MESSAGES), 64, StructuredOutputs(grammar=grammar))
    response_format = {"type": "json_schema", "json_schema": {"name": "sea", "schema": SCHEMA}}
    whole = openai_client.chat.completions.create(
        model="default",
        messages=MESSAGES,
        max_tokens=64,
        temperature=0,
        response_format=response_format,
    )
    assert whole.choices[0].message.content == expected
    assert whole.choices[0].finish_reason == "stop"
    deltas = list(stream_chat(openai_client, MESSAGES, 64, response_format=response_format))
    assert "".join(text for _, text, _ in deltas) == expected
