"""Parsing a Completions body: the prompt's forms, the defaults, what is refused."""

from __future__ import annotations

import pytest

from api.errors import ApiError
from api.protocols.completions import DEFAULT_MAX_TOKENS, MAX_PROMPTS, parse, split

BODY = {"model": "default", "prompt": "Once upon a time"}


@pytest.mark.parametrize(
    ("prompt", "text", "ids"),
    [
        ("Once", "Once", None),
        (["Once"], "Once", None),
        ([1, 2, 3], None, [1, 2, 3]),
        ([[1, 2, 3]], None, [1, 2, 3]),
    ],
)
def test_a_prompt_is_text_or_token_ids(prompt, text, ids):
    request = parse({**BODY, "prompt": prompt})
    assert request.prompt is not None
    assert (request.prompt.text, request.prompt.token_ids) == (text, ids)
    assert request.conversation.messages == [] and request.conversation.thinking is False


def test_defaults_follow_openai():
    request = parse(BODY)
    assert request.max_tokens == DEFAULT_MAX_TOKENS == 16
    assert request.logprobs is None and request.prompt_logprobs is None
    assert request.prompt is not None and request.prompt.echo is False


@pytest.mark.parametrize(
    ("fields", "prompt_logprobs"),
    [
        ({"logprobs": 3}, None),  # no echo: only the generated tokens are scored
        ({"echo": True}, None),
        ({"echo": True, "logprobs": 3}, 3),
        ({"echo": True, "max_tokens": 0}, 0),  # scoring the prompt is all there is to do
        ({"echo": True, "max_tokens": 0, "logprobs": 1}, 1),
    ],
)
def test_the_prompt_is_scored_when_echoed_with_logprobs(fields, prompt_logprobs):
    assert parse({**BODY, **fields}).prompt_logprobs == prompt_logprobs


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"prompt": None}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": [[1], [2]]}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": [True]}, "prompt"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 2}, "n"),
        ({"best_of": 2}, "best_of"),
        ({"suffix": "x"}, "suffix"),
        ({"logprobs": 21}, "logprobs"),
        ({"prompt_logprobs": 1}, "prompt_logprobs"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
    ],
)
def test_refusals_name_the_field(fields, param):
    with pytest.raises(ApiError) as caught:
        parse({**BODY, **fields})
    assert caught.value.status == 400 and caught.value.param == param


def test_served_anyway_values_are_accepted():
    request = parse(
        {**BODY, "n": 1, "best_of": 1, "suffix": "", "add_special_tokens": True, "novel": 1}
    )
    assert request.ignored_fields == ["novel"]


def test_a_body_listing_several_prompts_splits_into_one_body_each():
    assert split(BODY) == [BODY]
    assert split({**BODY, "prompt": [[1, 2]]}) == [{**BODY, "prompt": [[1, 2]]}]
    bodies = split({**BODY, "prompt": ["a", [1, 2]], "max_tokens": 3})
    assert bodies == [
        {**BODY, "prompt": "a", "max_tokens": 3},
        {**BODY, "prompt": [1, 2], "max_tokens": 3},
    ]
    with pytest.raises(ApiError) as caught:
        split({**BODY, "prompt": ["a"] * (MAX_PROMPTS + 1)})
    assert caught.value.param == "prompt"
