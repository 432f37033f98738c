"""What the queue costs: the same streamed requests, embedded engine vs workers behind Redis.

    python -m bench.queue [--streams 32] [--max-tokens 64] [--rounds 5] [--models default,tiny]
                          [--pin] [--arrivals burst|steady]

For each model it runs, in turn, ``sluice serve`` with the engine in the API
process (the baseline) and then ``redis-server`` + one ``sluice worker`` +
``sluice serve --redis``, with the same engine settings (one engine, batch =
``--streams``), and sends both the same ``--streams`` concurrent greedy
streams through the Chat Completions API, ``--rounds`` times after one
warm-up burst (the percentiles pool every round: one burst on a shared
machine is noisy). It prints time to first token and inter-token latency
(p50/p99, measured by the client between content chunks), the distributed
minus embedded difference, and the API process's CPU seconds per streamed
token (embedded: that process also runs the model; distributed: only HTTP,
preparation and stream fan-out). With ``--arrivals steady`` the streams
do not start together: each of ``--streams`` clients sends its next one as
its last one ends (``run_steady``), ``--rounds`` per client.

``tiny`` is a two-layer random-weight Llama with the default model's
tokenizer, written once to a temporary directory: its steps are cheap
(mostly the 49k-token output layer: about 5 ms for 32 decodes on one core),
so most of what is left of its latencies is serving and queue overhead.

``--pin`` gives the process that runs the engine (the embedded API, or the
worker) the last CPU to itself and puts the client, the distributed API and
Redis on the others. Unpinned, on two cores, four processes take turns and
the 32-stream TTFT difference moved by ±10 ms from run to run; pinned, by
±4 ms: compare several runs.

Last, it measures the machine's floor (``bench.wakeup``): how long a push
through Redis takes to wake a process blocked on it, with no Sluice code on
the path, the listener placed as the worker is. A first token of the
distributed path waits for at least two such wake-ups that the embedded
path has not: the job reaching the idle worker, and the worker's first
event reaching Redis while the API and the client wait.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import httpx

from bench import wakeup
from shared.heap import freeze_startup_heap

ROOT = Path(__file__).resolve().parents[1]
MAX_MODEL_LEN = 1024
STARTUP_TIMEOUT_S = 300
STEADY_STAGGER_S = 0.005
TOPICS = ["the sea", "a mountain", "a city at night", "an old library", "a robot", "winter",
          "a lighthouse", "the desert"]  # fmt: skip


@dataclass(slots=True)
class StreamTiming:
    ttft_s: float
    gaps_s: list[float]
    tokens: int
    response_id: str = ""
    first_content_at: float = math.nan  # wall clock (``time.time()``), to compare with Redis's


@dataclass(slots=True)
class RunResult:
    streams: list[StreamTiming]
    wall_s: float
    api_cpu_s: float

    @property
    def tokens(self) -> int:
        return sum(stream.tokens for stream in self.streams)

    def ttft(self, q: float) -> float:
        return percentile([stream.ttft_s for stream in self.streams], q)

    def itl(self, q: float) -> float:
        return percentile([gap for stream in self.streams for gap in stream.gaps_s], q)

    @property
    def cpu_per_token(self) -> float:
        return self.api_cpu_s / max(self.tokens, 1)


@dataclass
class Processes:
    """Everything started for one configuration, stopped in reverse order."""

    children: list[subprocess.Popen] = field(default_factory=list)

    def spawn(
        self, command: list[str], log: Path, env: dict[str, str], cpus: set[int] | None = None
    ) -> subprocess.Popen:
        """Start ``command``; ``cpus`` pins it (and every thread it starts) to those CPUs."""
        pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
        with log.open("w") as handle:
            child = subprocess.Popen(
                command, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT, preexec_fn=pin
            )
        self.children.append(child)
        return child

    def stop(self) -> None:
        for child in reversed(self.children):
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
            try:
                child.wait(30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# --- the tiny random model ------------------------------------------------------


def tiny_model(directory: Path) -> Path:
    """A two-layer random Llama (HF safetensors) with the default model's tokenizer."""
    config_path = directory / "registry.toml"
    if config_path.is_file():
        return config_path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from shared.registry import smollm2_gguf_path
    from shared.tokenizer_loader import load_tokenizer

    weights = directory / "tiny-llama"
    weights.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(smollm2_gguf_path())
    tokenizer.tokenizer.save(str(weights / "tokenizer.json"))
    spell = tokenizer.tokenizer.id_to_token
    settings = {
        "bos_token": spell(tokenizer.bos_token_id),
        "eos_token": spell(tokenizer.eos_token_id),
        "add_bos_token": tokenizer.add_bos_token,
        "chat_template": tokenizer.chat_template,
    }
    (weights / "tokenizer_config.json").write_text(json.dumps(settings))
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=tokenizer.tokenizer.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_MODEL_LEN * 2,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(weights, safe_serialization=True)
    config_path.write_text(
        f'[models.tiny]\nweights = "{weights}"\nprompt_format = "chatml"\n'
        f"context_length = {MAX_MODEL_LEN}\n"
    )
    return config_path


