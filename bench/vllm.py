"""Sluice in front of vLLM against vLLM's own server, on the same checkpoint, in the same run.

    python -m bench.vllm [--new-tokens 128] [--streams 32] [--rounds 2]

The checkpoint is the default model (SmolLM2-135M-Instruct) as an HF directory in
bfloat16, converted from its GGUF by transformers (``default_checkpoint``). Two
configurations run one after the other on the same cores:

- ``vllm serve``: vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``
  from ``.venv-vllm``), alone;
- ``sluice``: Redis, ``sluice serve --redis`` and one ``sluice worker --engine vllm``
  with the same engine settings.

Each serves one greedy Chat Completions stream of ``--new-tokens`` tokens three
times (decode tok/s between the first and last content chunk, median) and
``--rounds`` bursts of ``--streams`` concurrent streams (aggregate tok/s, TTFT
p50 and p99), all with ``ignore_eos``. For Sluice it also reports the CPU time
per streamed token of the API process: what the layer in front costs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.queue import (
    ROOT,
    Processes,
    cpu_seconds,
    free_port,
    percentile,
    run_streams,
    start_redis,
    wait_ready,
)
from workers.vllm_engine import VLLM_VERSION

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
    return ["--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(args.streams)]


def vllm_serve(weights: Path, args: argparse.Namespace, workdir: Path) -> Measured:
    """vLLM's own OpenAI server on ``weights``, measured."""
    port = free_port()
    command = [
        str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(weights),
        "--served-model-name", MODEL, "--port", str(port), *engine_flags(args),
        "--kv-cache-memory-bytes", str(KV_CACHE_BYTES),
    ]  # fmt: skip
    processes = Processes()
    try:
        server = processes.spawn(command, workdir / "vllm-serve.log", _env())
        base_url = f"http://127.0.0.1:{port}"
        wait_ready(base_url, server, workdir / "vllm-serve.log", "/health", STARTUP_TIMEOUT_S)
        return measure(base_url, args)
    finally:
        processes.stop()


def sluice(weights: Path, args: argparse.Namespace, workdir: Path) -> Measured:
    """Redis, ``sluice serve --redis`` and one vLLM worker on ``weights``, measured."""
    registry = workdir / "registry.toml"
    registry.write_text(f'[models.{MODEL}]\nweights = "{weights}"\n')
    models = ["--config", str(registry), "--model", MODEL]
    processes = Processes()
    try:
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
        return measure(base_url, args, api.pid)
    finally:
        processes.stop()


def measure(base_url: str, args: argparse.Namespace, api_pid: int | None = None) -> Measured:
    asyncio.run(run_streams(base_url, MODEL, args.streams, 8))  # warm-up at full batch
    singles = [
        asyncio.run(run_streams(base_url, MODEL, 1, args.new_tokens, ignore_eos=True))[0]
        for _ in range(SINGLE_STREAM_RUNS)
    ]
    before = cpu_seconds(api_pid) if api_pid else 0.0
    started = time.perf_counter()
    burst = []
    for _ in range(args.rounds):
        burst += asyncio.run(
            run_streams(base_url, MODEL, args.streams, args.new_tokens, ignore_eos=True)
        )
    wall = time.perf_counter() - started
    tokens = sum(stream.tokens for stream in burst)
    ttfts = [stream.ttft_s * 1e3 for stream in burst]
    return Measured(
        single_tokens_per_s=statistics.median(len(s.gaps_s) / sum(s.gaps_s) for s in singles),
        single_ttft_ms=statistics.median(s.ttft_s for s in singles) * 1e3,
        burst_tokens_per_s=tokens / wall,
        burst_ttft_p50_ms=percentile(ttfts, 50),
        burst_ttft_p99_ms=percentile(ttfts, 99),
        api_cpu_ms_per_token=(cpu_seconds(api_pid) - before) / tokens * 1e3 if api_pid else None,
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
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    if not VLLM_PYTHON.is_file():
        parser.error(f"{VLLM_PYTHON} is missing: run `make install`")
    with tempfile.TemporaryDirectory(prefix="sluice-bench-vllm-") as directory:
        workdir = Path(directory)
        weights = default_checkpoint(workdir)
        alone = vllm_serve(weights, args, workdir)
        fronted = sluice(weights, args, workdir)
    print(
        f"default model (HF, bfloat16) on vLLM {VLLM_VERSION}, greedy, "
        f"{args.new_tokens} new tokens, {args.rounds} bursts of {args.streams} streams"
    )
    print(f"{'':<12}{'1 stream tok/s':>15}{'TTFT ms':>9}{f'{args.streams} streams tok/s':>18}"
          f"{'TTFT p50':>10}{'TTFT p99':>10}{'API CPU ms/tok':>16}")  # fmt: skip
    for label, m in (("vllm serve", alone), ("sluice", fronted)):
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
