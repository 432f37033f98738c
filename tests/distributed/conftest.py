"""Real processes for distributed mode: a Redis server, up to two workers and one API.

Everything runs as it would in production: ``redis-server`` on a free port
(no persistence, so a restart loses everything, like a crashed Redis), workers
started with ``python -m workers.main`` on the default model, and the API
with ``python -m api.server --redis``. Processes are shared by the session and
replaced when a test kills one; there are never more than two workers and
one API at a time, which is what a two-core machine can carry.

Workers take a while to load the model, so the fleet starts at the beginning
of the session and tests that need workers wait for them; tests that need
none (admission, the reader) run meanwhile.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import httpx
import pytest
import redis
from anthropic import Anthropic
from openai import OpenAI

from shared import keys
from shared.registry import DEFAULT_MODEL
from tests.servers import COMPILED, free_port
from workers.heartbeat import WorkerIdentity, leave

ROOT = Path(__file__).resolve().parents[2]
MAX_MODEL_LEN = 2048  # the e2e servers' too: all of them load the graphs the first compiled
WORKER_SEQS = 4
STARTUP_TIMEOUT_S = 180
CHILD_ENV = {
    **os.environ,
    **COMPILED,  # workers decode as users run them
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
T = TypeVar("T")
API_OPTIONS = ("--queue-timeout", "60", "--first-token-timeout", "90", "--total-timeout", "120")


def wait_until(condition: Callable[[], T], timeout: float, what: str, interval: float = 0.05) -> T:
    """Poll ``condition`` until it returns something truthy; fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout:g}s waiting for {what}")


@dataclass
class Child:
    """A subprocess with its log file, leading a process group of its own: stopping it ends
    whatever it started too (a helper that outlives a ``kill -9``, such as multiprocessing's
    resource tracker beside a vLLM worker)."""

    process: subprocess.Popen
    log_path: Path

    @classmethod
    def spawn(cls, command: list[str], log_path: Path, env: dict[str, str] = CHILD_ENV) -> Child:
        with log_path.open("w") as log:
            process = subprocess.Popen(
                command,
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return cls(process, log_path)

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.alive:
            self.process.send_signal(sig)
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)  # what it left behind
        return code


class RedisServer:
    """``redis-server`` on a fixed port, restartable (``--save ""``: a restart loses all)."""

    def __init__(self, log_dir: Path) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._log_dir = log_dir
        self._child: Child | None = None
        self.client = redis.Redis(port=self.port, decode_responses=True, socket_timeout=5)

    def start(self) -> None:
        command = ["redis-server", "--port", str(self.port), "--save", "", "--appendonly", "no"]
        self._child = Child.spawn(command, self._log_dir / f"redis-{time.monotonic_ns()}.log")
        wait_until(self._answers, 10, "redis-server to answer")

    def kill(self) -> None:
        assert self._child is not None
        self._child.stop(signal.SIGKILL)

    def restart(self) -> None:
        self.kill()
        self.start()

    def _answers(self) -> bool:
        try:
            return bool(self.client.ping())
        except redis.ConnectionError:
            return False


@dataclass
class Worker:
    worker_id: str
    child: Child

    @property
    def pid(self) -> int:
        return self.child.process.pid


