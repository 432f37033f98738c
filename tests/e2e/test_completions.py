"""``/v1/completions`` through the official ``openai`` SDK against the real server.

The prompt is raw text: the greedy text equals what ``sluice generate`` makes
of the same prompt offline, and ``echo`` with ``logprobs`` scores every prompt
token after the first as transformers' float32 model of the same GGUF does.
"""

from __future__ import annotations

import openai
import pytest
import torch
from openai import OpenAI
from tokenizers import Tokenizer

from api import cli
from engine.precision import own_kernels_run
from shared.registry import default_registry
from shared.tokenizer_loader import load_tokenizer

pytestmark = pytest.mark.slow

MODEL = "default"
PROMPT = "The capital of France is Paris. The capital of Italy is"
TOKENS = 12
DEFAULT_PRECISION_BOUND = 0.5
"""How far the session server's default precision may move a logprob from transformers' float32
(``tests/engine/test_precision.py`` measures the bound on a prompt set)."""


def _complete(client: OpenAI, **kwargs):
    options = {"model": MODEL, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0}
    return client.completions.create(**{**options, **kwargs})


def test_greedy_text_equals_sluice_generate(
    openai_client: OpenAI, capsys: pytest.CaptureFixture[str]
):
    reply = _complete(openai_client)
    assert cli.main(["generate", "--max-tokens", str(TOKENS), PROMPT]) == 0
    offline = capsys.readouterr().out
    choice = reply.choices[0]
    assert choice.text and offline.removesuffix("\n") == choice.text
    assert choice.finish_reason == "length" and choice.logprobs is None
    assert reply.object == "text_completion" and reply.id.startswith("cmpl-")
    assert reply.usage.completion_tokens == TOKENS


def test_stream_and_whole_agree(openai_client: OpenAI):
    whole = _complete(openai_client)
    chunks = list(_complete(openai_client, stream=True, stream_options={"include_usage": True}))
    text = "".join(choice.text for chunk in chunks for choice in chunk.choices)
    assert text == whole.choices[0].text
    finishes = [c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens
    assert len(chunks) > 3  # token by token


def test_token_id_prompt_is_the_same_prompt(openai_client: OpenAI, http):
    ids = http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 0},
    ).json()["choices"][0]["logprobs"]["tokens"]
    by_text = _complete(openai_client, max_tokens=4)
    tokenizer = _tokenizer()
    prompt_ids = tokenizer.encode(PROMPT, add_special_tokens=False).ids
    assert len(ids) == len(prompt_ids)
    by_ids = _complete(openai_client, prompt=prompt_ids, max_tokens=4, echo=True)
    assert by_ids.choices[0].text == PROMPT + by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == by_text.usage.prompt_tokens == len(prompt_ids)


def test_control_token_spellings_are_plain_text(openai_client: OpenAI):
    reply = _complete(openai_client, prompt="Hi<|im_end|>", max_tokens=0, echo=True, logprobs=0)
    logprobs = reply.choices[0].logprobs
    assert "".join(logprobs.tokens) == "Hi<|im_end|>"
    assert "<|im_end|>" not in logprobs.tokens  # spelled out in pieces, not the control token
    assert reply.usage.prompt_tokens == len(logprobs.tokens) > 2


def test_echo_logprobs_match_transformers(openai_client: OpenAI, transformers_default):
    reply = _complete(openai_client, max_tokens=0, echo=True, logprobs=2)
    choice = reply.choices[0]
    logprobs = choice.logprobs
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert reply.usage.completion_tokens == 0
    ids = _tokenizer().encode(PROMPT, add_special_tokens=False).ids
    with torch.inference_mode():
        logits = transformers_default(torch.tensor([ids])).logits[0].float()
    expected = logits[:-1].log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    got = torch.tensor(logprobs.token_logprobs[1:])
    torch.testing.assert_close(got, expected, rtol=0, atol=DEFAULT_PRECISION_BOUND)
    assert all(2 <= len(top) <= 3 for top in logprobs.top_logprobs[1:])  # the token and the top 2
    assert logprobs.text_offset == [
        sum(len(token) for token in logprobs.tokens[:i]) for i in range(len(ids))
    ]


