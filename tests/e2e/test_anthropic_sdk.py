"""The official ``anthropic`` SDK against a real server: Messages and count_tokens."""

from __future__ import annotations

import pytest
from anthropic import Anthropic

MODEL = "default"
MESSAGES = [{"role": "user", "content": "Write one sentence about the sea."}]
MAX_TOKENS = 12

pytestmark = pytest.mark.slow


# This SDK version has no ``temperature`` argument; the API field still exists.
GREEDY = {"extra_body": {"temperature": 0}}


def _create(client: Anthropic, **kwargs):
    options = {"model": MODEL, "messages": MESSAGES, "max_tokens": MAX_TOKENS, **GREEDY}
    return client.messages.create(**{**options, **kwargs})


def _text(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def _input_tokens(usage) -> int:
    """Every prompt token: Anthropic reports cache hits apart from ``input_tokens``."""
    return usage.input_tokens + (usage.cache_read_input_tokens or 0)


def test_messages_stream_and_whole_agree(anthropic_client: Anthropic):
    whole = _create(anthropic_client)
    options = {"model": MODEL, "messages": MESSAGES, "max_tokens": MAX_TOKENS, **GREEDY}
    with anthropic_client.messages.stream(**options) as stream:
        streamed_text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert whole.id.startswith("msg_") and whole.role == "assistant"
    assert _text(whole) and streamed_text == _text(whole) == _text(final)
    assert whole.stop_reason == final.stop_reason == "max_tokens"
    assert whole.usage.output_tokens == final.usage.output_tokens == MAX_TOKENS
    assert _input_tokens(whole.usage) == _input_tokens(final.usage) > 0


def test_messages_stop_sequence(anthropic_client: Anthropic):
    full = _text(_create(anthropic_client, max_tokens=16))
    stop = " " + full.split(" ")[3]
    whole = _create(anthropic_client, max_tokens=16, stop_sequences=[stop])
    assert (whole.stop_reason, whole.stop_sequence) == ("stop_sequence", stop)
    assert _text(whole) == full[: full.index(stop)]
    options = {"model": MODEL, "messages": MESSAGES, "max_tokens": 16, **GREEDY}
    with anthropic_client.messages.stream(stop_sequences=[stop], **options) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)
    assert _text(final) == _text(whole)


def test_count_tokens_matches_the_prompt_usage(anthropic_client: Anthropic):
    counted = anthropic_client.messages.count_tokens(model=MODEL, messages=MESSAGES)
    used = _create(anthropic_client, max_tokens=1).usage
    assert counted.input_tokens == _input_tokens(used) > 0


def test_messages_and_chat_completions_say_the_same(anthropic_client: Anthropic, openai_client):
    chat = openai_client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0
    )
    assert _text(_create(anthropic_client)) == chat.choices[0].message.content