# --- one configuration ------------------------------------------------------------


def model_options(model: str, workdir: Path) -> list[str]:
    if model == "tiny":
        return ["--config", str(tiny_model(workdir)), "--model", "tiny"]
    return ["--model", model]


def wait_ready(
    base_url: str,
    api: subprocess.Popen,
    log: Path,
    path: str = "/ready",
    timeout_s: float = STARTUP_TIMEOUT_S,
) -> None:
    """Wait until ``path`` answers 200; a ``RuntimeError`` with the log's tail if the server
    exits or ``timeout_s`` passes first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if api.poll() is not None:
            raise RuntimeError(f"the server exited:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{base_url}{path}", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{base_url}{path} was not ready after {timeout_s:g}s")


@dataclass(frozen=True, slots=True)
class Placement:
    """Which CPUs the engine's process gets, and which everything else (None: no pinning).

    Pinned, the process that runs the engine (the embedded API, or the worker)
    has the last CPU to itself and the client, the distributed API and Redis
    share the rest, in both modes: what is measured is then the queue's own
    cost rather than four processes taking turns on the same cores.
    """

    engine: set[int] | None = None
    rest: set[int] | None = None

    @classmethod
    def pinned(cls) -> Placement:
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            raise SystemExit("--pin needs at least 2 CPUs")
        return cls({cpus[-1]}, set(cpus[:-1]))


def start_redis(
    processes: Processes, workdir: Path, env: dict[str, str], cpus: set[int] | None
) -> str:
    port = free_port()
    command = ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no"]
    processes.spawn(command, workdir / "redis.log", env, cpus)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return f"redis://127.0.0.1:{port}/0"
        time.sleep(0.05)
    raise RuntimeError("redis-server did not start")


def run_configuration(
    mode: str, model: str, args: argparse.Namespace, workdir: Path, placement: Placement
) -> RunResult:
    """Start ``mode``'s processes, warm up, measure ``--streams`` streams, stop everything."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    engine = ["--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(args.streams)]
    processes = Processes()
    try:
        extra: list[str] = []
        if mode == "distributed":
            redis_url = start_redis(processes, workdir, env, placement.rest)
            worker = [sys.executable, "-m", "workers.main", "--redis", redis_url,
                      *model_options(model, workdir), *engine, "--loglevel", "WARNING"]  # fmt: skip
            processes.spawn(worker, workdir / f"worker-{model}.log", env, placement.engine)
            extra = ["--redis", redis_url, "--queue-timeout", "300"]
        port = free_port()
        log = workdir / f"api-{mode}-{model}.log"
        command = [sys.executable, "-m", "api.server", "--port", str(port),
                   *model_options(model, workdir), *engine, *extra]  # fmt: skip
        api_cpus = placement.rest if mode == "distributed" else placement.engine
        api = processes.spawn(command, log, env, api_cpus)
        base_url = f"http://127.0.0.1:{port}"
        wait_ready(base_url, api, log)
        served = "tiny" if model == "tiny" else "default"
        asyncio.run(run_streams(base_url, served, 1, 4))  # waits for the worker
        # A full burst first: the worker's pool starts a thread per job on the first one.
        asyncio.run(run_streams(base_url, served, args.streams, 8))
        # This process imported torch to build the tiny model: without the freeze,
        # its own full collections (200 ms) stalled whole bursts.
        freeze_startup_heap()
        before = cpu_seconds(api.pid)
        started = time.perf_counter()
        streams: list[StreamTiming] = []
        if args.arrivals == "steady":
            streams = asyncio.run(
                run_steady(base_url, served, args.streams, args.rounds, args.max_tokens)
            )
        for _ in range(args.rounds if args.arrivals == "burst" else 0):
            streams += asyncio.run(run_streams(base_url, served, args.streams, args.max_tokens))
        wall = (time.perf_counter() - started) / args.rounds
        return RunResult(streams, wall, cpu_seconds(api.pid) - before)
    finally:
        processes.stop()


