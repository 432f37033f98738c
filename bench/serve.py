"""What ``sluice serve`` delivers over HTTP, beside llama.cpp and transformers in the same run.

    python -m bench.serve [--variants auto,float32] [--new-tokens 128] [--streams 32]
                          [--skip-transformers] [--skip-llama-cpp] [--skip-vllm]

For each variant (engine flags, ``auto`` being the default configuration) it
starts ``sluice serve`` on the default model, reads its resident memory once
ready, streams one greedy Chat Completions request of ``--new-tokens`` tokens
(three times; decode tok/s is the median, counted between the first and the
last content chunk), one request of a new ``LONG_PROMPT_WORDS``-word prompt
(about 2,000 tokens) for its time to first token (median of three), then
``--streams`` concurrent ones (aggregate tok/s over the burst), and reads its
resident memory after the burst and its peak (loading included) and, over the
burst, the CPU seconds per streamed token of the engine's threads (the engine thread and the OpenMP
workers it starts, named ``sluice-engine``) and of the rest of the server.
With every server stopped, the baselines run on the same machine: llama.cpp
(``llama-cpp-python``, when installed) on the same GGUF with the same prompt
and thread count, one stream, and its resident memory at the server's
context length; transformers ``generate`` in float32 as a static
batch of ``--streams`` (``bench.engine``'s prompts and token count); and vLLM's
CPU build (``vllm serve`` from ``.venv-vllm``, when built) on the same model as an
HF checkpoint in bfloat16, measured as ``bench.vllm`` measures it (with its ``--dtype``:
float32 where this CPU has no native bfloat16, as the ``auto`` variant computes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

from bench.engine import chosen_variants
from bench.queue import Processes, free_port, run_streams, wait_ready
from bench.vllm import VLLM_PYTHON, Measured, vllm_dtype, vllm_serve_alone
from workers.vllm_engine import VLLM_VERSION

VARIANTS = {  # name -> sluice serve flags
    "auto": [],
    "eager": ["--enforce-eager"],  # the default without its compiled decode step
    "float32": ["--dtype", "float32"],
    "bfloat16": ["--dtype", "bfloat16", "--quantization", "none"],
    "int8": ["--quantization", "int8"],
    "kv64m": ["--kv-cache-memory", "64MiB"],  # what the server holds apart from its KV cache
}
CONTEXT = 8192  # the default model's context length: both servers are sized for it
SINGLE_STREAM_RUNS = 3
LONG_PROMPT_WORDS = 1900
"""Words of the long prompt; with the chat template, about 2,000 tokens of the default model."""
WORDS = ["river", "stone", "light", "north", "quiet", "market", "window", "garden", "winter",
         "paper", "voice", "letter", "orange", "bridge", "morning", "silver", "forest", "engine",
         "table", "candle", "harbor", "valley", "thunder", "meadow"]  # fmt: skip


@dataclass(slots=True)
class Served:
    idle_rss_mib: float  # ready, before the first request
    served_rss_mib: float  # after the burst
    peak_rss_mib: float  # the high-water mark, loading included
    single_tokens_per_s: float
    single_ttft_ms: float
    long_prompt_tokens: int
    long_ttft_ms: float  # the long prompt's time to first token
    concurrent_tokens_per_s: float
    api_cpu_ms_per_token: float  # outside the engine's threads
    engine_cpu_ms_per_token: float


ENGINE_THREAD = "sluice-engine"  # the OS name of the engine thread and of the workers it starts


def thread_cpu_seconds(pid: int) -> tuple[float, float]:
    """CPU seconds so far of the engine's threads and of the rest of the process (Linux)."""
    engine = rest = 0.0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        seconds = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        if name == ENGINE_THREAD:
            engine += seconds
        else:
            rest += seconds
    return engine, rest


def long_prompt_ttft(base_url: str) -> tuple[int, float]:
    """The long prompt's token count and its median time to first token over three prompts,
    each new (its first words differ), so no prefix of it is cached."""
    import httpx

    draw = random.Random(0)
    times, tokens = [], 0
    for run in range(SINGLE_STREAM_RUNS):
        words = [f"{run}:"] + [draw.choice(WORDS) for _ in range(LONG_PROMPT_WORDS)]
        body = {
            "model": "default",
            "messages": [{"role": "user", "content": " ".join(words)}],
            "max_tokens": 1,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        started = time.perf_counter()
        first = None
        with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=600) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                choices = chunk.get("choices") or [{}]
                if first is None and choices[0].get("delta", {}).get("content"):
                    first = time.perf_counter() - started
                if chunk.get("usage"):
                    tokens = chunk["usage"]["prompt_tokens"]
        times.append(first if first is not None else time.perf_counter() - started)
    return tokens, statistics.median(times) * 1e3