@dataclass
class Fleet:
    """The suite's workers: started early, replaced when a test stops one."""

    redis: RedisServer
    log_dir: Path
    size: int = 2
    loglevel: str = "WARNING"
    workers: dict[str, Worker] = field(default_factory=dict)
    _started: int = 0

    def start_worker(self, *options: str) -> Worker:
        self._started += 1
        worker_id = f"w{self._started}"
        command = [
            sys.executable, "-m", "workers.main", "--redis", self.redis.url,
            "--model", "default", "--worker-id", worker_id,
            "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(WORKER_SEQS),
            "--loglevel", self.loglevel, *options,
        ]  # fmt: skip
        worker = Worker(worker_id, Child.spawn(command, self.log_dir / f"{worker_id}.log"))
        self.workers[worker_id] = worker
        return worker

    def top_up(self) -> None:
        """Start workers until ``size`` processes are running (dead ones are forgotten)."""
        for worker_id, worker in list(self.workers.items()):
            if not worker.child.alive:
                del self.workers[worker_id]
        while len(self.workers) < self.size:
            self.start_worker()

    def heartbeats(self) -> dict[str, dict]:
        """The load reports of the default model's live workers, by worker id."""
        try:
            return live_reports(self.redis.client, DEFAULT_MODEL)
        except redis.ConnectionError:
            return {}

    def wait_live(self, count: int | None = None, timeout: float = STARTUP_TIMEOUT_S) -> None:
        """Wait until ``count`` (default: all) of our running workers report heartbeats."""
        count = len(self.workers) if count is None else count

        def live() -> bool:
            for worker in self.workers.values():
                if not worker.child.alive:
                    pytest.fail(f"worker {worker.worker_id} exited:\n{worker.child.log()}")
            beats = self.heartbeats()
            return sum(1 for worker_id in self.workers if worker_id in beats) >= count

        wait_until(live, timeout, f"{count} live worker(s)", interval=0.2)

    def stop_all(self) -> None:
        for worker in self.workers.values():
            worker.child.stop(signal.SIGKILL, timeout=10)


def live_reports(client: redis.Redis, model: str) -> dict[str, dict]:
    """The load reports of ``model``'s live workers, by worker id, read in one transaction.

    A worker is live while its registry entry's expiry (``keys.workers``) is
    ahead of Redis's clock, as the API reads it (``_read_fleet``).
    """
    with client.pipeline(transaction=True) as pipe:
        pipe.time()
        pipe.zrange(keys.workers(model), 0, -1, withscores=True)
        pipe.hgetall(keys.worker_loads(model))
        (seconds, micros), registry, loads = pipe.execute()
    now = seconds + micros / 1e6
    return {
        worker_id: json.loads(loads[worker_id])
        for worker_id, expiry in registry
        if expiry > now and worker_id in loads
    }


@dataclass(frozen=True)
class GhostWorker:
    """A worker in a model's registry, with a load report, and no consumer behind it.

    Admission, ``/metrics`` and ``Fleet.heartbeats`` count it live until its
    entry expires (``beat``'s ``ttl_s``), but nothing takes the model's jobs
    for it. Its entry is scored on Redis's clock as the workers' heartbeat
    script scores theirs (it never reclaims anyone's jobs); ``leave``
    removes it with the workers' own exit script. An
    expired ghost of a model that real workers serve is taken for dead by
    their next heartbeat, which hands back whatever its taken records hold.
    """

    client: redis.Redis
    worker_id: str = "ghost"
    model: str = DEFAULT_MODEL

    def beat(self, ttl_s: float = 60, **report: object) -> None:
        """Register (or renew) the ghost for ``ttl_s`` seconds, reporting ``report``."""
        body = json.dumps({"worker_id": self.worker_id, "model": self.model, **report})
        seconds, micros = self.client.time()
        expiry = seconds + micros / 1e6 + ttl_s
        pipe = self.client.pipeline(transaction=True)
        pipe.zadd(keys.workers(self.model), {self.worker_id: expiry})
        pipe.hset(keys.worker_loads(self.model), self.worker_id, body)
        pipe.execute()

    def leave(self) -> None:
        """Remove the ghost's entry, report and taken records (put back on their queues)."""
        leave(self.client, WorkerIdentity(self.worker_id, self.model))


