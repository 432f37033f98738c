"""The preparation benchmark runs end to end on a tiny corpus and prints every row.

The transformers baseline here wraps the tokenizer Sluice already loaded, with
the GGUF's chat template: the same ``apply_chat_template`` path the benchmark
times, without the seconds transformers spends converting the GGUF tokenizer.
"""

from __future__ import annotations

from typing import Any

import pytest

from bench import corpus
from bench.prepare import (
    RECIPE,
    SLUICE_DEEPSEEK,
    SLUICE_PREPARE,
    SLUICE_RENDER_ENCODE,
    TRANSFORMERS,
    benchmark,
    deepseek_context,
    deepseek_report,
    measure_deepseek,
    percentile,
    preparation_context,
    report,
    taken,
)

CHATS, REPEAT = 3, 2


@pytest.fixture(scope="module")
def baseline_tokenizer() -> Any:
    transformers = pytest.importorskip("transformers")
    tok = next(iter(preparation_context().models.values())).tokenizer
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok.tokenizer, chat_template=tok.chat_template
    )


def test_the_corpus_is_deterministic_and_shaped_like_requests():
    chats = corpus.chats(40, seed=7)
    assert [c.body() for c in chats] == [c.body() for c in corpus.chats(40, seed=7)]
    assert [c.body() for c in chats] != [c.body() for c in corpus.chats(40, seed=8)]
    for chat in chats:
        roles = [message["role"] for message in chat.messages]
        assert corpus.MIN_TURNS <= len(roles) <= corpus.MAX_TURNS + 1
        assert roles[-1] in ("user", "tool")  # the model answers next
        assert "system" not in roles[1:]
        assert all(isinstance(message["content"], str) for message in chat.messages)
    assert any(chat.tools for chat in chats) and not all(chat.tools for chat in chats)


def test_percentile_is_nearest_rank():
    values = list(range(1, 101))
    assert [percentile(values, p) for p in (50, 99, 100)] == [50, 99, 100]
    assert percentile([7], 99) == 7


def test_the_benchmark_prints_a_row_per_method(baseline_tokenizer: Any):
    chats = corpus.chats(CHATS)
    measured = benchmark(chats, REPEAT, preparation_context(), baseline_tokenizer)

    assert [m.method for m in measured] == [SLUICE_PREPARE, SLUICE_RENDER_ENCODE, TRANSFORMERS]
    for m in measured:
        assert len(m.samples) == CHATS and all(len(s) == REPEAT for s in m.samples)
        assert all(ns > 0 for s in m.samples for ns in s)
        assert all(m.token_ids)
    assert measured[0].token_ids == measured[1].token_ids  # prepare encodes what render+encode do

    text = report(chats, measured)
    for method in (SLUICE_PREPARE, SLUICE_RENDER_ENCODE, TRANSFORMERS):
        line = next(line for line in text.splitlines() if line.startswith(method))
        assert len(line.split()) >= 5
    assert "p50 µs" in text and "p99 µs" in text
    assert "541 µs" in text and "812 µs" in text  # the quoted reference and the goal


def test_the_deepseek_section_compares_with_deepseek_recipe():
    chats = corpus.chats(CHATS)
    measured = measure_deepseek(chats, REPEAT, deepseek_context())
    assert [m.method for m in measured] == [SLUICE_DEEPSEEK, RECIPE]
    assert measured[0].token_ids == measured[1].token_ids  # the same prompts, id for id
    text = deepseek_report(chats, measured)
    assert f"identical token ids on {len(taken(chats))})" in text and "÷ ds p50" in text
