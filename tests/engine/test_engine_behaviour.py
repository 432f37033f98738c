"""LLMEngine on the default model: what a caller of ``add_request``/``step`` can rely on.

Outputs are compared token for token under greedy decoding (or a fixed seed),
so every property here is exact: batching, chunking, prefix reuse and
preemption may change how the work is done, never what comes out.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable

import pytest

from engine.detokenizer import OutputText
from engine.llm_engine import LLMEngine
from engine.setup import LoadedModel
from shared.events import Finish, FinishReason, InferenceEvent, Ready, Text, TokenLogprob
from shared.sampling import SamplingParams

pytestmark = pytest.mark.slow

REPLACEMENT = "\ufffd"
EngineFactory = Callable[..., LLMEngine]  # the make_engine fixture


def greedy(max_tokens: int = 8, **kwargs: object) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kwargs)  # type: ignore[arg-type]


@dataclasses.dataclass
class Outcome:
    """Everything the engine said about one request, in order."""

    events: list[InferenceEvent] = dataclasses.field(default_factory=list)

    @property
    def chunks(self) -> list[str]:
        return [e.text for e in self.events if isinstance(e, Text)]

    @property
    def text(self) -> str:
        return "".join(self.chunks)

    @property
    def token_ids(self) -> list[int]:
        return [t for e in self.events if isinstance(e, Text) for t in e.token_ids]

    @property
    def logprobs(self) -> list[TokenLogprob]:
        return [lp for e in self.events if isinstance(e, Text) for lp in e.logprobs or []]

    @property
    def ready(self) -> Ready:
        (ready,) = [e for e in self.events if isinstance(e, Ready)]
        return ready

    @property
    def finish(self) -> Finish:
        (finish,) = [e for e in self.events if isinstance(e, Finish)]
        return finish


Request = tuple[str, list[int], SamplingParams]


def collect(outcomes: dict[str, Outcome], events: Iterable[InferenceEvent]) -> None:
    for event in events:
        outcomes.setdefault(event.request_id, Outcome()).events.append(event)


def drain(engine: LLMEngine, outcomes: dict[str, Outcome], max_steps: int = 1000) -> None:
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return
        collect(outcomes, engine.step())
    raise AssertionError(f"engine still busy after {max_steps} steps")


def run_requests(engine: LLMEngine, requests: Iterable[Request]) -> dict[str, Outcome]:
    """Add every request, then step until the engine is idle."""
    outcomes: dict[str, Outcome] = {}
    for request_id, ids, params in requests:
        engine.add_request(request_id, ids, params)
        outcomes[request_id] = Outcome()
    drain(engine, outcomes)
    return outcomes


def run_one(engine: LLMEngine, ids: list[int], params: SamplingParams) -> Outcome:
    return run_requests(engine, [("only", ids, params)])["only"]


def encode(engine: LLMEngine, text: str) -> list[int]:
    """Plain text → ids without special tokens (the default model adds no BOS)."""
    return engine.tokenizer.tokenizer.encode(text, add_special_tokens=False).ids


def chat(engine: LLMEngine, user: str) -> list[int]:
    """A one-turn ChatML prompt, the default model's own format."""
    return encode(engine, f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")


def decode(engine: LLMEngine, ids: list[int]) -> str:
    return engine.tokenizer.tokenizer.decode(ids, skip_special_tokens=True)


def assert_no_leak(engine: LLMEngine) -> None:
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


WORDS = [
    *("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while"),
    *("seven", "wizards", "quietly", "hex", "jolly", "mobsters", "near", "big", "rivers"),
]


def varied_prompts(engine: LLMEngine, count: int) -> list[list[int]]:
    """``count`` distinct prompts from 1 to ~70 tokens."""
    prompts = [encode(engine, "Hello")]
    for i in range(1, count):
        text = f"Story {i}: " + " ".join(WORDS[: 2 + (i * 7) % 19]) * (1 + i % 3)
        prompts.append(encode(engine, text))
    return prompts


# --- batching -------------------------------------------------------------------------------


def test_greedy_output_is_the_same_alone_and_in_a_staggered_batch(
    make_engine: EngineFactory,
) -> None:
    batched = make_engine(max_num_batched_tokens=48)  # long prompts are chunked
    prompts = varied_prompts(batched, 16)
    assert len(prompts[0]) == 1 and max(map(len, prompts)) > 48
    outcomes: dict[str, Outcome] = {}
    for i, ids in enumerate(prompts):
        batched.add_request(f"r{i}", ids, greedy(8))
        if i % 3 == 2:  # new requests arrive while others are mid-prefill or decoding
            collect(outcomes, batched.step())
    drain(batched, outcomes)
    assert_no_leak(batched)

    for i, outcome in sorted(outcomes.items()):
        assert outcome.finish.reason is FinishReason.LENGTH, i
        assert len(outcome.token_ids) == 8, i
        assert outcome.text == decode(batched, outcome.token_ids), i

    alone = make_engine()
    longest = max(range(16), key=lambda i: len(prompts[i]))
    for i in sorted({0, 5, 10, longest}):
        single = run_one(alone, prompts[i], greedy(8))
        assert single.token_ids == outcomes[f"r{i}"].token_ids, f"prompt {i}: {len(prompts[i])}"
        assert single.text == outcomes[f"r{i}"].text


# --- prefix caching -------------------------------------------------------------------------


def test_prefix_cache_hit_reports_cached_tokens_and_keeps_the_output(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()
    prefix = encode(engine, " ".join(["alpha beta gamma delta epsilon"] * 20))[:64]
    first = prefix + encode(engine, " Summarize the list above:")
    second = prefix + encode(engine, " Count the words above:")

    a = run_one(engine, first, greedy(8))
    b = run_one(engine, second, greedy(8))
    again = run_one(engine, first, greedy(8))
    assert a.ready.cached_tokens == 0
    assert a.ready.prompt_tokens == len(first)
    assert b.ready.cached_tokens >= 48
    assert b.ready.cached_tokens <= 64  # the prefix ends where the prompts differ
    assert again.ready.cached_tokens == (len(first) - 1) // 16 * 16
    assert again.token_ids == a.token_ids

    uncached = make_engine(enable_prefix_caching=False)
    b_uncached = run_one(uncached, second, greedy(8))
    assert b_uncached.ready.cached_tokens == 0
    assert b.token_ids == b_uncached.token_ids
    assert_no_leak(engine)
    assert_no_leak(uncached)


# --- preemption -----------------------------------------------------------------------------


def test_preemption_recomputes_to_the_same_output(make_engine: EngineFactory) -> None:
    reference = make_engine()
    texts = [
        "The history of the Roman Empire begins with",
        "In a small village by the sea, there lived an old fisherman who",
        "Python is a programming language that",
        "My favourite recipe for apple pie needs flour, butter and",
    ]
    requests: list[Request] = [
        (f"g{i}", encode(reference, text), greedy(16)) for i, text in enumerate(texts)
    ]
    requests.append(
        ("seeded", encode(reference, "Once upon a time"), SamplingParams(max_tokens=16, seed=3))
    )
    # One request needs at most two blocks (< 32 tokens); five blocks cannot hold them all.
    assert all(len(ids) + params.max_tokens <= 32 for _, ids, params in requests)
    expected = run_requests(reference, requests)

    tight = make_engine(num_blocks=5)
    got = run_requests(tight, requests)
    assert tight.stats.preemptions > 0
    for request_id, outcome in expected.items():
        assert got[request_id].token_ids == outcome.token_ids, request_id
        assert got[request_id].text == outcome.text, request_id
        assert got[request_id].finish.reason is outcome.finish.reason
        assert len([e for e in got[request_id].events if isinstance(e, Ready)]) == 1
    assert_no_leak(tight)


# --- abort ----------------------------------------------------------------------------------


def test_abort_frees_blocks_at_once_and_ends_the_stream(make_engine: EngineFactory) -> None:
    engine = make_engine()
    bm = engine.block_manager
    engine.add_request("keep", encode(engine, "Tell me about the sea. " * 3), greedy(12))
    engine.add_request("drop", encode(engine, "Tell me about mountains. " * 4), greedy(12))
    outcomes: dict[str, Outcome] = {}
    for _ in range(3):
        collect(outcomes, engine.step())
    held_by_drop = len(engine.sequences["drop"].block_table)
    assert held_by_drop > 0
    free_before = bm.num_free_blocks
    produced = len(outcomes["drop"].token_ids)

    assert engine.abort("drop")
    assert bm.num_free_blocks == free_before + held_by_drop
    assert not engine.abort("drop")  # already gone
    assert not engine.abort("never-added")

    events = engine.step()
    aborted = [e for e in events if e.request_id == "drop"]
    assert aborted == [Finish("drop", FinishReason.ABORT, produced)]
    collect(outcomes, events)
    drain(engine, outcomes)
    assert [e for e in outcomes["drop"].events if isinstance(e, Finish)] == aborted
    assert outcomes["drop"].events[-1] == aborted[0]  # nothing after the Finish
    assert outcomes["keep"].finish.reason is FinishReason.LENGTH
    assert len(outcomes["keep"].token_ids) == 12
    assert_no_leak(engine)

    # A request aborted before it was ever scheduled: no Ready, just the Finish.
    engine.add_request("queued", encode(engine, "Hi"), greedy(4))
    assert engine.abort("queued")
    assert bm.num_free_blocks == bm.num_blocks
    assert engine.step() == [Finish("queued", FinishReason.ABORT, 0)]
    assert engine.step() == []
    assert_no_leak(engine)


def test_abort_of_the_only_request_returns_every_block(make_engine: EngineFactory) -> None:
    engine = make_engine()
    engine.add_request("solo", encode(engine, "Count to ten: one, two,"), greedy(20))
    for _ in range(3):
        engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    engine.abort("solo")
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.step() == [Finish("solo", FinishReason.ABORT, 3)]
    assert not engine.has_unfinished()


# --- sampling -------------------------------------------------------------------------------


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()
    story = encode(engine, "Once upon a time")

    def seeded(seed: int | None) -> SamplingParams:
        return SamplingParams(temperature=1.0, max_tokens=24, seed=seed)

    alone = run_one(engine, story, seeded(1234))

    outcomes: dict[str, Outcome] = {}
    engine.add_request("same", story, seeded(1234))
    engine.add_request("unseeded", encode(engine, "The weather today is"), seeded(None))
    collect(outcomes, engine.step())
    engine.add_request("again", story, seeded(1234))  # joins a step later
    engine.add_request("other-seed", story, seeded(99))
    engine.add_request("other-prompt", encode(engine, "My favourite food is"), seeded(5))
    drain(engine, outcomes)

    assert len(alone.token_ids) == 24
    assert outcomes["same"].token_ids == alone.token_ids
    assert outcomes["again"].token_ids == alone.token_ids
    assert outcomes["same"].text == alone.text
    assert outcomes["other-seed"].token_ids != alone.token_ids
    assert_no_leak(engine)


def test_logprobs_report_the_chosen_token_and_top_alternatives(make_engine: EngineFactory) -> None:
    engine = make_engine()
    prompt = encode(engine, "The capital of France is")
    outcomes = run_requests(
        engine,
        [
            ("top5", prompt, greedy(4, logprobs=5)),
            ("top0", prompt, greedy(4, logprobs=0)),
            ("none", prompt, greedy(4)),
        ],
    )
    top5 = outcomes["top5"]
    assert len(top5.logprobs) == len(top5.token_ids) == 4
    for token, lp in zip(top5.token_ids, top5.logprobs, strict=True):
        assert lp.token_id == token
        assert len(lp.top) == 5
        assert lp.top[0][0] == token  # greedy picks the most likely token
        assert lp.top[0][1] == pytest.approx(lp.logprob, abs=1e-5)
        values = [value for _, value in lp.top]
        assert values == sorted(values, reverse=True)
        assert all(value <= 0.0 for value in values) and lp.logprob <= 0.0
        assert len({token_id for token_id, _ in lp.top}) == 5

    top0 = outcomes["top0"]
    assert top0.token_ids == top5.token_ids
    assert [lp.top for lp in top0.logprobs] == [[]] * 4
    assert [lp.logprob for lp in top0.logprobs] == pytest.approx(
        [lp.logprob for lp in top5.logprobs], abs=1e-5
    )
    assert all(e.logprobs is None for e in outcomes["none"].events if isinstance(e, Text))


# --- stopping -------------------------------------------------------------------------------


def _stop_string_candidate(engine: LLMEngine, ids: list[int]) -> tuple[int, str]:
    """A token index i whose two-token text starts its first occurrence in the output."""
    text = decode(engine, ids)
    for i in range(2, len(ids) - 2):
        span = decode(engine, ids[i : i + 2])
        usable = len(span.strip()) >= 2 and REPLACEMENT not in span
        if usable and text.find(span) == len(decode(engine, ids[:i])):
            return i, span
    raise AssertionError(f"no usable two-token span in {text!r}")


def test_stop_string_ends_generation_right_before_it(make_engine: EngineFactory) -> None:
    engine = make_engine()
    prompt = encode(engine, "In a small village by the sea, there lived an old fisherman who")
    full = run_one(engine, prompt, greedy(24))
    index, stop = _stop_string_candidate(engine, full.token_ids)

    cut = run_one(engine, prompt, greedy(24, stop=["<never appears>", stop]))
    assert cut.finish.reason is FinishReason.STOP
    assert cut.finish.stop == stop
    assert stop not in cut.text
    assert cut.text == full.text[: full.text.index(stop)]
    assert cut.token_ids == full.token_ids[: index + 2]  # stops on the token that completes it
    assert cut.finish.completion_tokens == index + 2
    assert_no_leak(engine)


def test_a_stop_string_before_min_tokens_stays_in_the_text(make_engine: EngineFactory) -> None:
    """Before ``min_tokens`` nothing stops the output, and a stop string it writes is text."""
    engine = make_engine()
    prompt = chat(engine, "Tell me a story about a dragon.")
    full = run_one(engine, prompt, greedy(24, ignore_eos=True))
    stop = full.text[4:7]
    assert full.text.index(stop) == 4  # the first occurrence: the premise of this test
    kept = run_one(engine, prompt, greedy(24, ignore_eos=True, stop=[stop], min_tokens=24))
    assert kept.finish.reason is FinishReason.LENGTH and kept.text == full.text
    assert_no_leak(engine)


def test_stop_tokens_min_tokens_ignore_eos_and_max_tokens(make_engine: EngineFactory) -> None:
    engine = make_engine()
    eos_ids = set(engine.tokenizer.stop_token_ids)
    prompt = chat(engine, "What is 2+2? Answer with one number.")
    plain = run_one(engine, prompt, greedy(16))
    # The model answers briefly and ends its turn: the premise of this test.
    assert plain.finish.reason is FinishReason.STOP
    assert plain.token_ids[-1] in eos_ids and plain.finish.stop == plain.token_ids[-1]
    assert plain.text == decode(engine, plain.token_ids[:-1])
    answer = plain.token_ids[:-1]
    assert len(answer) >= 3

    pick = next(i for i in range(1, len(answer)) if answer[i] not in answer[:i])
    min_tokens = len(plain.token_ids) + 3
    outcomes = run_requests(
        engine,
        [
            ("stop-id", prompt, greedy(16, stop_token_ids=[answer[pick]])),
            ("min", prompt, greedy(16, min_tokens=min_tokens)),
            ("ignore-eos", prompt, greedy(12, ignore_eos=True)),
            ("length", prompt, greedy(2)),
        ],
    )

    stop_id = outcomes["stop-id"]
    assert stop_id.finish.reason is FinishReason.STOP
    assert stop_id.finish.stop == answer[pick]
    assert stop_id.token_ids == answer[: pick + 1]
    assert stop_id.text == decode(engine, answer[:pick])  # the stop token's text is not output

    minimum = outcomes["min"]
    assert len(minimum.token_ids) >= min_tokens
    assert not eos_ids & set(minimum.token_ids[:min_tokens])
    assert minimum.token_ids[: len(answer)] == answer

    ignore = outcomes["ignore-eos"]
    assert ignore.finish.reason is FinishReason.LENGTH
    assert len(ignore.token_ids) == ignore.finish.completion_tokens == 12
    assert ignore.token_ids[: len(plain.token_ids)] == plain.token_ids  # eos was generated...
    assert ignore.text == decode(engine, ignore.token_ids)  # ...and printed as nothing

    length = outcomes["length"]
    assert length.finish == Finish("length", FinishReason.LENGTH, 2)
    assert length.token_ids == answer[:2]
    assert_no_leak(engine)


def test_context_limit_ends_generation_with_length(make_engine: EngineFactory) -> None:
    engine = make_engine(num_blocks=4)  # 64 token slots: max_model_len 64
    assert engine.max_model_len == 64
    prompt = encode(engine, "word " * 200)[:60]
    outcome = run_one(engine, prompt, greedy(100))
    assert outcome.finish.reason is FinishReason.LENGTH
    assert len(outcome.token_ids) == 64 - 60
    with pytest.raises(ValueError, match="maximum is 63"):
        engine.add_request("too-long", encode(engine, "word " * 200)[:64], greedy())
    assert_no_leak(engine)


# --- detokenizer ----------------------------------------------------------------------------


def test_streamed_chunks_are_whole_characters(make_engine: EngineFactory) -> None:
    engine = make_engine()
    outcomes = run_requests(
        engine,
        [
            ("cjk", encode(engine, "中文：你好，世界！我们今天去"), greedy(30)),
            ("emoji", encode(engine, "Fruits: 🍎🍌🍇🍉🍓"), greedy(30)),
            ("english", encode(engine, "The capital of France is"), greedy(30)),
        ],
    )
    for request_id, outcome in outcomes.items():
        assert not any(REPLACEMENT in chunk for chunk in outcome.chunks), request_id
        # A character still incomplete when max_tokens ends the output is dropped.
        assert outcome.text == decode(engine, outcome.token_ids).rstrip(REPLACEMENT), request_id
    for request_id in ("cjk", "emoji"):
        chunks = outcomes[request_id].chunks
        assert any(ord(char) > 0x2E80 for char in outcomes[request_id].text), request_id
        assert "" in chunks  # some tokens ended inside a character and were held back


def test_output_after_a_prompt_that_ends_inside_a_character(loaded_model: LoadedModel) -> None:
    # A resumed request's prompt ends with the tokens already streamed, possibly
    # half a character: the output must continue with exactly the missing text.
    tokenizer = loaded_model.tokenizer.tokenizer
    ids = tokenizer.encode("Fruits: 🍎🍌 and 你好", add_special_tokens=False).ids
    wrong = {}
    for cut in range(1, len(ids)):
        output = OutputText.start(tokenizer, ids[:cut], [])
        chunks = []
        for token in ids[cut:]:
            output.append(token)
            chunks.append(output.take(final=False))
        chunks.append(output.take(final=True))
        already = tokenizer.decode(ids[:cut]).rstrip(REPLACEMENT)
        expected = tokenizer.decode(ids)[len(already) :]
        if "".join(chunks) != expected:
            wrong[cut] = "".join(chunks)
    assert wrong == {}


# --- validation -----------------------------------------------------------------------------


def test_invalid_requests_are_rejected_with_a_clear_message(make_engine: EngineFactory) -> None:
    engine = make_engine(num_blocks=8)  # max_model_len 128
    vocab = engine.model_config.vocab_size
    with pytest.raises(ValueError, match="must not be empty"):
        engine.add_request("empty", [], greedy())
    with pytest.raises(ValueError, match=r"128|127"):
        engine.add_request("long", [100] * 128, greedy())
    with pytest.raises(ValueError, match=f"token id {vocab} .*vocabulary"):
        engine.add_request("oov", [100, vocab, 101], greedy())
    with pytest.raises(ValueError, match="token id -1"):
        engine.add_request("negative", [100, -1], greedy())
    assert not engine.has_unfinished()  # nothing half-added

    engine.add_request("dup", [100, 101], greedy(2))
    with pytest.raises(ValueError, match="'dup'"):
        engine.add_request("dup", [102, 103], greedy(2))
    outcomes: dict[str, Outcome] = {}
    drain(engine, outcomes)
    assert outcomes["dup"].token_ids and len(outcomes["dup"].token_ids) == 2
    assert outcomes["dup"].ready.prompt_tokens == 2  # the first request, untouched
    engine.add_request("dup", [102, 103], greedy(2))  # a finished id may be reused
    drain(engine, outcomes)
    assert_no_leak(engine)


def test_out_of_vocab_stop_token_id_is_rejected_up_front(make_engine: EngineFactory) -> None:
    engine = make_engine(num_blocks=8)
    vocab = engine.model_config.vocab_size
    params = greedy(4, min_tokens=2, stop_token_ids=[vocab + 10])
    try:
        with pytest.raises(ValueError, match="stop_token_ids"):
            engine.add_request("bad-stop", [100, 101], params)
    finally:
        engine.abort("bad-stop")


def test_the_engine_names_what_it_runs_on_at_start(
    make_engine: Callable[..., LLMEngine], caplog: pytest.LogCaptureFixture
) -> None:
    """Its start line says which attention backend, dtype and device it runs, and whether a
    request's tokens may depend on what else it runs."""
    with caplog.at_level(logging.INFO, logger="engine.llm_engine"):
        engine = make_engine(num_blocks=8)
    line = f"engine ready: {engine.description}"
    assert line in caplog.messages
    dtype = str(engine.precision.dtype).removeprefix("torch.")
    assert f"attention torch, {dtype} on cpu (dtype auto: {dtype}" in engine.description
    invariant = engine.precision.batch_invariant
    assert engine.description.endswith("batch-invariant" if invariant else "not batch-invariant")
    assert "8 KV blocks of 16" in engine.description
