"""``engine.engine_host``: what both hosts do with a real engine on the default model.

A request the engine refuses ends with an ``invalid_request`` Error, one it
fails on with "the engine failed"; a failed step ends every request with an
Error and leaves no KV block held; the load read back is the engine's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest

from engine.engine_host import add_request, end_after_failed_step, read_load
from engine.llm_engine import LLMEngine
from shared.engine_metrics import EngineLoad
from shared.events import Accepted, Error
from shared.sampling import SamplingParams
from shared.wire import PreparedRequest

pytestmark = pytest.mark.slow

EngineFactory = Callable[..., LLMEngine]  # the make_engine fixture
PROMPT = [1, 9690, 314, 253, 1345, 2380, 28]


def request(request_id: str, prompt: list[int] = PROMPT, max_tokens: int = 32) -> PreparedRequest:
    return PreparedRequest(
        request_id, "default", prompt, SamplingParams(temperature=0, max_tokens=max_tokens)
    )


def free_blocks_are_all(engine: LLMEngine) -> bool:
    return engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_request_the_engine_refuses_ends_with_an_invalid_request_error(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine(num_blocks=8)  # max_model_len 128
    vocab = engine.model_config.vocab_size

    too_long = add_request(engine, request("long", [100] * 128))
    out_of_vocab = add_request(engine, request("oov", [100, vocab]), "oov/2")

    assert isinstance(too_long, Error) and too_long.kind == "invalid_request"
    assert too_long.request_id == "long" and "128" in too_long.message
    assert out_of_vocab == Error(
        "oov",
        f"prompt_token_ids: token id {vocab} is outside the vocabulary [0, {vocab})",
        "invalid_request",
    )
    assert not engine.has_unfinished()
    assert add_request(engine, request("fine"), "fine/1") == Accepted("fine")
    assert list(engine.sequences) == ["fine/1"]  # the engine knows it by the id it was given


def test_a_request_the_engine_fails_on_is_aborted_and_ends_with_an_error(
    make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine()

    def broken_add(seq: object) -> None:  # after the engine took the sequence in
        raise RuntimeError("scheduler broke")

    monkeypatch.setattr(engine.scheduler, "add", broken_add)
    error = add_request(engine, request("r1"), "r1/1")

    assert error == Error("r1", "the engine failed: scheduler broke")
    assert "r1/1" not in engine.sequences and engine.stats.aborted == 1


def test_a_failed_step_ends_every_request_with_an_error_and_frees_their_blocks(
    make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(max_num_seqs=2)
    for name in ("a", "b", "c"):  # c waits: two run at a time
        assert add_request(engine, request(name, [*PROMPT, len(name)])) == Accepted(name)
    engine.step()
    engine.step()
    assert len(engine.scheduler.running) == 2 and len(engine.scheduler.waiting) == 1
    assert not free_blocks_are_all(engine)

    def device_lost(*_: object) -> None:
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "run", device_lost)
    with pytest.raises(RuntimeError) as failure:
        engine.step()
    errors = end_after_failed_step(engine, failure.value)

    assert errors == [Error(name, "the engine failed: device lost") for name in ("a", "b", "c")]
    assert free_blocks_are_all(engine)
    assert not engine.has_unfinished()  # the aborts' Finish events are drained, no one's
    assert engine.stats.aborted == 3


def test_a_request_whose_abort_the_failed_step_lost_still_gets_its_error(
    make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine()
    for name in ("a/1", "b/1"):
        assert add_request(engine, request(name[0]), name) == Accepted(name[0])
    engine.step()
    engine.abort("b/1")  # cancelled: its Finish(abort) waits for the next step

    def device_lost(*_: object) -> None:
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "run", device_lost)
    with pytest.raises(RuntimeError) as failure:
        engine.step()  # takes the Finish(abort) with it
    errors = end_after_failed_step(engine, failure.value, ["a", "b"])

    assert errors == [Error(name, "the engine failed: device lost") for name in ("a", "b")]
    assert free_blocks_are_all(engine) and not engine.has_unfinished()


def test_the_load_is_the_engine_s_as_a_host_s_record(make_engine: EngineFactory) -> None:
    @dataclass(frozen=True, slots=True, kw_only=True)
    class HostLoad(EngineLoad):
        runs: int

    engine = make_engine(num_blocks=16, max_num_seqs=1)
    assert read_load(engine, EngineLoad) == EngineLoad(kv_blocks_total=16)
    for name in ("a", "b"):
        add_request(engine, request(name, max_tokens=4))
    engine.step()
    engine.abort("b")

    load = read_load(engine, HostLoad, runs=7)
    blocks = engine.block_manager
    assert load == HostLoad(
        running=1,
        waiting=0,
        kv_blocks_used=blocks.num_blocks - blocks.num_free_blocks,
        kv_blocks_total=16,
        steps=1,
        generated_tokens=1,
        aborted=1,
        runs=7,
    )
    assert load.kv_blocks_used > 0
