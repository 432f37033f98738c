"""A worker whose KV cache is full takes no more jobs until its engine has room again.

A host on an engine of its own (the suite's weights, a KV cache of 24 blocks
of 16 tokens) runs three requests of 160-token prompts: two fit, the third
waits for blocks. The intake must close while it waits and open once the
engine admitted it, which is what the broker transport reads as credit. (That
the intake stays open when only the token budget or the sequence slots make
a request wait is the scheduler's ``kv_bound``, tested in
``tests/engine/test_scheduler.py``.)
"""

from __future__ import annotations

import time

import redis

from engine.llm_engine import LLMEngine
from shared import keys
from shared.registry import DEFAULT_MODEL
from shared.sampling import SamplingParams
from shared.wire import PreparedRequest
from tests.workers.conftest import engine_on_the_same_weights, wait_until
from workers.host import Outcome, Run, WorkerHost
from workers.publisher import EventPublisher
from workers.runtime import connect

PROMPT_TOKENS = 160  # 11 blocks each with their tokens: two fit in 24 blocks, three do not
KV_BLOCKS = 24
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def long_run(client: redis.Redis, index: int) -> Run:
    """A run of its request's first attempt (the lease taken, as a task takes it)."""
    prompt = [100 + (index * 37 + position) % 900 for position in range(PROMPT_TOKENS)]
    request = PreparedRequest(f"kv-{index}-{time.time_ns()}", DEFAULT_MODEL, prompt, PARAMS)
    return Run(request, attempt=int(client.incr(keys.lease(request.request_id))))


def test_the_intake_closes_while_the_engine_waits_for_blocks(
    engine: LLMEngine, quiet_redis_url: str
) -> None:
    client = connect(quiet_redis_url)
    host = WorkerHost(
        engine_on_the_same_weights(engine, num_blocks=KV_BLOCKS), EventPublisher(client, "kv")
    )
    opened: list[bool] = []
    host.intake.attach(lambda: opened.append(host.intake.open))
    host.start()
    runs = [long_run(client, index) for index in range(3)]
    try:
        assert host.intake.open
        for run in runs:
            host.submit(run)
        wait_until(lambda: host.intake.closings >= 1, 30, "the intake to close")

        outcomes = [run.wait(60) for run in runs]
    finally:
        host.stop(10)
        client.close()

    assert outcomes == [Outcome.FINISHED] * 3
    assert host.intake.open and opened == [True] * host.intake.closings  # each opening woke
