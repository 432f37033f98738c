"""A batch beside interactive users: its throughput, and what it does to their first tokens.

    python -m bench.batch [--model tiny|default] [--requests 500] [--interactive 8]
                          [--rounds 3] [--max-tokens 16] [--concurrency 32]

Runs ``sluice serve`` (embedded) and measures, in one sitting:

1. **Interactive alone:** ``--interactive`` clients, each streaming
   ``--rounds`` chat requests one after another; time to first token.
2. **Direct:** the ``--requests`` short chat requests sent as direct calls,
   ``--concurrency`` at a time (the batch's own concurrency, so both keep the
   same number in the engine): completion tokens per second.
3. **Batch:** the same requests as one OpenAI batch (``files.create``,
   ``batches.create``, poll to ``completed``): completion tokens per second
   from the output file; while it runs, the interactive clients again.

Goals: batch throughput >= 0.9x direct; interactive TTFT p50 with the batch
<= 1.5x without it.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from openai import OpenAI

from bench.queue import (
    MAX_MODEL_LEN,
    TOPICS,
    Processes,
    free_port,
    model_options,
    percentile,
    run_steady,
    wait_ready,
)

THROUGHPUT_GOAL = 0.9
TTFT_GOAL = 1.5


def bodies(count: int, model: str, max_tokens: int) -> list[dict[str, Any]]:
    return [
        {
            "model": model,
            "messages": [{"role": "user", "content": f"Note {n} about {TOPICS[n % 8]}."}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,  # every request makes exactly max_tokens: equal work both ways
        }
        for n in range(count)
    ]


async def direct(base_url: str, requests: list[dict[str, Any]], concurrency: int) -> float:
    """Completion tokens per second of the requests as direct calls, ``concurrency`` at a time."""
    gate = asyncio.Semaphore(concurrency)
    connector = aiohttp.TCPConnector(limit=concurrency + 1)
    async with aiohttp.ClientSession(base_url, connector=connector) as session:

        async def one(body: dict[str, Any]) -> int:
            async with gate, session.post("/v1/chat/completions", json=body) as response:
                response.raise_for_status()
                return (await response.json())["usage"]["completion_tokens"]

        started = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(body) for body in requests)))
        return tokens / (time.perf_counter() - started)


def submit_batch(client: OpenAI, requests: list[dict[str, Any]]) -> tuple[str, float]:
    lines = [
        {"custom_id": f"r{n}", "method": "POST", "url": "/v1/chat/completions", "body": body}
        for n, body in enumerate(requests)
    ]
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    started = time.perf_counter()
    upload = client.files.create(file=("bench.jsonl", io.BytesIO(content)), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    return batch.id, started


def batch_rate(client: OpenAI, batch_id: str, started: float) -> float:
    """Wait for the batch; its completion tokens per second, from submission to completion."""
    while (batch := client.batches.retrieve(batch_id)).status not in ("completed", "failed"):
        time.sleep(0.05)
    elapsed = time.perf_counter() - started
    if batch.status != "completed" or batch.output_file_id is None:
        raise RuntimeError(f"the batch ended {batch.status}: {batch.errors}")
    output = client.files.content(batch.output_file_id).text.splitlines()
    tokens = sum(
        json.loads(line)["response"]["body"]["usage"]["completion_tokens"] for line in output
    )
    return tokens / elapsed


def ttfts(base_url: str, model: str, args: argparse.Namespace) -> list[float]:
    timings = asyncio.run(
        run_steady(base_url, model, args.interactive, args.rounds, args.max_tokens)
    )
    return [timing.ttft_s for timing in timings]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny", choices=["tiny", "default"])
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--interactive", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="sluice-bench-batch-"))
    processes = Processes()
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    try:
        port = free_port()
        log = workdir / "api.log"
        seqs = args.concurrency + args.interactive
        command = [
            sys.executable, "-m", "api.server", "--port", str(port),
            *model_options(args.model, workdir), "--max-model-len", str(MAX_MODEL_LEN),
            "--max-num-seqs", str(seqs), "--batch-concurrency", str(args.concurrency),
        ]  # fmt: skip
        api = processes.spawn(command, log, env)
        base_url = f"http://127.0.0.1:{port}"
        wait_ready(base_url, api, log)
        served = "tiny" if args.model == "tiny" else "default"
        client = OpenAI(base_url=f"{base_url}/v1", api_key="-", timeout=600)
        requests = bodies(args.requests, served, args.max_tokens)
        asyncio.run(direct(base_url, requests[: args.concurrency], args.concurrency))  # warm-up
        alone = ttfts(base_url, served, args)
        direct_rate = asyncio.run(direct(base_url, requests, args.concurrency))
        batch_id, started = submit_batch(client, requests)
        beside = ttfts(base_url, served, args)
        rate = batch_rate(client, batch_id, started)
    finally:
        processes.stop()
    report(args, direct_rate, rate, alone, beside)
    return 0


def report(
    args: argparse.Namespace,
    direct_rate: float,
    batch_rate_: float,
    alone: list[float],
    beside: list[float],
) -> None:
    print(
        f"model {args.model}: {args.requests} requests of {args.max_tokens} tokens, "
        f"{args.concurrency} at a time; {args.interactive} interactive clients x {args.rounds}"
    )
    print(f"{'':<34}{'direct':>10}{'batch':>10}{'ratio':>8}")
    ratio = batch_rate_ / direct_rate
    print(f"{'completion tokens/s':<34}{direct_rate:>10.1f}{batch_rate_:>10.1f}{ratio:>8.2f}")
    print(f"\n{'interactive TTFT (ms)':<34}{'alone':>10}{'+ batch':>10}{'ratio':>8}")
    for q in (50, 99):
        a, b = percentile(alone, q) * 1000, percentile(beside, q) * 1000
        print(f"{f'p{q}':<34}{a:>10.1f}{b:>10.1f}{b / a:>8.2f}")
    p50 = percentile(beside, 50) / percentile(alone, 50)
    print(
        f"\nbatch throughput {ratio:.2f}x direct (goal >= {THROUGHPUT_GOAL}: "
        f"{'met' if ratio >= THROUGHPUT_GOAL else 'not met'}); interactive TTFT p50 "
        f"{p50:.2f}x (goal <= {TTFT_GOAL}: {'met' if p50 <= TTFT_GOAL else 'not met'})"
    )


if __name__ == "__main__":
    sys.exit(main())
