"""Placement by prefix and load: cache hits, TTFT and balance, against the shared queue alone.

    python -m bench.routing [--model tiny|default] [--workers 4] [--conversations 64]
                            [--turns 6] [--systems 8] [--concurrency 16] [--kv-blocks 256]

Each configuration starts ``redis-server``, its workers and ``sluice serve
--redis`` and runs the same workload: ``--conversations`` chats of
``--turns`` turns, each opening with one of ``--systems`` shared system
prompts, ``--concurrency`` chats at a time so their turns arrive
interleaved; every reply is ``--max-tokens`` tokens (``ignore_eos``), so
every worker's generated tokens measure the requests it served. The three
configurations:

- ``placement``: ``--workers`` workers, ``--placement prefix`` (the default),
  once per ``--load-costs`` value (``--placement-load-cost``);
- ``shared``: the same workers, ``--placement shared`` (every job on the shared queue);
- ``single``: one worker with ``--workers`` times the KV cache and batch,
  the cache-hit ceiling for the same memory.

Printed per configuration: prompt tokens served from cache (summed from the
responses' ``cached_tokens``) and their share, TTFT p50/p99 from the client,
the busiest worker's share of generated tokens and its ratio to the mean,
the API process's CPU time per request, and the API's placements by kind.
The goals: placement's cache hits at
least 90% of ``single``'s, its TTFT p50 below ``shared``'s, and no worker
above 1.5 times the mean.

Each worker's KV cache is ``--kv-blocks`` blocks, small enough that one
worker cannot keep every conversation's prefix, so that where a turn runs
decides whether its prefix is still cached.

Last, ``--summary-entries`` members are written to a set and to a sorted
set (scored by last use), the two structures a cache summary could be, to
compare their memory per member and the cost of a step's update and of a
request's read (``MEMORY USAGE``, and wall time of pipelined calls).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import httpx
import redis

from bench.queue import (
    MAX_MODEL_LEN,
    Processes,
    cpu_seconds,
    model_options,
    percentile,
    start_redis,
    wait_ready,
)
from bench.queue import free_port as free_tcp_port
from shared import keys
from shared.prefix_hash import digest, prefix_hashes
from shared.registry import default_registry

_WORD_TEXT = (
    "cache queue worker prompt token batch model stream answer question memory latency "
    "server request system block prefix score load route"
)
WORDS = tuple(_WORD_TEXT.split())
SUMMARY_READS = 200


@dataclass(slots=True)
class Turn:
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int


@dataclass(slots=True)
class Result:
    label: str
    turns: list[Turn] = field(default_factory=list)
    generated: dict[str, int] = field(default_factory=dict)  # by worker
    placements: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0
    api_cpu_s: float = 0.0

    @property
    def cached(self) -> int:
        return sum(turn.cached_tokens for turn in self.turns)

    @property
    def prompt(self) -> int:
        return sum(turn.prompt_tokens for turn in self.turns)

    def ttft(self, q: float) -> float:
        return percentile([turn.ttft_s for turn in self.turns], q)

    @property
    def busiest(self) -> tuple[float, float]:
        """The busiest worker's share of generated tokens, and its ratio to the mean."""
        counts = list(self.generated.values())
        total = sum(counts)
        if not total:
            return 0.0, 0.0
        return max(counts) / total, max(counts) / (total / len(counts))


def system_prompts(count: int) -> list[str]:
    """``count`` distinct system prompts of about 200 tokens each."""
    rng = random.Random(7)
    return [
        f"You are assistant {index}. "
        + " ".join(f"Rule {n}: {' '.join(rng.choices(WORDS, k=8))}." for n in range(16))
        for index in range(count)
    ]


def question(rng: random.Random) -> str:
    return "Please explain " + " ".join(rng.choices(WORDS, k=rng.randint(20, 40))) + "."


async def conversation(
    session: aiohttp.ClientSession, model: str, system: str, index: int, args: argparse.Namespace
) -> list[Turn]:
    rng = random.Random(index)
    messages = [{"role": "system", "content": system}]
    turns = []
    for _ in range(args.turns):
        messages.append({"role": "user", "content": question(rng)})
        turn, reply = await one_turn(session, model, messages, args.max_tokens)
        turns.append(turn)
        messages.append({"role": "assistant", "content": reply})
    return turns