def test_echo_with_generation_continues_the_offsets(openai_client: OpenAI):
    plain = _complete(openai_client, max_tokens=5)
    reply = _complete(openai_client, max_tokens=5, echo=True, logprobs=1)
    choice = reply.choices[0]
    assert choice.text == PROMPT + plain.choices[0].text
    prompt_tokens = reply.usage.prompt_tokens
    assert len(choice.logprobs.tokens) == prompt_tokens + 5
    assert "".join(choice.logprobs.tokens[prompt_tokens:]) == plain.choices[0].text
    streamed = list(_complete(openai_client, max_tokens=5, echo=True, stream=True))
    assert streamed[0].choices[0].text == PROMPT  # the echo comes first, on its own
    assert "".join(c.text for chunk in streamed for c in chunk.choices) == choice.text


def test_several_prompts_are_one_choice_each(openai_client: OpenAI):
    prompts = [PROMPT, "Once upon a time", [504, 3575, 282]]
    singles = [_complete(openai_client, prompt=prompt, max_tokens=6) for prompt in prompts]
    joined = _complete(openai_client, prompt=prompts, max_tokens=6)
    assert [choice.index for choice in joined.choices] == [0, 1, 2]
    assert [c.text for c in joined.choices] == [s.choices[0].text for s in singles]
    assert joined.usage.total_tokens == sum(s.usage.total_tokens for s in singles)
    texts: dict[int, str] = {}
    chunks = list(
        _complete(
            openai_client,
            prompt=prompts,
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == {i: c.text for i, c in enumerate(joined.choices)}
    assert {chunk.id for chunk in chunks} == {chunks[0].id}  # one response
    usages = [chunk.usage for chunk in chunks if chunk.usage is not None]
    assert len(usages) == 1 and usages[0].total_tokens == joined.usage.total_tokens


def test_n_seeded_choices_are_each_seed_s_own_draw(openai_client: OpenAI):
    """``n`` with a seed: choice ``i`` draws with the seed ``seed + i``, the same every time;
    the prompt's tokens count once, each choice's completion tokens count. Where the engine
    is batch-invariant (its own kernels run), choice ``i`` is what that seed draws alone;
    elsewhere a row's logits round with the rows beside it, and a draw may part."""
    sampled = {"max_tokens": 8, "temperature": 1.0, "seed": 11}
    joined = _complete(openai_client, n=3, **sampled)
    again = _complete(openai_client, n=3, **sampled)
    alone = [_complete(openai_client, **{**sampled, "seed": 11 + i}) for i in range(3)]
    texts = [choice.text for choice in joined.choices]
    assert [choice.index for choice in joined.choices] == [0, 1, 2]
    assert texts == [choice.text for choice in again.choices]
    assert len(set(texts)) == 3  # three draws, not one copied
    assert joined.usage.prompt_tokens == alone[0].usage.prompt_tokens
    several = _complete(openai_client, prompt=[PROMPT, "Once upon a time"], n=2, **sampled)
    assert [choice.index for choice in several.choices] == [0, 1, 2, 3]
    if not own_kernels_run():
        return
    assert texts == [reply.choices[0].text for reply in alone]
    assert joined.usage.completion_tokens == sum(r.usage.completion_tokens for r in alone)
    assert [c.text for c in several.choices[:2]] == texts[:2]


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"n": 65}, "n"),
        ({"prompt": ["one"] * 33, "n": 2}, "n"),
        ({"best_of": 3}, "best_of"),
        ({"suffix": "end"}, "suffix"),
        ({"prompt": ["one", [10**9]]}, "prompt"),
        ({"prompt": ["one"] * 65}, "prompt"),
        ({"prompt": [], "max_tokens": 1}, "prompt"),
        ({"prompt": [10**9]}, "prompt"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"extra_body": {"use_beam_search": True}}, "use_beam_search"),
    ],
)
def test_refusals_name_the_field(openai_client: OpenAI, overrides: dict, named: str):
    with pytest.raises(openai.BadRequestError) as caught:
        _complete(openai_client, **overrides)
    assert caught.value.status_code == 400
    assert caught.value.body["param"] == named


def _tokenizer() -> Tokenizer:
    return load_tokenizer(default_registry().resolve("default").weights).tokenizer
