"""In the default precision a row's logits are the same bits whatever else the step holds.

A token's logprobs (the chosen one's and the top five, all read off its row's
logits) are compared bit for bit between the request run alone and the same
request chunked differently, decoded beside up to 63 others, continued from a
cached prefix, resumed from its generated tokens and rescored as a prompt, where
its decoded tokens become prefill rows. Decode steps run through the compiled
graphs, prefill chunks eagerly, so the comparisons cross the two.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.precision import own_kernels_run
from shared.events import TokenLogprob
from tests.engine.test_registry_models import make_tiny_model

pytestmark = pytest.mark.skipif(
    not own_kernels_run(), reason="the batch-invariant kernels do not run here"
)

PROMPT_TOKENS = 263  # chunks of 7 tokens end it under budgets of 16 and 64
GENERATED = 16
TOP = 5


def _prompt(seed: int, length: int) -> list[int]:
    draw = random.Random(seed)
    return [draw.randrange(200, 40000) for _ in range(length)]


def _rows(logprobs: list[TokenLogprob]) -> list[tuple[int, float, list[tuple[int, float]]]]:
    return [(entry.token_id, entry.logprob, entry.top) for entry in logprobs]


@pytest.fixture(scope="module", params=["default", "tiny"])
def weights(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    if request.param == "default":
        return "default"
    path = tmp_path_factory.mktemp("tiny") / "tiny"
    return str(
        make_tiny_model(path, hidden_size=128, intermediate_size=256, max_position_embeddings=2048)
    )


def _llm(weights: str, budget: int = 2048) -> LLM:
    torch.set_num_threads(1)  # as the suite's servers run: they load the graphs compiled here
    llm = LLM(
        weights,
        max_num_seqs=64,
        max_model_len=2048,
        max_num_batched_tokens=budget,
        enforce_eager=False,
    )
    assert llm.engine.precision.batch_invariant
    assert "batch-invariant" in llm.engine.description and "compiled" in llm.engine.description
    return llm


def test_a_rows_logits_do_not_depend_on_its_batch(weights: str) -> None:
    prompt = _prompt(1, PROMPT_TOKENS)
    params = SamplingParams(
        max_tokens=GENERATED, temperature=0.0, ignore_eos=True, logprobs=TOP, prompt_logprobs=TOP
    )
    llm = _llm(weights)
    [alone] = llm.generate([prompt], params)
    expected_prompt, expected = _rows(alone.prompt_logprobs), _rows(alone.logprobs)
    assert len(expected) == GENERATED

    # Without prompt logprobs the prompt is read from the cache but for its last block.
    decoding = SamplingParams(max_tokens=GENERATED, temperature=0.0, ignore_eos=True, logprobs=TOP)
    again = llm.generate([prompt], decoding)[0]
    assert again.cached_tokens > 0
    assert _rows(again.logprobs) == expected

    for others in (1, 7, 31, 63):  # decode batches of 2 to 64, prompts chunked beside them
        crowd = [_prompt(100 + i, 20 + 7 * i % 120) for i in range(others)]
        noisy = SamplingParams(max_tokens=GENERATED + others % 5, temperature=0.0, ignore_eos=True)
        outputs = llm.generate([prompt, *crowd], [params] + [noisy] * others)
        assert _rows(outputs[0].logprobs) == expected, f"beside {others} others"
        assert _rows(outputs[0].prompt_logprobs) == expected_prompt

    for budget in (16, 64):  # prefill chunks of 16 or 64 tokens and a last one of 7
        chunked = _llm(weights, budget).generate([prompt], params)[0]
        assert _rows(chunked.prompt_logprobs) == expected_prompt, f"chunks of {budget}"
        assert _rows(chunked.logprobs) == expected

    # The decoded tokens as prompt tokens: each decode row becomes a prefill row.
    generated = [entry[0] for entry in expected]
    rescored = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=TOP)
    [scored] = llm.generate([prompt + generated], rescored)
    assert _rows(scored.prompt_logprobs[-GENERATED:]) == expected


def test_a_resumed_request_recomputes_the_rows_it_decoded(weights: str) -> None:
    """A resume re-prefills the generated tokens; the first token it draws comes from the
    row that was a decode row before, and every later one follows bit for bit."""
    prompt = _prompt(2, 120)
    for temperature in (0.0, 0.8):
        params = SamplingParams(
            max_tokens=GENERATED, temperature=temperature, seed=11, ignore_eos=True, logprobs=TOP
        )
        llm = _llm(weights)
        whole = llm.generate([prompt], params)[0]
        for cut in (1, 6):
            engine = llm.engine
            engine.add_request(
                f"resumed-{temperature}-{cut}",
                prompt,
                params,
                generated_token_ids=whole.token_ids[:cut],
            )
            resumed: list[TokenLogprob] = []
            ids: list[int] = []
            while engine.has_unfinished():
                for event in engine.step():
                    ids += getattr(event, "token_ids", [])
                    resumed += getattr(event, "logprobs", None) or []
            assert whole.token_ids[:cut] + ids == whole.token_ids
            assert _rows(resumed) == _rows(whole.logprobs[cut:])
