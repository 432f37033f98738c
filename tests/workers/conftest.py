"""A real Redis and one real worker, in this process, for the whole module set.

``redis-server`` runs on a free port without persistence. The worker is the
production stack (``WorkerRuntime`` + the Celery app, thread pool, late acks)
running in a thread, on the default model loaded once with a small KV cache.
Jobs are sent the way the API sends them: ``send_task`` from a Celery app of
their own. Tests share the worker, so each uses request ids of its own and
reads counters as differences.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker

from shared import keys
from shared.event_codec import Entry, decode_entry
from shared.events import Error, Finish, InferenceEvent, Text
from shared.registry import DEFAULT_MODEL
from shared.sampling import SamplingParams
from shared.task_message import REQUEST_HEADER, request_header, task_message
from shared.wire import Deadlines, PreparedRequest, QueuedRequest, encode_queued
from tests.servers import free_port

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine
    from workers.host import WorkerHost
    from workers.publisher import EventPublisher
    from workers.runtime import WorkerRuntime
    from workers.task import TaskContext

Reference = Callable[[list[int], SamplingParams], list[InferenceEvent]]

MAX_MODEL_LEN = 512
CAPACITY = 4
KV_BLOCKS = 128
WORKER_ID = "test-worker"
QUEUE = keys.queue_name(DEFAULT_MODEL)
PROMPT = [1, 9690, 314, 253, 1345, 2380, 28]


def wait_until(condition: Callable[[], object], timeout: float, what: str) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    pytest.fail(f"timed out after {timeout:g}s waiting for {what}")


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    with redis_server() as url:
        yield url


@pytest.fixture
def quiet_redis_url() -> Iterator[str]:
    """A Redis of the test's own: no worker writes to it, so its command counts are the test's."""
    with redis_server() as url:
        yield url


@contextmanager
def redis_server() -> Iterator[str]:
    port = free_port()
    command = ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no"]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port)

    def answers() -> bool:
        try:
            return bool(client.ping())
        except redis.ConnectionError:
            return False

    try:
        wait_until(answers, 10, "redis-server")
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        client.close()
        server.terminate()
        server.wait(10)


@pytest.fixture(scope="session")
def client(redis_url: str) -> Iterator[redis.Redis]:
    connection = redis.Redis.from_url(redis_url)
    yield connection
    connection.close()


@pytest.fixture(scope="session")
def engine() -> LLMEngine:
    import torch

    from engine.config import EngineArgs
    from engine.llm_engine import LLMEngine

    torch.set_num_threads(1)
    args = EngineArgs(max_model_len=MAX_MODEL_LEN, max_num_seqs=CAPACITY, num_kv_blocks=KV_BLOCKS)
    return LLMEngine(args)


def engine_on_the_same_weights(engine: LLMEngine, num_blocks: int = KV_BLOCKS) -> LLMEngine:
    """A second engine on ``engine``'s weights with a KV cache of its own: it shares no state."""
    from engine.attention import KVCache, make_backend
    from engine.llm_engine import LLMEngine
    from engine.setup import LoadedModel

    cfg = engine.model_config
    weights = engine.runner.model
    cache = KVCache.allocate(
        cfg.num_layers, num_blocks, engine.args.block_size, cfg.num_kv_heads, cfg.head_dim,
        engine.precision.dtype, engine.runner.device,
    )  # fmt: skip
    loaded = LoadedModel(
        tokenizer=engine.tokenizer,
        model=weights,
        attention=make_backend(cache, engine.runner.device),
        device=engine.runner.device,
        precision=engine.precision,
        max_model_len=engine.max_model_len,
        num_blocks=num_blocks,
    )
    return LLMEngine(dataclasses.replace(engine.args), loaded)


@pytest.fixture(scope="session")
def reference(engine: LLMEngine) -> Reference:
    """``(prompt, params) -> [Text, ..., Finish]`` from an engine of its own on the same weights.

    This is the offline path (``LLM.generate`` drives exactly this loop), on
    a fresh KV cache so that it shares nothing with the worker's engine.
    """
    offline = engine_on_the_same_weights(engine)

    def run(prompt: list[int], params: SamplingParams) -> list[InferenceEvent]:
        request_id = uuid.uuid4().hex
        offline.add_request(request_id, prompt, params)
        events: list[InferenceEvent] = []
        while offline.has_unfinished():
            events += [e for e in offline.step() if isinstance(e, Text | Finish)]
        return events

    return run


