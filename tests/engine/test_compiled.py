"""Decode steps through the compiled graphs give what eager steps give, and a later start
loads the graphs an earlier one compiled."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine import compiled as compiled_module
from engine.attention import paged_decode
from engine.config import EngineArgs
from engine.llm_engine import LLMEngine
from engine.model import vnni_gemm
from shared.events import Text, TokenLogprob
from tests.engine.test_registry_models import make_tiny_model

PROMPTS = ["hello there", "the sea at night is", "one two three four five six"]
TOLERANCE = {"float32": 1e-3, "bfloat16": 5e-2}  # logprobs of a graph against an eager step
MANY = [f"request {i}: {prompt}" for i in range(3) for prompt in PROMPTS]  # 9 rows


@pytest.mark.parametrize(
    ("dtype", "quantization"), [("float32", "none"), ("bfloat16", "int4")], ids=["float32", "int4"]
)
def test_compiled_decode_matches_eager(tmp_path: Path, dtype: str, quantization: str) -> None:
    weights = str(make_tiny_model(tmp_path / "tiny", hidden_size=64, intermediate_size=128))
    options = dict(dtype=dtype, quantization=quantization, max_num_seqs=len(MANY))
    compiled = LLM(weights, enforce_eager=False, **options)
    eager = LLM(weights, enforce_eager=True, **options)
    assert "decode steps compiled once warm" in compiled.engine.description
    graph = compiled.engine.runner.compiled
    assert graph is not None and graph.loaded  # warming up loaded the two graphs
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    for prompts in (PROMPTS[:1], PROMPTS, MANY):  # one row, then 3 and 9 in the many-rows graph
        ours, theirs = compiled.generate(prompts, params), eager.generate(prompts, params)
        for a, b in zip(ours, theirs, strict=True):
            if compiled.engine.precision.batch_invariant:  # the same bits, graph or not
                assert a.logprobs == b.logprobs
            else:  # bfloat16 without the engine's kernels rounds as each op chooses
                assert_same_greedy_path(a.logprobs, b.logprobs, TOLERANCE[dtype])
    assert graph.steps == 3 * 23  # every step after each batch's prefill


def test_an_engine_whose_graphs_fail_to_compile_steps_eagerly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Without a C++ compiler the child fails: the engine logs why, publishes nothing and
    serves eagerly."""
    monkeypatch.setattr(compiled_module, "CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # nothing cached
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    weights = str(make_tiny_model(tmp_path / "tiny", hidden_size=64, intermediate_size=128))
    with caplog.at_level(logging.WARNING, logger="engine.model_runner"):
        llm = LLM(weights, dtype="float32", max_num_seqs=1, enforce_eager=False)
    assert llm.engine.runner.compiled is None
    [failure] = [r for r in caplog.records if "compiling them failed" in r.message]
    assert "no-such-compiler" in str(failure.exc_info[1])  # the child's own error
    assert not [entry for entry in (tmp_path / "cache" / "decode").iterdir() if entry.is_dir()]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    assert len(llm.generate(PROMPTS[:1], params)[0].token_ids) == 4


def compiling(caplog: pytest.LogCaptureFixture) -> int:
    return sum("compiling the decode graphs" in r.message for r in caplog.records)


def assert_same_greedy_path(
    ours: list[TokenLogprob], theirs: list[TokenLogprob], tolerance: float
) -> None:
    """The same tokens with logprobs within ``tolerance``: float32's GEMMs round by row count,
    and a graph's differ from an eager step's."""
    assert [x.token_id for x in ours] == [y.token_id for y in theirs]
    for x, y in zip(ours, theirs, strict=True):
        assert x.logprob == pytest.approx(y.logprob, abs=tolerance)


def test_a_server_steps_eagerly_while_the_graphs_build_and_a_later_start_loads_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A server's first start does not wait for the compile: steps run eagerly until the
    graphs are built, the next step loads them, and the stream goes on through them with the
    tokens (and, where the engine is batch-invariant, the logprobs) an eager engine gives.

    A later start on the same weights loads what the first compiled. Only the constants
    compiling made are stored: the graphs run on the model's own tensors, so the weights are
    held once. Compiling deletes entries no start has loaded for a month."""
    monkeypatch.setattr(compiled_module, "CACHE_DIR", str(tmp_path / "cache"))
    root = tmp_path / "cache" / "decode"
    stale, recent = root / "stale", root / "recent"  # entries of other models or versions
    for entry in (stale, recent):
        entry.mkdir(parents=True)
        (entry / "one.so").write_bytes(b"")
    long_ago = time.time() - compiled_module.STALE_AFTER_S - 60
    os.utime(stale, (long_ago, long_ago))
    weights = str(make_tiny_model(tmp_path / "tiny", hidden_size=64, intermediate_size=128))
    options = dict(max_num_seqs=4)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=1)
    [expected] = LLM(weights, enforce_eager=True, **options).generate(PROMPTS[1:2], params)

    engine = LLMEngine(EngineArgs(model=weights, enforce_eager=False, **options))
    engine.warm_up(background=True)
    graph = engine.runner.compiled
    assert graph is not None and not graph.loaded
    engine.add_request("r", engine.tokenizer.tokenizer.encode(PROMPTS[1]).ids, params)
    texts: list[Text] = []
    while len(texts) < 5:
        texts += [event for event in engine.step() if isinstance(event, Text)]
    assert not graph.loaded and graph.steps == 0  # eager while the compile runs
    assert graph.wait_built(timeout=900)
    while engine.has_unfinished():
        texts += [event for event in engine.step() if isinstance(event, Text)]
    assert graph.loaded and graph.steps > 0  # switched mid-stream
    logprobs = [entry for text in texts for entry in text.logprobs or []]
    assert [t for text in texts for t in text.token_ids] == expected.token_ids
    if engine.precision.batch_invariant:
        assert logprobs == expected.logprobs
    else:
        assert_same_greedy_path(
            logprobs,
            expected.logprobs,
            TOLERANCE[str(engine.precision.dtype).removeprefix("torch.")],
        )

    with caplog.at_level(logging.INFO, logger="engine.compiled"):
        later = LLM(weights, enforce_eager=False, **options)
    assert compiling(caplog) == 0 and later.engine.runner.compiled.loaded
    [again] = later.generate(PROMPTS[1:2], params)
    assert again.token_ids == expected.token_ids

    assert not stale.exists()  # compiling deleted what no start had loaded for a month
    [compiled] = {entry for entry in root.iterdir() if entry.is_dir()} - {recent}
    assert (root / f"{compiled.name}.lock").is_file()  # what a second start would wait on
    ours = vnni_gemm.available() or paged_decode.available()
    calls = ["one.json", "many.json"] if ours else []  # the graphs call the engine's kernels
    made = ["one.constants", "one.so", "many.constants", "many.so"]
    assert sorted(p.name for p in compiled.iterdir()) == sorted([*made, "spec.json", *calls])
    own = compiled_module.model_tensors(later.engine.runner.model)
    for name in ("one", "many"):
        _, made_file = compiled_module.graph_files(compiled, name)
        assert not torch.load(made_file, weights_only=True).keys() & own.keys()
