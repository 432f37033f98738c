"""Decode steps through the compiled graph give what eager steps give."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from shared.events import TokenLogprob
from tests.engine.test_registry_models import make_tiny_model

PROMPTS = ["hello there", "the sea at night is", "one two three four five six"]
MANY = [f"request {i}: {prompt}" for i in range(3) for prompt in PROMPTS]  # 9 rows


@pytest.mark.parametrize(
    ("dtype", "quantization"), [("float32", "none"), ("bfloat16", "int4")], ids=["float32", "int4"]
)
def test_compiled_decode_matches_eager(tmp_path: Path, dtype: str, quantization: str) -> None:
    weights = str(make_tiny_model(tmp_path / "tiny", hidden_size=64, intermediate_size=128))
    options = dict(dtype=dtype, quantization=quantization, max_num_seqs=len(MANY))
    compiled = LLM(weights, enforce_eager=False, **options)
    eager = LLM(weights, enforce_eager=True, **options)
    assert "decode steps compiled" in compiled.engine.description
    graph = compiled.engine.runner.compiled
    assert graph is not None  # warming up compiled both graphs
    warm_up_steps = graph.steps
    assert warm_up_steps == 3  # the one-row, few-rows and many-rows graphs, once each
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    tolerance = 1e-3 if dtype == "float32" else 0.1
    for prompts in (PROMPTS[:1], PROMPTS, MANY):  # the one-row, few-rows and many-rows graphs
        ours, theirs = compiled.generate(prompts, params), eager.generate(prompts, params)
        for a, b in zip(ours, theirs, strict=True):
            assert_same_greedy_path(a.logprobs, b.logprobs, tolerance, ties=dtype != "float32")
    assert graph.steps - warm_up_steps == 3 * 23  # every step after each batch's prefill


def test_only_the_graphs_the_batch_limit_allows_are_compiled(tmp_path: Path) -> None:
    """One sequence at a time: the batch-1 graph alone (the test above warms up three)."""
    weights = str(make_tiny_model(tmp_path / "tiny", hidden_size=64, intermediate_size=128))
    llm = LLM(weights, enforce_eager=False, dtype="float32", max_num_seqs=1)
    assert llm.engine.runner.compiled.steps == 1  # one warm-up step


def assert_same_greedy_path(
    ours: list[TokenLogprob], theirs: list[TokenLogprob], tolerance: float, ties: bool
) -> None:
    """The same tokens with logprobs within ``tolerance``, up to a near tie if ``ties``.

    In bfloat16 the graph's kernels round differently from eager ones, so two
    candidates within ``tolerance`` of each other may swap; past such a
    swap, the two runs continue different texts.
    """
    assert len(ours) == len(theirs)
    for x, y in zip(ours, theirs, strict=True):
        if x.token_id != y.token_id:
            alternatives = dict(y.top)
            assert ties and x.token_id in alternatives, (x, y)
            assert alternatives[x.token_id] == pytest.approx(y.logprob, abs=tolerance)
            return
        assert x.logprob == pytest.approx(y.logprob, abs=tolerance)