@pytest.fixture(scope="session")
def worker(redis_url: str, engine: LLMEngine) -> Iterator[WorkerRuntime]:
    """The running worker's ``WorkerRuntime``."""
    from workers.broker.app import create_app
    from workers.heartbeat import WorkerIdentity
    from workers.runtime import WorkerRuntime
    from workers.task import register_task

    identity = WorkerIdentity(WORKER_ID, DEFAULT_MODEL)
    runtime = WorkerRuntime.start(redis_url, identity, engine, heartbeat_interval_s=0.25)
    app = create_app(redis_url, [QUEUE], CAPACITY, runtime.link)
    register_task(app, runtime.context)
    try:
        with start_worker(
            app,
            pool="threads",
            concurrency=CAPACITY,
            queues=[QUEUE],
            perform_ping_check=False,
            shutdown_timeout=30,
            loglevel="WARNING",
        ):
            runtime.cancellation.subscribed.wait(10)
            yield runtime
    finally:
        runtime.stop()


@dataclass
class Producer:
    """Sends jobs like the API does and reads their streams back."""

    app: Celery
    client: redis.Redis

    def send(
        self,
        params: SamplingParams,
        prompt: list[int] = PROMPT,
        request_id: str | None = None,
        deadlines: Deadlines | None = None,
        model: str = DEFAULT_MODEL,
        origin: str | None = None,
        named: bool = True,
    ) -> str:
        """``named``: with the job's header, as the API sends it (``workers.broker.taken``)."""
        request_id = request_id or uuid.uuid4().hex
        request = PreparedRequest(request_id, model, prompt, params, created=time.time())
        job = QueuedRequest(request, deadlines or Deadlines(), origin)
        self.send_payload(
            encode_queued(job), {REQUEST_HEADER: request_header(job)} if named else None
        )
        return request_id

    def send_payload(self, payload: str, headers: dict | None = None) -> None:
        self.app.send_task(keys.TASK_NAME, args=[payload], queue=QUEUE, priority=0, headers=headers)

    def entries(self, request_id: str) -> list[Entry]:
        stream = self.client.xrange(keys.event_stream(request_id))
        return [decode_entry(request_id, fields) for _, fields in stream]

    def events(self, request_id: str) -> list[InferenceEvent]:
        return [entry.event for entry in self.entries(request_id)]

    def wait_end(self, request_id: str, timeout: float = 30) -> list[InferenceEvent]:
        def ended() -> list[InferenceEvent] | None:
            events = self.events(request_id)
            return events if events and isinstance(events[-1], Finish | Error) else None

        return wait_until(ended, timeout, f"the end of {request_id}")  # type: ignore[return-value]

    def heartbeat(self) -> dict:
        value = self.client.hget(keys.worker_loads(DEFAULT_MODEL), WORKER_ID)
        assert value is not None, "no heartbeat"
        return json.loads(value)


@pytest.fixture(scope="session")
def producer(redis_url: str, client: redis.Redis) -> Iterator[Producer]:
    from workers.broker.transport import Transport  # its sends push wake tokens, as the API's

    app = Celery("test-api", broker=redis_url, set_as_current=False)
    app.conf.update(task_serializer="json", accept_content=["json"], broker_transport=Transport)
    yield Producer(app, client)
    app.close()


def take_as_a_worker(client: redis.Redis, context: TaskContext, jobs: list[QueuedRequest]) -> None:
    """Take ``jobs`` with the real take script, from a list of their own, into the context's
    taken records, leaving their starts in its ``starts``: what a worker's transport does
    before its task threads run them."""
    from workers.broker.scripts import TAKE
    from workers.broker.transport import START_ARGS, _taken_start

    queue = f"test-take-{uuid.uuid4().hex}"
    for job in jobs:
        client.lpush(queue, task_message(job).body)
    _, started = TAKE.bind(client)(
        keys=[context.taken_key, f"{queue}:wake", queue], args=[len(jobs), 1, *START_ARGS]
    )
    for request_id, replies in zip(started[::2], started[1::2], strict=True):
        context.starts.put(request_id.decode(), _taken_start(replies))


def task_context(client: redis.Redis, publisher: EventPublisher, host: WorkerHost) -> TaskContext:
    """A task context of a worker of its own (its taken records under a fresh id)."""
    from workers.task import TaskContext

    return TaskContext(client, publisher, host, DEFAULT_MODEL, keys.taken(uuid.uuid4().hex))


def text_of(events: list[InferenceEvent]) -> str:
    return "".join(event.text for event in events if isinstance(event, Text))


def tokens_of(events: list[InferenceEvent]) -> list[int]:
    return [token for event in events if isinstance(event, Text) for token in event.token_ids]
