"""On an engine whose model computes in another process, a step's events go to the outbox
while the next step computes, except a step's first tokens, which go before it.

The engine is the suite's real one, driven as ``VllmEngine`` drives vLLM's: each
step calls ``while_running`` as it begins, where vLLM's would once its model
process has the step. The job runs through the task's own code (``run_job``) on
a host of its own, as in ``test_drain.py``.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from engine.llm_engine import LLMEngine
from shared.events import InferenceEvent, Ready
from shared.registry import DEFAULT_MODEL
from shared.sampling import SamplingParams
from shared.wire import Deadlines, PreparedRequest, QueuedRequest, encode_queued
from tests.workers.conftest import (
    PROMPT,
    Producer,
    engine_on_the_same_weights,
    take_as_a_worker,
    task_context,
)
from workers.host import WorkerHost
from workers.publisher import Batch, EventPublisher
from workers.runtime import connect
from workers.task import run_job

TOKENS = 4


class HandingOver:
    """A real engine whose steps call ``while_running`` first; ``log`` records each step's
    start and, through ``record_puts``, what the host puts in its outbox."""

    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine
        self.while_running: Callable[[], None] = lambda: None
        self.log: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def step(self) -> list[InferenceEvent]:
        self.log.append("step")
        self.while_running()
        return self._engine.step()

    def record_puts(self, host: WorkerHost) -> None:
        outbox = host._outbox
        put = outbox.put

        def recorded(batches: list[Batch]) -> None:
            kinds = {type(event).__name__ for batch in batches for event in batch.events}
            self.log.append("put " + "+".join(sorted(kinds)))
            put(batches)

        outbox.put = recorded  # type: ignore[method-assign]


def test_first_tokens_are_written_before_the_next_step_and_the_rest_while_it_runs(
    engine: LLMEngine, producer: Producer, redis_url: str
) -> None:
    own = connect(redis_url)
    publisher = EventPublisher(own, DEFAULT_MODEL)
    handing_over = HandingOver(engine_on_the_same_weights(engine))
    host = WorkerHost(handing_over, publisher)  # type: ignore[arg-type]
    handing_over.record_puts(host)
    host.start()
    request_id = uuid.uuid4().hex
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    request = PreparedRequest(request_id, DEFAULT_MODEL, PROMPT, params, created=time.time())
    job = QueuedRequest(request, Deadlines())
    context = task_context(own, publisher, host)
    take_as_a_worker(own, context, [job])
    task = threading.Thread(target=run_job, args=(context, encode_queued(job)))
    try:
        task.start()
        events = producer.wait_end(request_id, timeout=60)
        task.join(10)
    finally:
        host.stop(10)
        own.close()

    assert isinstance(events[1], Ready) and len(events) == 2 + TOKENS + 1  # and Finish
    assert handing_over.log == [
        "step", "put Accepted",  # the add's answer, while the first step computes
        "put Ready+Text",  # the prefill's first token: before the second step
        "step",
        "step", "put Text",  # the second token, while the third step computes
        "step", "put Text",
        "put Finish+Text",  # no step follows: at once
    ]  # fmt: skip
