"""One translator turns a request model's first validation error into the protocol's 400."""

from __future__ import annotations

from typing import Any

import pytest

from api.errors import ApiError
from api.protocols import chat_completions, completions, messages_request

CHAT = {"model": "default", "messages": [{"role": "user", "content": "Hi"}]}
COMPLETION = {"model": "default", "prompt": "Once"}


def refusal(parse: Any, body: Any) -> tuple[str | None, str]:
    with pytest.raises(ApiError) as caught:
        parse(body)
    assert caught.value.status == 400
    return caught.value.param, caught.value.message


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"model": None}, "model", "model is required"),
        ({"model": ""}, "model", 'model must be a non-empty string, got ""'),
        ({"temperature": 7}, "temperature", "temperature must be a number between 0 and 2, got 7"),
        ({"top_p": 0}, "top_p", "top_p must be a number in (0, 1], got 0"),
        ({"seed": 1.5}, "seed", "seed must be an integer, got 1.5"),
        ({"stream": 1}, "stream", "stream must be true or false, got 1"),
        (
            {"messages": [{"role": "user", "content": 5}]},
            "messages[0].content",
            "messages[0].content must be a string or an array of content parts, got 5",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
            "messages[0].content[0].text",
            "messages[0].content[0].text must be a string, got 5",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}]},
            "messages[0].content[0].type",
            "messages[0].content[0].type must be one of 'text', 'image_url' in a user message, "
            'got "refusal"',
        ),
        (
            {"messages": [{"role": "robot", "content": "Hi"}]},
            "messages[0].role",
            "messages[0].role must be one of 'system', 'developer', 'user', 'assistant', "
            "'tool', 'latest_reminder', got \"robot\"",
        ),
        ({"messages": [5]}, "messages[0]", "messages[0] must be a JSON object, got 5"),
        ({"messages": [{"content": "Hi"}]}, "messages[0].role", "messages[0].role is required"),
        (
            {"logit_bias": {"--5": 1}},
            "logit_bias",
            "logit_bias must be an object mapping token ids to numbers between -100 and 100, "
            'got {"--5": 1}',
        ),
    ],
)
def test_openai_errors_name_the_path_what_is_accepted_and_the_value(
    fields: dict[str, Any], param: str, message: str
) -> None:
    assert refusal(chat_completions.parse, {**CHAT, **fields}) == (param, message)


def test_a_body_that_is_not_an_object_is_named_as_the_request_body() -> None:
    assert refusal(completions.parse, [1]) == (
        None,
        "the request body must be a JSON object, got [1]",
    )


def test_an_integral_float_reads_as_an_integer_and_null_as_absent() -> None:
    request = completions.parse({**COMPLETION, "max_tokens": 8.0, "temperature": None})
    assert request.max_tokens == 8 and request.temperature is None


def test_unknown_fields_are_ignored_and_reported_but_refused_ones_are_not() -> None:
    request = chat_completions.parse({**CHAT, "novel": 1, "store": False, "later": None})
    assert request.ignored_fields == ["novel", "later"]


def test_anthropic_errors_keep_their_own_phrasing() -> None:
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [5]}]}
    assert refusal(messages_request.parse, body) == (
        "messages.0.content.0",
        "messages.0.content.0: must be an object, got 5",
    )
