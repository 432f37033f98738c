"""Prompt logprobs: the prompt's own forward pass scores each prompt token after the first.

They are what loglikelihood evaluation (``/v1/completions`` with ``echo`` and
``logprobs``) reads, so they are compared with transformers' log-softmax of
the same float32 model, whatever the chunking, the batch or the prefix cache.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.llm_engine import LLMEngine
from shared.events import FinishReason, TokenLogprob
from shared.sampling import SamplingParams
from tests.engine.test_engine_behaviour import (
    EngineFactory,
    assert_no_leak,
    encode,
    greedy,
    run_one,
    run_requests,
)

pytestmark = pytest.mark.slow


@pytest.fixture
def make_engine(make_float32_engine: EngineFactory) -> EngineFactory:
    """transformers is the reference here: the engines compute in float32 as it does."""
    return make_float32_engine


PROMPT = "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is"
TOLERANCE = 1e-3


def reference(transformers_default: Any, ids: list[int]) -> torch.Tensor:
    """transformers' log-probabilities ``[len(ids) - 1, vocab]`` of each next prompt token."""
    with torch.inference_mode():
        logits = transformers_default(torch.tensor([ids])).logits[0].float()
    return logits[:-1].log_softmax(-1)


def assert_matches(entries: list[TokenLogprob], ids: list[int], expected: torch.Tensor) -> None:
    assert [entry.token_id for entry in entries] == ids[1:]
    chosen = expected.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    got = torch.tensor([entry.logprob for entry in entries])
    torch.testing.assert_close(got, chosen, rtol=0, atol=TOLERANCE)


def test_prompt_logprobs_match_transformers(make_engine: EngineFactory, transformers_default):
    engine = make_engine()
    ids = encode(engine, PROMPT)
    outcome = run_one(engine, ids, greedy(max_tokens=0, prompt_logprobs=3))
    entries = outcome.ready.prompt_logprobs
    assert entries is not None
    expected = reference(transformers_default, ids)
    assert_matches(entries, ids, expected)
    for entry, row in zip(entries, expected, strict=True):
        values, top_ids = row.topk(3)
        assert [token for token, _ in entry.top] == top_ids.tolist()
        torch.testing.assert_close(
            torch.tensor([value for _, value in entry.top]), values, rtol=0, atol=TOLERANCE
        )
    # max_tokens 0: the prompt is scored and nothing is generated
    assert outcome.finish.reason is FinishReason.LENGTH
    assert outcome.finish.completion_tokens == 0
    assert outcome.token_ids == []
    assert_no_leak(engine)


def test_chunked_batched_and_cached_prompts_score_the_same(
    make_engine: EngineFactory, transformers_default
):
    """Chunks of 8 tokens, beside another request, after the same prompt filled the cache."""
    engine: LLMEngine = make_engine(max_num_batched_tokens=8, block_size=4)
    ids = encode(engine, PROMPT)
    expected = reference(transformers_default, ids)
    run_one(engine, ids, greedy(max_tokens=2))  # the prompt's blocks are now cached
    outcomes = run_requests(
        engine,
        [
            ("scored", ids, greedy(max_tokens=4, prompt_logprobs=0)),
            ("other", encode(engine, "Once upon a time"), greedy(max_tokens=6)),
        ],
    )
    scored = outcomes["scored"]
    assert scored.ready.cached_tokens == 0  # scored from its own forward pass, not the cache
    entries = scored.ready.prompt_logprobs
    assert entries is not None and all(entry.top == [] for entry in entries)
    assert_matches(entries, ids, expected)
    # the generation that follows is the one without prompt logprobs
    assert scored.token_ids == run_one(engine, ids, greedy(max_tokens=4)).token_ids
    assert outcomes["other"].ready.prompt_logprobs is None
    assert_no_leak(engine)


def test_zero_max_tokens_needs_prompt_logprobs():
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    assert SamplingParams(max_tokens=0, prompt_logprobs=0).max_tokens == 0
