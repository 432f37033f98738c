"""Sluice in front of vLLM against vLLM's own server, on the same checkpoint, in the same run.

    python -m bench.vllm [--new-tokens 128] [--streams 32] [--rounds 4]

The checkpoint is the default model (SmolLM2-135M-Instruct) as an HF directory in
bfloat16, converted from its GGUF by transformers (``default_checkpoint``), which vLLM
computes in as a Sluice worker's ``--dtype auto`` resolves (``vllm_dtype``: float32 on a CPU
without native bfloat16, where bfloat16 would be emulated). Two configurations share the
same cores:

- ``vllm serve``: vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``
  from ``.venv-vllm``), alone;
- ``sluice``: Redis, ``sluice serve --redis`` and one ``sluice worker --engine vllm``
  with the same engine settings.

Both run at once, idle while the other is measured, and are measured in
alternation: each of ``--rounds`` rounds serves, on each configuration in an
order that flips every round, one greedy Chat Completions stream of
``--new-tokens`` tokens three times (decode tok/s between the first and last
content chunk, median over all rounds) and one burst of ``--streams``
concurrent streams (aggregate tok/s, TTFT p50 and p99), all with
``ignore_eos``. For Sluice it also reports the CPU time per streamed token of
the API process and the delivery of each burst stream's first token, from the
worker's entry in Redis (its id is the write's millisecond) to the client: what
the layer in front costs, without the engine's step, whose length varies from
burst to burst by more than that. The TTFT p50 difference is also given per round,
between the two configurations' bursts run back to back, so that the machine's
drift over a run cancels out.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from bench.queue import (
    ROOT,
    Processes,
    StreamTiming,
    cpu_seconds,
    free_port,
    percentile,
    run_streams,
    start_redis,
    wait_ready,
)
from shared import keys
from shared.cpu import native_bf16_flag
from shared.event_codec import decode_entry
from shared.events import Text
from workers.vllm_engine import VLLM_VERSION, resolve_dtype

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
MODEL = "smollm2-hf"  # a name of its own: "default" names the GGUF
MAX_MODEL_LEN = 2048
KV_CACHE_BYTES = 2**30  # vLLM's CPU default reserves most of the machine's memory
SINGLE_STREAM_RUNS = 3
STARTUP_TIMEOUT_S = 600


@dataclass(slots=True)
class Measured:
    single_tokens_per_s: float
    single_ttft_ms: float
    burst_tokens_per_s: float
    burst_ttft_p50_ms: float
    burst_ttft_p99_ms: float
    api_cpu_ms_per_token: float | None = None
    delivery_p50_ms: float | None = None
    delivery_p99_ms: float | None = None


def default_checkpoint(directory: Path) -> Path:
    """The default model's GGUF as an HF checkpoint in bfloat16 (transformers dequantizes it
    as it loads; the GGUF quantizer it records is dropped so the weights save as plain)."""
    weights = directory / "smollm2-hf"
    if (weights / "model.safetensors").is_file():
        return weights
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shared.registry import smollm2_gguf_path

    gguf = smollm2_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16
    )
    model.hf_quantizer = None
    model.config.__dict__.pop("quantization_config", None)
    model.save_pretrained(weights)
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(weights)
    return weights


def engine_flags(args: argparse.Namespace) -> list[str]:
    return [
        "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(args.streams),
        "--dtype", vllm_dtype(),
    ]  # fmt: skip


def vllm_dtype() -> str:
    """What vLLM computes in, in both configurations: a Sluice worker's ``auto``
    (``resolve_dtype``), named to ``vllm serve`` as well, whose own ``auto`` would take the
    checkpoint's bfloat16 even where this CPU emulates it."""
    return resolve_dtype("auto", cpu=True, bf16_flag=native_bf16_flag())


@dataclass(slots=True)
class Served:
    """One configuration, started: where it answers and the API process to meter."""

    label: str
    base_url: str
    api_pid: int | None = None
    singles: list[StreamTiming] = field(default_factory=list)
    burst: list[StreamTiming] = field(default_factory=list)
    burst_wall_s: float = 0.0
    api_cpu_s: float = 0.0
    burst_ttft_p50s_ms: list[float] = field(default_factory=list)  # one per round
    redis_url: str | None = None  # Sluice's: where its streams' entries are read back
    deliveries_ms: list[float] = field(default_factory=list)


