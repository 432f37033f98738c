"""A request resumed on another engine continues exactly where it stopped.

This is what a redelivered job does after a worker dies: the new engine gets
the prompt, the tokens already streamed and how much text the client has.
"""

from __future__ import annotations

import pytest

from engine.llm_engine import LLMEngine
from shared.events import Finish, Text
from shared.sampling import SamplingParams
from tests.engine.conftest import EngineFactory


def run(
    engine: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams, **resume: object
) -> tuple[list[int], list[str], Finish]:
    engine.add_request(request_id, prompt, params, **resume)
    ids: list[int] = []
    chunks: list[str] = []
    finish = None
    while engine.has_unfinished():
        for event in engine.step():
            if isinstance(event, Text):
                ids += event.token_ids
                chunks.append(event.text)
            elif isinstance(event, Finish):
                finish = event
    assert finish is not None
    return ids, chunks, finish


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("cut", [1, 9, 23])
def test_resumed_request_matches_uninterrupted(
    make_engine: EngineFactory, temperature: float, cut: int
) -> None:
    engine = make_engine()
    prompt = engine.tokenizer.tokenizer.encode("Write a short poem about rivers:").ids
    params = SamplingParams(
        max_tokens=32, temperature=temperature, seed=7, ignore_eos=True, stop=["zzqx"]
    )  # a stop string that never matches holds text back
    ids, chunks, finish = run(engine, "whole", prompt, params)

    emitted = "".join(chunks[:cut])
    again, rest, resumed_finish = run(
        make_engine(),
        "resumed",
        prompt,
        params,
        generated_token_ids=ids[:cut],
        emitted_chars=len(emitted),
    )
    assert ids[:cut] + again == ids
    assert emitted + "".join(rest) == "".join(chunks)
    assert resumed_finish.completion_tokens == finish.completion_tokens == 32