class Api:
    """The one API process; ``ensure`` restarts it when another configuration is asked for."""

    def __init__(self, redis: RedisServer, log_dir: Path) -> None:
        self._redis = redis
        self._log_dir = log_dir
        self._child: Child | None = None
        self._options: tuple[str, ...] | None = None
        self.base_url = ""

    def ensure(self, *options: str) -> str:
        if self._child is not None and self._child.alive and self._options == options:
            return self.base_url
        self.stop()
        port = free_port()
        command = [
            sys.executable, "-m", "api.server", "--redis", self._redis.url,
            "--port", str(port), *options,
        ]  # fmt: skip
        self._child = Child.spawn(command, self._log_dir / f"api-{port}.log")
        self._options, self.base_url = options, f"http://127.0.0.1:{port}"
        wait_until(self._ready, STARTUP_TIMEOUT_S, "the API to be ready", interval=0.2)
        return self.base_url

    def log(self) -> str:
        return self._child.log() if self._child else ""

    def stop(self) -> None:
        if self._child is not None:
            self._child.stop()
            self._child = None

    def _ready(self) -> bool:
        assert self._child is not None
        if not self._child.alive:
            pytest.fail(f"the API exited:\n{self._child.log()}")
        try:
            return httpx.get(f"{self.base_url}/ready", timeout=2).status_code == 200
        except httpx.TransportError:
            return False


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture(scope="session")
def fleet(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """Two workers, started at once; call ``wait_live`` before relying on them."""
    workers = Fleet(redis_server, tmp_path_factory.mktemp("workers"))
    workers.top_up()
    try:
        yield workers
    finally:
        workers.stop_all()


@pytest.fixture(scope="session")
def api_process(
    redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Api]:
    api = Api(redis_server, tmp_path_factory.mktemp("api"))
    try:
        yield api
    finally:
        api.stop()


@pytest.fixture
def api(api_process: Api, fleet: Fleet) -> str:
    """The base URL of the standard API, with both workers live."""
    base_url = api_process.ensure(*API_OPTIONS)
    fleet.top_up()
    fleet.wait_live()
    return base_url


class Greedy:
    """Offline greedy decoding with ``engine.LLM``: what every path must reproduce.

    ``greedy(prompt ids, max tokens, structured outputs=None)`` is one text; ``many`` decodes
    several prompts in one batch, as the workers do. Texts are kept by what they were asked.
    """

    def __init__(self) -> None:
        from engine import LLM

        self._llm = LLM("default", max_model_len=MAX_MODEL_LEN, max_num_seqs=WORKER_SEQS)
        self._texts: dict[tuple[tuple[int, ...], int, str], str] = {}

    def __call__(self, prompt_ids: list[int], max_tokens: int, structured: object = None) -> str:
        return self.many([prompt_ids], max_tokens, structured)[0]

    def many(
        self, prompts: list[list[int]], max_tokens: int, structured: object = None
    ) -> list[str]:
        from engine import SamplingParams

        asked = [(tuple(ids), max_tokens, repr(structured)) for ids in prompts]
        missing = list(dict.fromkeys(key for key in asked if key not in self._texts))
        if missing:
            params = SamplingParams(
                max_tokens=max_tokens, temperature=0.0, structured_outputs=structured
            )
            outputs = self._llm.generate([list(key[0]) for key in missing], params)
            self._texts.update(zip(missing, (output.text for output in outputs), strict=True))
        return [self._texts[key] for key in asked]


@pytest.fixture(scope="session")
def reference(fleet: Fleet) -> Greedy:
    """Depends on ``fleet`` only so that the workers start loading first."""
    return Greedy()


def tokenize(base_url: str, messages: list[dict]) -> list[int]:
    """The exact prompt ids the server builds for a chat body."""
    body = {"model": "default", "messages": messages}
    response = httpx.post(f"{base_url}/v1/tokenize", json=body, timeout=30)
    response.raise_for_status()
    return response.json()["token_ids"]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "distributed: real Redis, worker and API processes (select with -m distributed)"
    )


@pytest.fixture(scope="module")
def own_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A Redis server of the module's own, for tests that restart or inspect it freely."""
    server = RedisServer(tmp_path_factory.mktemp("own-redis"))
    server.start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
def openai_client(api: str) -> OpenAI:
    return OpenAI(base_url=f"{api}/v1", api_key="sk-local", max_retries=0, timeout=120)


@pytest.fixture
def anthropic_client(api: str) -> Anthropic:
    return Anthropic(base_url=api, api_key="sk-local", max_retries=0, timeout=120)


def stream_chat(
    client: OpenAI, messages: list[dict], max_tokens: int, **options: object
) -> Iterator[tuple[str, str, str | None]]:
    """A streamed greedy chat completion, as an iterator of (request id, text delta, finish)."""
    stream = client.chat.completions.create(
        model="default",
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        **options,
    )
    for chunk in stream:
        for choice in chunk.choices:
            yield chunk.id, choice.delta.content or "", choice.finish_reason