async def one_turn(
    session: aiohttp.ClientSession, model: str, messages: list[dict], max_tokens: int
) -> tuple[Turn, str]:
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    first = None
    text: list[str] = []
    usage: dict = {}
    async with session.post("/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for raw in response.content:
            line = raw.decode()
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                if content := choice["delta"].get("content"):
                    first = first or time.perf_counter()
                    text.append(content)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    ttft = (first or time.perf_counter()) - sent
    return Turn(ttft, usage.get("prompt_tokens", 0), cached), "".join(text)


async def workload(base_url: str, model: str, args: argparse.Namespace) -> list[Turn]:
    """Every conversation, ``--concurrency`` at a time, each on one of the system prompts."""
    systems = system_prompts(args.systems)
    gate = asyncio.Semaphore(args.concurrency)
    timeout = aiohttp.ClientTimeout(total=1800)
    connector = aiohttp.TCPConnector(limit=args.concurrency + 1)
    async with aiohttp.ClientSession(base_url, connector=connector, timeout=timeout) as session:

        async def gated(index: int) -> list[Turn]:
            async with gate:
                system = systems[index % len(systems)]
                return await conversation(session, model, system, index, args)

        chats = await asyncio.gather(*(gated(i) for i in range(args.conversations)))
    return [turn for chat in chats for turn in chat]


def run_configuration(
    label: str, args: argparse.Namespace, workdir: Path, load_cost: str = "128"
) -> Result:
    workers, kv_blocks, seqs, placement = args.workers, args.kv_blocks, args.max_num_seqs, "prefix"
    if label == "placement":
        label = f"placement/{load_cost}"
    elif label == "single":
        kv_blocks, seqs, workers = kv_blocks * workers, seqs * workers, 1
    elif label == "shared":
        placement = "shared"
    slug = label.replace("/", "-")  # in file names and worker ids
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    processes = Processes()
    try:
        redis_url = start_redis(processes, workdir, env, None)
        engine = ["--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(seqs)]
        for index in range(workers):
            command = [sys.executable, "-m", "workers.main", "--redis", redis_url,
                       *model_options(args.model, workdir), *engine,
                       "--num-kv-blocks", str(kv_blocks), "--worker-id", f"{slug}-{index}",
                       "--loglevel", "WARNING"]  # fmt: skip
            processes.spawn(command, workdir / f"worker-{slug}-{index}.log", env)
        port = free_tcp_port()
        log = workdir / f"api-{slug}.log"
        command = [sys.executable, "-m", "api.server", "--port", str(port), "--redis", redis_url,
                   *model_options(args.model, workdir), "--placement", placement,
                   "--placement-load-cost", load_cost,
                   "--queue-timeout", "600", "--first-token-timeout", "600"]  # fmt: skip
        api = processes.spawn(command, log, env)
        base_url = f"http://127.0.0.1:{port}"
        wait_ready(base_url, api, log)
        served = "tiny" if args.model == "tiny" else "default"
        client = redis.Redis.from_url(redis_url, decode_responses=True)
        registered = served if args.model == "tiny" else default_registry().resolve(served).name
        wait_for_workers(client, registered, workers)
        cpu_before, started = cpu_seconds(api.pid), time.perf_counter()
        turns = asyncio.run(workload(base_url, served, args))
        wall, api_cpu = time.perf_counter() - started, cpu_seconds(api.pid) - cpu_before
        time.sleep(1.5)  # the last heartbeats
        generated = {
            worker: json.loads(report)["generated_tokens"]
            for worker, report in client.hgetall(keys.worker_loads(registered)).items()
        }
        return Result(label, turns, generated, placements(base_url), wall, api_cpu)
    finally:
        processes.stop()


def wait_for_workers(client: redis.Redis, model: str, count: int) -> None:
    deadline = time.monotonic() + 300
    while client.hlen(keys.worker_loads(model)) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{count} workers did not start")
        time.sleep(0.3)


def placements(base_url: str) -> dict[str, float]:
    found: dict[str, float] = {}
    for line in httpx.get(f"{base_url}/metrics", timeout=10).text.splitlines():
        if line.startswith("sluice_placements_total{"):
            kind = line.split('placement="', 1)[1].split('"', 1)[0]
            found[kind] = float(line.rsplit(" ", 1)[1])
    return found


def report(results: list[Result], args: argparse.Namespace) -> None:
    print(
        f"\nmodel {args.model}: {args.conversations} conversations x {args.turns} turns, "
        f"{args.systems} system prompts, {args.concurrency} at a time, {args.workers} workers "
        f"of {args.kv_blocks} KV blocks (single: 1 of {args.kv_blocks * args.workers})"
    )
    print(f"{'':<11}{'prompt':>9}{'cached':>9}{'hit %':>7}{'TTFT p50':>10}{'TTFT p99':>10}"
          f"{'busiest':>9}{'/mean':>7}{'wall s':>8}{'API ms/req':>11}  placements")  # fmt: skip
    for result in results:
        share, ratio = result.busiest
        kinds = ", ".join(f"{kind} {int(n)}" for kind, n in sorted(result.placements.items()))
        print(
            f"{result.label:<11}{result.prompt:>9}{result.cached:>9}"
            f"{100 * result.cached / max(result.prompt, 1):>7.1f}"
            f"{result.ttft(50) * 1e3:>10.1f}{result.ttft(99) * 1e3:>10.1f}"
            f"{100 * share:>8.1f}%{ratio:>7.2f}{result.wall_s:>8.1f}"
            f"{1e3 * result.api_cpu_s / max(len(result.turns), 1):>11.2f}  {kinds}"
        )
    by = {result.label: result for result in results}
    if not {"shared", "single"} <= by.keys():
        return
    for label, placed in by.items():
        if not label.startswith("placement"):
            continue
        hits = placed.cached / max(by["single"].cached, 1)
        faster = placed.ttft(50) < by["shared"].ttft(50)
        print(
            f"{label}: cache hits {100 * hits:.1f}% of single's (goal >= 90%); TTFT p50 "
            f"{'below' if faster else 'not below'} shared's; busiest worker "
            f"{placed.busiest[1]:.2f}x the mean (goal <= 1.5)"
        )


def summary_structures(entries: int) -> None:
    """Memory and time of a cache summary as a set and as a sorted set, on a scratch Redis."""
    processes = Processes()
    with tempfile.TemporaryDirectory(prefix="sluice-routing-") as scratch:
        try:
            url = start_redis(processes, Path(scratch), dict(os.environ), None)
            client = redis.Redis.from_url(url)
            members = [digest(h) for h in prefix_hashes(list(range(entries * 16)), 16)]
            read = members[:64]  # a 1,024-token prompt
            print(f"\ncache summary of {entries} blocks: bytes/member, update (64 adds + 64 "
                  f"drops) and read (64 blocks) in µs")  # fmt: skip
            for kind in ("set", "sorted set"):
                key = f"summary:{kind}"
                write(client, kind, key, members)
                memory = client.memory_usage(key, samples=0) / entries
                update = timed(lambda k=kind, key=key: step(client, k, key, members), 200)
                check = timed(lambda k=kind, key=key: lookup(client, k, key, read), SUMMARY_READS)
                print(f"  {kind:<11}{memory:>8.1f}{update * 1e6:>10.1f}{check * 1e6:>10.1f}")
        finally:
            processes.stop()


def write(client: redis.Redis, kind: str, key: str, members: list[bytes]) -> None:
    for start in range(0, len(members), 4096):
        chunk = members[start : start + 4096]
        if kind == "set":
            client.sadd(key, *chunk)
        else:
            client.zadd(key, dict.fromkeys(chunk, time.time()))


def step(client: redis.Redis, kind: str, key: str, members: list[bytes]) -> None:
    """One engine step's changes: 64 blocks dropped and added back (a sorted set also
    rescores what was reused)."""
    changed = members[:64]
    pipe = client.pipeline(transaction=True)
    if kind == "set":
        pipe.srem(key, *changed).sadd(key, *changed)
    else:
        pipe.zrem(key, *changed).zadd(key, dict.fromkeys(changed, time.time()))
    pipe.expire(key, 30).execute()


def lookup(client: redis.Redis, kind: str, key: str, read: list[bytes]) -> None:
    if kind == "set":
        client.smismember(key, read)
    else:
        client.zmscore(key, read)


def timed(call, repeat: int) -> float:  # noqa: ANN001 - any callable
    call()
    started = time.perf_counter()
    for _ in range(repeat):
        call()
    return (time.perf_counter() - started) / repeat


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.routing", description=__doc__)
    parser.add_argument("--model", default="tiny", choices=["tiny", "default"])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--systems", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=8, help="per worker")
    parser.add_argument("--kv-blocks", type=int, default=256, help="per worker")
    parser.add_argument("--summary-entries", type=int, default=16_384)
    parser.add_argument(
        "--load-costs", default="128", help="comma-separated --placement-load-cost values to run"
    )
    parser.add_argument(
        "--configurations", default="placement,shared,single", help="comma-separated"
    )
    args = parser.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="sluice-routing-") as scratch:
        for label in args.configurations.split(","):
            costs = args.load_costs.split(",") if label == "placement" else ["128"]
            for cost in costs:
                results.append(run_configuration(label, args, Path(scratch), cost))
                print(f"{results[-1].label}: done in {results[-1].wall_s:.1f} s", flush=True)
    report(results, args)
    if args.summary_entries:
        summary_structures(args.summary_entries)
    return 0


if __name__ == "__main__":
    sys.exit(main())