def rss_mib(pid: int, field: str = "VmRSS") -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+) kB", status).group(1)) / 1024


def serve(flags: list[str], args: argparse.Namespace, workdir: Path) -> Served:
    """Start ``sluice serve`` with ``flags``, measure it over HTTP, stop it."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    for name in ("SLUICE_DTYPE", "SLUICE_ENFORCE_EAGER"):
        env.pop(name, None)  # the variant's flags decide
    port = free_port()
    log = workdir / f"serve-{port}.log"
    sizing = ["--max-num-seqs", str(args.streams), *flags]
    # The decode graphs compiled first (once per machine), as `sluice warmup` does before a
    # deployment: a server that compiles them at its start runs eager steps meanwhile.
    subprocess.run([sys.executable, "-m", "api.cli", "warmup", *sizing], env=env, check=True)
    command = [sys.executable, "-m", "api.server", "--port", str(port), *sizing]
    processes = Processes()
    try:
        server = processes.spawn(command, log, env)
        base_url = f"http://127.0.0.1:{port}"
        wait_ready(base_url, server, log)
        idle = rss_mib(server.pid)
        asyncio.run(run_streams(base_url, "default", 1, 8))  # warm-up
        singles = [
            asyncio.run(run_streams(base_url, "default", 1, args.new_tokens, ignore_eos=True))[0]
            for _ in range(SINGLE_STREAM_RUNS)
        ]
        long_prompt_tokens, long_ttft_ms = long_prompt_ttft(base_url)
        asyncio.run(run_streams(base_url, "default", args.streams, 8))  # warm-up at full batch
        before = thread_cpu_seconds(server.pid)
        started = time.perf_counter()
        burst = asyncio.run(
            run_streams(base_url, "default", args.streams, args.new_tokens, ignore_eos=True)
        )
        wall = time.perf_counter() - started
        tokens = sum(stream.tokens for stream in burst)
        engine_cpu, api_cpu = (
            after - earlier
            for after, earlier in zip(thread_cpu_seconds(server.pid), before, strict=True)
        )
        return Served(
            idle_rss_mib=idle,
            served_rss_mib=rss_mib(server.pid),
            peak_rss_mib=rss_mib(server.pid, "VmHWM"),
            single_tokens_per_s=statistics.median((len(s.gaps_s)) / sum(s.gaps_s) for s in singles),
            single_ttft_ms=statistics.median(s.ttft_s for s in singles) * 1e3,
            long_prompt_tokens=long_prompt_tokens,
            long_ttft_ms=long_ttft_ms,
            concurrent_tokens_per_s=tokens / wall,
            api_cpu_ms_per_token=api_cpu / tokens * 1e3,
            engine_cpu_ms_per_token=engine_cpu / tokens * 1e3,
        )
    finally:
        processes.stop()


LLAMA_CPP_RSS = textwrap.dedent(
    """
    import re, sys
    from pathlib import Path
    import llama_cpp
    llama = llama_cpp.Llama(sys.argv[1], n_ctx=int(sys.argv[2]), n_threads=int(sys.argv[3]),
                            verbose=False)
    for _ in zip(range(8), llama.generate(llama.tokenize(b"Hello"), top_k=1, temp=0.0)):
        pass
    status = Path("/proc/self/status").read_text()
    print(int(re.search(r"VmHWM:\\s+(\\d+) kB", status).group(1)) / 1024)
    """
)


def llama_cpp_baseline(new_tokens: int, threads: int) -> tuple[float, float, float] | None:
    """llama.cpp's single-stream decode tok/s and TTFT, and its resident peak at ``CONTEXT``."""
    from bench.engine import PROMPT, default_tokenizer, load_llama_cpp, run_llama_cpp

    llama = load_llama_cpp()
    if llama is None:
        return None
    chat = f"<|im_start|>user\n{PROMPT}<|im_end|>\n<|im_start|>assistant\n"
    token_ids = default_tokenizer().encode(chat).ids
    run_llama_cpp(llama, token_ids, 8)  # warm-up
    runs = [run_llama_cpp(llama, token_ids, new_tokens) for _ in range(SINGLE_STREAM_RUNS)]
    del llama
    from shared.registry import default_registry

    gguf = str(default_registry().resolve("default").weights)
    measured = subprocess.run(
        [sys.executable, "-c", LLAMA_CPP_RSS, gguf, str(CONTEXT), str(threads)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return (
        statistics.median(r.tokens_per_s for r in runs),
        statistics.median(r.ttft_ms for r in runs),
        float(measured.stdout.split()[-1]),
    )


def transformers_baseline(new_tokens: int, streams: int) -> float:
    from bench.engine import load_transformers, prompts, run_transformers

    model, tokenizer = load_transformers()
    run_transformers(model, tokenizer, ["warm up"], 4)
    return run_transformers(model, tokenizer, prompts(streams), new_tokens).tokens_per_s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="auto", help=", ".join(VARIANTS))
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--skip-llama-cpp", action="store_true")
    parser.add_argument("--skip-vllm", action="store_true")
    args = parser.parse_args(argv)
    variants = chosen_variants(parser, args.variants, VARIANTS)
    with tempfile.TemporaryDirectory(prefix="sluice-bench-serve-") as directory:
        served = {name: serve(VARIANTS[name], args, Path(directory)) for name in variants}
    import torch

    threads = torch.get_num_threads()
    cpp = None if args.skip_llama_cpp else llama_cpp_baseline(args.new_tokens, threads)
    hf = None if args.skip_transformers else transformers_baseline(args.new_tokens, args.streams)
    vllm = None if args.skip_vllm else vllm_baseline(args)

    print(
        f"sluice serve over HTTP, default model, greedy, {args.new_tokens} new tokens, "
        f"{threads} threads, context {CONTEXT}"
    )
    if cpp:
        print(f"llama.cpp, same GGUF, one stream: {cpp[0]:.1f} tok/s, TTFT {cpp[1]:.1f} ms, "
              f"resident peak {cpp[2]:.0f} MiB at n_ctx {CONTEXT}")  # fmt: skip
    if hf:
        print(f"transformers float32, static batch of {args.streams}: {hf:.1f} tok/s")
    if vllm:
        print(f"vLLM {VLLM_VERSION} (vllm serve, bfloat16 HF checkpoint, --dtype "
              f"{vllm_dtype()}): one stream "
              f"{vllm.single_tokens_per_s:.1f} tok/s, {args.streams} streams "
              f"{vllm.burst_tokens_per_s:.1f} tok/s")  # fmt: skip
    print(f"{'variant':<10}{'1 stream tok/s':>15}{'÷ llama.cpp':>12}{'TTFT ms':>9}"
          f"{'long prompt TTFT ms':>21}{f'{args.streams} streams tok/s':>18}{'÷ hf':>7}"
          f"{'÷ vLLM':>8}{'idle MiB':>10}{'served MiB':>12}"
          f"{'÷ llama.cpp':>12}{'peak MiB':>10}"
          f"{'API CPU ms/tok':>16}{'engine CPU ms/tok':>19}")  # fmt: skip
    for name, s in served.items():
        single = _ratio(s.single_tokens_per_s, cpp and cpp[0])
        print(
            f"{name:<10}{s.single_tokens_per_s:>15.1f}{single:>12}"
            f"{s.single_ttft_ms:>9.1f}"
            f"{f'{s.long_ttft_ms:.0f} ({s.long_prompt_tokens} tok)':>21}"
            f"{s.concurrent_tokens_per_s:>18.1f}"
            f"{_ratio(s.concurrent_tokens_per_s, hf):>7}"
            f"{_ratio(s.concurrent_tokens_per_s, vllm and vllm.burst_tokens_per_s):>8}"
            f"{s.idle_rss_mib:>10.0f}"
            f"{s.served_rss_mib:>12.0f}{_ratio(s.served_rss_mib, cpp and cpp[2]):>12}"
            f"{s.peak_rss_mib:>10.0f}"
            f"{s.api_cpu_ms_per_token:>16.3f}{s.engine_cpu_ms_per_token:>19.2f}"
        )
    return 0


def vllm_baseline(args: argparse.Namespace) -> Measured | None:
    """``vllm serve`` on the default model, one burst of ``--streams``; None without vLLM."""
    if not VLLM_PYTHON.is_file():
        return None
    with tempfile.TemporaryDirectory(prefix="sluice-bench-vllm-") as directory:
        workdir = Path(directory)
        settings = argparse.Namespace(new_tokens=args.new_tokens, streams=args.streams, rounds=1)
        return vllm_serve_alone(settings, workdir)


def _ratio(ours: float, reference: float | None) -> str:
    return f"{ours / reference:.2f}x" if reference else "-"


if __name__ == "__main__":
    sys.exit(main())
