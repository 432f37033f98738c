"""Engine throughput against Hugging Face transformers on the default model.

    python -m bench.engine [--new-tokens 128] [--variants auto,float32,bfloat16,int8,int4]
                           [--skip-transformers] [--skip-llama-cpp]

Prints single-stream decode tok/s, aggregate tok/s at 8 and 32 concurrent
requests and time to first token, for Sluice (in each variant asked for) and
for transformers ``generate`` (batch 1 and left-padded batches) on the same GGUF
in fp32, with ratios. bfloat16 halves the bytes read per token and int8
(weight-only, bfloat16 compute) halves them again; their greedy outputs may
differ from fp32's.

When ``llama-cpp-python`` is installed (not a dependency: ``CMAKE_ARGS=
"-DGGML_NATIVE=ON" pip install llama-cpp-python`` builds it from source), llama.cpp
runs the same GGUF file, at its own quantization, on the same prompt tokens
with the same thread count, greedy: a single-stream baseline (it has no
continuous batching), printed beside every variant.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine import EngineArgs, LLMEngine, SamplingParams
from shared.events import Text
from shared.registry import default_registry

VARIANTS = {  # name -> engine arguments
    "auto": {"dtype": "auto", "quantization": "auto"},  # the default configuration
    "float32": {"dtype": "float32"},
    "bfloat16": {"dtype": "bfloat16", "quantization": "none"},
    "int8": {"dtype": "bfloat16", "quantization": "int8"},
    "int4": {"dtype": "bfloat16", "quantization": "int4"},
}

PROMPT = "Write a detailed story about a lighthouse keeper who finds a message in a bottle."


@dataclass(slots=True)
class Result:
    tokens_per_s: float
    ttft_ms: float


def prompts(count: int) -> list[str]:
    """Different prompts of different lengths, so batching is not trivially uniform."""
    topics = ["the sea", "a mountain", "a city at night", "an old library", "a robot", "winter"]
    return [
        f"Write a poem number {i} about {topics[i % len(topics)]}." + " Be vivid." * (i % 4)
        for i in range(count)
    ]


def run_sluice(engine: LLMEngine, texts: list[str], new_tokens: int) -> Result:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    encode = engine.tokenizer.tokenizer.encode
    start = time.perf_counter()
    for i, text in enumerate(texts):
        engine.add_request(f"bench-{i}", encode(text).ids, params)
    first: dict[str, float] = {}
    generated = 0
    while engine.has_unfinished():
        for event in engine.step():
            if isinstance(event, Text):
                first.setdefault(event.request_id, time.perf_counter())
                generated += len(event.token_ids)
    elapsed = time.perf_counter() - start
    ttft = sum(t - start for t in first.values()) / len(first)
    if len(texts) == 1:  # decode rate, excluding the prefill
        return Result((generated - 1) / (elapsed - ttft), ttft * 1e3)
    return Result(generated / elapsed, ttft * 1e3)


def run_transformers(model, tokenizer, texts: list[str], new_tokens: int) -> Result:  # noqa: ANN001
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    kwargs = dict(do_sample=False, pad_token_id=tokenizer.pad_token_id)
    with torch.inference_mode():
        start = time.perf_counter()
        model.generate(**batch, max_new_tokens=1, min_new_tokens=1, **kwargs)
        ttft = time.perf_counter() - start
        start = time.perf_counter()
        out = model.generate(
            **batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs
        )
        elapsed = time.perf_counter() - start
    generated = (out.shape[1] - batch["input_ids"].shape[1]) * len(texts)
    if len(texts) == 1:
        return Result((generated - 1) / (elapsed - ttft), ttft * 1e3)
    return Result(generated / elapsed, ttft * 1e3)


def run_llama_cpp(llama, token_ids: list[int], new_tokens: int) -> Result:  # noqa: ANN001
    """One greedy stream of ``new_tokens`` after ``token_ids``, from an empty cache."""
    llama.reset()
    start = time.perf_counter()
    first = 0.0
    generated = 0
    for _ in llama.generate(token_ids, top_k=1, temp=0.0, reset=True):
        generated += 1
        first = first or time.perf_counter() - start
        if generated == new_tokens:
            break
    elapsed = time.perf_counter() - start
    return Result((generated - 1) / (elapsed - first), first * 1e3)


def load_llama_cpp():  # noqa: ANN201
    """llama.cpp on the default GGUF with the engine's thread count; None when not installed."""
    try:
        import llama_cpp
    except ImportError:
        return None
    gguf = default_registry().resolve("default").weights
    threads = torch.get_num_threads()
    return llama_cpp.Llama(
        str(gguf), n_ctx=2048, n_threads=threads, n_threads_batch=threads, verbose=False
    )