def vllm_serve(
    processes: Processes, weights: Path, args: argparse.Namespace, workdir: Path
) -> Served:
    """vLLM's own OpenAI server on ``weights``."""
    port = free_port()
    command = [
        str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(weights),
        "--served-model-name", MODEL, "--port", str(port), *engine_flags(args),
        "--kv-cache-memory-bytes", str(KV_CACHE_BYTES),
    ]  # fmt: skip
    server = processes.spawn(command, workdir / "vllm-serve.log", _env())
    base_url = f"http://127.0.0.1:{port}"
    wait_ready(base_url, server, workdir / "vllm-serve.log", "/health", STARTUP_TIMEOUT_S)
    return Served("vllm serve", base_url)


def vllm_serve_alone(args: argparse.Namespace, workdir: Path) -> Measured:
    """``vllm serve`` on the default model, started, measured and stopped (``bench.serve``'s
    baseline)."""
    processes = Processes()
    try:
        served = vllm_serve(processes, default_checkpoint(workdir), args, workdir)
        measure_alternately([served], args)
    finally:
        processes.stop()
    return summary(served)


def sluice(processes: Processes, weights: Path, args: argparse.Namespace, workdir: Path) -> Served:
    """Redis, ``sluice serve --redis`` and one vLLM worker on ``weights``."""
    registry = workdir / "registry.toml"
    registry.write_text(f'[models.{MODEL}]\nweights = "{weights}"\n')
    models = ["--config", str(registry), "--model", MODEL]
    redis_url = start_redis(processes, workdir, _env(), None)
    worker = [str(VLLM_PYTHON), "-m", "workers.main", "--engine", "vllm", "--redis",
              redis_url, *models, *engine_flags(args), "--loglevel", "WARNING",
              "--engine-arg", f"kv_cache_memory_bytes={KV_CACHE_BYTES}"]  # fmt: skip
    processes.spawn(worker, workdir / "worker.log", _env())
    port = free_port()
    api_command = [sys.executable, "-m", "api.server", "--port", str(port), "--redis",
                   redis_url, *models, "--queue-timeout", "600"]  # fmt: skip
    api = processes.spawn(api_command, workdir / "api.log", _env())
    base_url = f"http://127.0.0.1:{port}"
    wait_ready(base_url, api, workdir / "api.log", timeout_s=STARTUP_TIMEOUT_S)
    asyncio.run(run_streams(base_url, MODEL, 1, 4))  # waits for the worker
    return Served("sluice", base_url, api.pid, redis_url=redis_url)


def deliveries_ms(redis_url: str, streams: list[StreamTiming]) -> list[float]:
    """Per stream, its first content's arrival less the write of its entry in Redis."""
    client = redis.Redis.from_url(redis_url)
    try:
        return [
            stream.first_content_at * 1e3 - _first_text_written_ms(client, stream.response_id)
            for stream in streams
        ]
    finally:
        client.close()


def _first_text_written_ms(client: redis.Redis, request_id: str) -> float:
    for entry_id, fields in client.xrange(keys.event_stream(request_id)):
        event = decode_entry(request_id, fields).event
        if isinstance(event, Text) and event.text:
            return float(entry_id.split(b"-")[0])
    raise RuntimeError(f"no content in the stream of {request_id}")


def measure_alternately(configurations: list[Served], args: argparse.Namespace) -> None:
    """Each round runs every configuration's single streams and burst, in an order that
    flips each round (A B, B A, ...), so a machine whose speed drifts favours neither."""
    for served in configurations:
        asyncio.run(run_streams(served.base_url, MODEL, args.streams, 8))  # warm-up, full batch
    for round_index in range(args.rounds):
        order = configurations if round_index % 2 == 0 else configurations[::-1]
        for served in order:
            served.singles += [
                asyncio.run(
                    run_streams(served.base_url, MODEL, 1, args.new_tokens, ignore_eos=True)
                )[0]
                for _ in range(SINGLE_STREAM_RUNS)
            ]
        for served in order:
            before = cpu_seconds(served.api_pid) if served.api_pid else 0.0
            started = time.perf_counter()
            served.burst += asyncio.run(
                run_streams(served.base_url, MODEL, args.streams, args.new_tokens, ignore_eos=True)
            )
            served.burst_wall_s += time.perf_counter() - started
            ttfts = [stream.ttft_s * 1e3 for stream in served.burst[-args.streams :]]
            served.burst_ttft_p50s_ms.append(percentile(ttfts, 50))
            if served.api_pid:
                served.api_cpu_s += cpu_seconds(served.api_pid) - before
            if served.redis_url:
                served.deliveries_ms += deliveries_ms(
                    served.redis_url, served.burst[-args.streams :]
                )