async def run_streams(
    base_url: str, model: str, count: int, max_tokens: int, ignore_eos: bool = False
) -> list[StreamTiming]:
    """``count`` concurrent streams over aiohttp.

    The client shares its cores with what it measures, so it should cost
    little: at 32 streams httpx took 0.36-0.40 of a core and aiohttp takes
    0.22, and with httpx the distributed API, which shares that core when
    pinned, measured 7-10 ms slower TTFT.
    """
    connector = aiohttp.TCPConnector(limit=count + 1)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(base_url, connector=connector, timeout=timeout) as session:
        return await asyncio.gather(
            *(one_stream(session, model, i, max_tokens, ignore_eos) for i in range(count))
        )


async def run_steady(
    base_url: str, model: str, count: int, per_client: int, max_tokens: int
) -> list[StreamTiming]:
    """``count`` clients, each sending ``per_client`` streams one after another.

    Lengths are drawn from ``max_tokens`` / 2 to 1.5 × ``max_tokens`` (seeded,
    the same in both modes), so the clients drift apart and a stream starts
    while the others are mid-generation, as under a closed-loop load
    (vLLM's ``--max-concurrency``). Each client's first stream is left out:
    the clients start ``STEADY_STAGGER_S`` apart, still close to a burst.
    """
    connector = aiohttp.TCPConnector(limit=count + 1)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(base_url, connector=connector, timeout=timeout) as session:

        async def client(index: int) -> list[StreamTiming]:
            lengths = random.Random(index)
            await asyncio.sleep(index * STEADY_STAGGER_S)
            timings = []
            for sent in range(per_client + 1):
                tokens = lengths.randint(max_tokens // 2, max_tokens * 3 // 2)
                timings.append(await one_stream(session, model, index + sent * count, tokens))
            return timings[1:]

        clients = await asyncio.gather(*(client(i) for i in range(count)))
    return [timing for timings in clients for timing in timings]


async def one_stream(
    session: aiohttp.ClientSession,
    model: str,
    index: int,
    max_tokens: int,
    ignore_eos: bool = False,
) -> StreamTiming:
    """One greedy stream; times every chunk that carries content.

    ``ignore_eos`` makes every stream ``max_tokens`` long, for a throughput figure.
    """
    body = {
        "model": model,
        "messages": [
            {"role": "user", "content": f"Write a story {index} about {TOPICS[index % 8]}."}
        ],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": ignore_eos,
    }
    sent = time.perf_counter()
    arrivals: list[float] = []
    tokens, response_id, first_content_at = 0, "", math.nan
    async with session.post("/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for raw in response.content:  # one SSE line at a time
            line = raw.decode()
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            response_id = chunk["id"]
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if any(choice["delta"].get("content") for choice in chunk["choices"]):
                arrivals.append(time.perf_counter())
                if len(arrivals) == 1:
                    first_content_at = time.time()
    if not arrivals:
        return StreamTiming(math.nan, [], tokens, response_id)
    gaps = [later - earlier for earlier, later in zip(arrivals, arrivals[1:], strict=False)]
    return StreamTiming(arrivals[0] - sent, gaps, tokens, response_id, first_content_at)


# --- the table ---------------------------------------------------------------------


def report(
    model: str, args: argparse.Namespace, embedded: RunResult, distributed: RunResult
) -> None:
    def ms(value: float) -> str:
        return f"{value * 1e3:9.1f}"

    def row(label: str, values: list[float], cpu: str, tokens: str, wall: str) -> None:
        print(f"{label:<13}{tokens:>8}{wall:>8}" + "".join(ms(v) for v in values) + f"{cpu:>14}")

    def metrics(result: RunResult) -> list[float]:
        return [result.ttft(50), result.ttft(99), result.itl(50), result.itl(99)]

    shape = "rounds" if args.arrivals == "burst" else "streams per client, steady arrivals"
    print(f"\nmodel {model}: {args.streams} concurrent streams, {args.rounds} {shape}")
    print(f"{'':<13}{'tokens':>8}{'s/round':>8}{'TTFT p50':>9}{'TTFT p99':>9}"
          f"{'ITL p50':>9}{'ITL p99':>9}{'API CPU/tok':>14}   (ms, CPU in ms)")  # fmt: skip
    for label, result in (("embedded", embedded), ("distributed", distributed)):
        cpu = f"{result.cpu_per_token * 1e3:.3f}"
        row(label, metrics(result), cpu, str(result.tokens), f"{result.wall_s:.2f}")
    difference = [d - e for d, e in zip(metrics(distributed), metrics(embedded), strict=True)]
    cpu_difference = (distributed.cpu_per_token - embedded.cpu_per_token) * 1e3
    row("difference", difference, f"{cpu_difference:+.3f}", "", "")


def measure_floor(workdir: Path, placement: Placement) -> wakeup.WakeFloor:
    """``bench.wakeup`` against a Redis placed as the distributed run's, listener as its worker."""
    processes = Processes()
    try:
        redis_url = start_redis(processes, workdir, dict(os.environ), placement.rest)
        return wakeup.measure(redis_url, placement.engine)
    finally:
        processes.stop()


def report_floor(floor: wakeup.WakeFloor) -> None:
    p50, p99 = (percentile(floor.wake_s, q) * 1e3 for q in (50, 99))
    ping = percentile(floor.ping_s, 50) * 1e3
    print(
        f"\nfloor (bench.wakeup, no Sluice code): waking a process blocked on Redis "
        f"p50 {p50:.3f} ms, p99 {p99:.3f} ms; a busy caller's PING p50 {ping:.3f} ms"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="bursts per configuration, or with --arrivals steady streams per client",
    )
    parser.add_argument(
        "--arrivals",
        choices=("burst", "steady"),
        default="burst",
        help="all streams at once, or each client's next stream when its last one ends",
    )
    parser.add_argument("--models", default="default,tiny", help="comma-separated: default, tiny")
    parser.add_argument(
        "--pin",
        action="store_true",
        help="give the engine's process the last CPU and everything else the rest",
    )
    args = parser.parse_args(argv)
    placement = Placement.pinned() if args.pin else Placement()
    if placement.rest is not None:
        os.sched_setaffinity(0, placement.rest)  # the client
    with tempfile.TemporaryDirectory(prefix="sluice-bench-queue-") as directory:
        workdir = Path(directory)
        for model in args.models.split(","):
            results = {
                mode: run_configuration(mode, model, args, workdir, placement)
                for mode in ("embedded", "distributed")
            }
            report(model, args, results["embedded"], results["distributed"])
        report_floor(measure_floor(workdir, placement))
    if args.pin:
        print(f"\nPinned: the engine's process on CPU {sorted(placement.engine or ())}, "
              f"client, distributed API and Redis on {sorted(placement.rest or ())}.")  # fmt: skip
    else:
        print(f"\n{os.cpu_count()} CPUs; client, API, worker and Redis share them.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