def load_transformers():  # noqa: ANN201
    import transformers

    gguf = Path(default_registry().resolve("default").weights)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return model, tokenizer


def chosen_variants(parser: argparse.ArgumentParser, text: str, known: dict) -> list[str]:
    """``--variants``' comma-separated names; an unknown one is a usage error."""
    names = text.split(",")
    if unknown := sorted(set(names) - set(known)):
        parser.error(f"unknown variants {unknown}; choose from {', '.join(known)}")
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--variants", default=",".join(VARIANTS), help=", ".join(VARIANTS))
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--skip-llama-cpp", action="store_true")
    args = parser.parse_args(argv)
    variants = chosen_variants(parser, args.variants, VARIANTS)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    results: dict[str, dict[str, Result]] = {}
    for variant in variants:
        engine = LLMEngine(
            EngineArgs(max_num_seqs=32, max_num_batched_tokens=2048, **VARIANTS[variant])
        )
        engine.warm_up()
        run_sluice(engine, ["warm up"], 8)
        results[variant] = {
            "batch 1": run_sluice(engine, [PROMPT], args.new_tokens),
            "8 concurrent": run_sluice(engine, prompts(8), args.new_tokens),
            "32 concurrent": run_sluice(engine, prompts(32), args.new_tokens),
        }
        del engine
    baseline: dict[str, Result] = {}
    if not args.skip_transformers:
        model, tokenizer = load_transformers()
        run_transformers(model, tokenizer, ["warm up"], 4)
        baseline = {
            "batch 1": run_transformers(model, tokenizer, [PROMPT], args.new_tokens),
            "8 concurrent": run_transformers(model, tokenizer, prompts(8), args.new_tokens),
            "32 concurrent": run_transformers(model, tokenizer, prompts(32), args.new_tokens),
        }
    llama = None if args.skip_llama_cpp else load_llama_cpp()
    llama_cpp = None
    if llama is not None:
        token_ids = default_tokenizer().encode(PROMPT).ids
        run_llama_cpp(llama, token_ids, 8)  # warm-up
        llama_cpp = run_llama_cpp(llama, token_ids, args.new_tokens)
    print(
        f"default model, greedy, {args.new_tokens} new tokens, {torch.get_num_threads()} threads;"
        " baselines: transformers generate in fp32, and llama.cpp (one stream) on the same GGUF"
        + ("" if llama_cpp else " (not installed)")
    )
    print(
        f"{'sluice':<10}{'workload':<15}{'sluice tok/s':>13}{'hf tok/s':>10}{'÷ hf':>7}"
        f"{'llama.cpp tok/s':>17}{'÷ llama.cpp':>12}"
        f"{'sluice TTFT ms':>16}{'hf TTFT ms':>12}{'llama.cpp TTFT ms':>19}"
    )
    for variant, rows in results.items():
        for name, ours in rows.items():
            ref = baseline.get(name)
            cpp = llama_cpp if name == "batch 1" else None
            print(
                f"{variant:<10}{name:<15}{ours.tokens_per_s:>13.1f}"
                f"{_figure(ref and ref.tokens_per_s):>10}{_ratio(ours, ref):>7}"
                f"{_figure(cpp and cpp.tokens_per_s):>17}{_ratio(ours, cpp):>12}"
                f"{ours.ttft_ms:>16.1f}{_figure(ref and ref.ttft_ms):>12}"
                f"{_figure(cpp and cpp.ttft_ms):>19}"
            )
    return 0


def default_tokenizer():  # noqa: ANN201
    from shared.tokenizer_loader import load_tokenizer

    return load_tokenizer(default_registry().resolve("default").tokenizer).tokenizer


def _figure(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _ratio(ours: Result, reference: Result | None) -> str:
    return "-" if reference is None else f"{ours.tokens_per_s / reference.tokens_per_s:.2f}x"


if __name__ == "__main__":
    raise SystemExit(main())