def summary(served: Served) -> Measured:
    tokens = sum(stream.tokens for stream in served.burst)
    ttfts = [stream.ttft_s * 1e3 for stream in served.burst]
    singles = served.singles
    return Measured(
        single_tokens_per_s=statistics.median(len(s.gaps_s) / sum(s.gaps_s) for s in singles),
        single_ttft_ms=statistics.median(s.ttft_s for s in singles) * 1e3,
        burst_tokens_per_s=tokens / served.burst_wall_s,
        burst_ttft_p50_ms=percentile(ttfts, 50),
        burst_ttft_p99_ms=percentile(ttfts, 99),
        api_cpu_ms_per_token=served.api_cpu_s / tokens * 1e3 if served.api_pid else None,
        delivery_p50_ms=percentile(served.deliveries_ms, 50) if served.deliveries_ms else None,
        delivery_p99_ms=percentile(served.deliveries_ms, 99) if served.deliveries_ms else None,
    )


def _env() -> dict[str, str]:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    for name in ("SLUICE_DTYPE", "SLUICE_ENFORCE_EAGER"):
        env.pop(name, None)  # both servers run their defaults
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args(argv)
    if not VLLM_PYTHON.is_file():
        parser.error(f"{VLLM_PYTHON} is missing: run `make install`")
    processes = Processes()
    with tempfile.TemporaryDirectory(prefix="sluice-bench-vllm-") as directory:
        workdir = Path(directory)
        weights = default_checkpoint(workdir)
        try:
            configurations = [
                vllm_serve(processes, weights, args, workdir),
                sluice(processes, weights, args, workdir),
            ]
            measure_alternately(configurations, args)
        finally:
            processes.stop()
    alone, fronted = (summary(served) for served in configurations)
    print(
        f"default model (HF, bfloat16; --dtype {vllm_dtype()}) on vLLM {VLLM_VERSION}, "
        f"greedy, {args.new_tokens} new tokens, {args.rounds} bursts of {args.streams} streams"
    )
    print(f"{'':<12}{'1 stream tok/s':>15}{'TTFT ms':>9}{f'{args.streams} streams tok/s':>18}"
          f"{'TTFT p50':>10}{'TTFT p99':>10}{'API CPU ms/tok':>16}")  # fmt: skip
    for label, m in ((served.label, summary(served)) for served in configurations):
        cpu = f"{m.api_cpu_ms_per_token:.3f}" if m.api_cpu_ms_per_token is not None else "-"
        print(f"{label:<12}{m.single_tokens_per_s:>15.1f}{m.single_ttft_ms:>9.1f}"
              f"{m.burst_tokens_per_s:>18.1f}{m.burst_ttft_p50_ms:>10.1f}"
              f"{m.burst_ttft_p99_ms:>10.1f}{cpu:>16}")  # fmt: skip
    single = fronted.single_tokens_per_s / alone.single_tokens_per_s
    burst = fronted.burst_tokens_per_s / alone.burst_tokens_per_s
    ttft = fronted.burst_ttft_p50_ms - alone.burst_ttft_p50_ms
    print(
        f"sluice ÷ vllm serve: 1 stream {single:.3f}x, {args.streams} streams {burst:.3f}x, "
        f"TTFT p50 {ttft:+.1f} ms"
    )
    rounds = zip(*(served.burst_ttft_p50s_ms for served in configurations), strict=True)
    paired = statistics.median(fronted_p50 - alone_p50 for alone_p50, fronted_p50 in rounds)
    print(f"TTFT p50 difference, median over rounds of back-to-back bursts: {paired:+.1f} ms")
    print(
        f"sluice: a burst stream's first token from its Redis entry to the client: "
        f"p50 {fronted.delivery_p50_ms:.1f} ms, p99 {fronted.delivery_p99_ms:.1f} ms"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
