"""Engine throughput against Hugging Face transformers on the default model.

    python -m bench.engine [--new-tokens 128] [--variants float32,bfloat16,int8]
                           [--skip-transformers]

Prints single-stream decode tok/s, aggregate tok/s at 8 and 32 concurrent
requests and time to first token, for Sluice (in each variant asked for) and
for transformers ``generate`` (batch 1 and left-padded batches) on the same GGUF
in fp32, with ratios. bfloat16 halves the bytes read per token and int8
(weight-only, bfloat16 compute) halves them again; their greedy outputs may
differ from fp32's.
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
    "float32": {"dtype": "float32"},
    "bfloat16": {"dtype": "bfloat16"},
    "int8": {"dtype": "bfloat16", "quantization": "int8"},
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


def load_transformers():  # noqa: ANN201
    import transformers

    gguf = Path(default_registry().resolve("default").weights)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return model, tokenizer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--variants", default=",".join(VARIANTS), help=", ".join(VARIANTS))
    parser.add_argument("--skip-transformers", action="store_true")
    args = parser.parse_args(argv)
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    results: dict[str, dict[str, Result]] = {}
    for variant in args.variants.split(","):
        engine = LLMEngine(
            EngineArgs(max_num_seqs=32, max_num_batched_tokens=2048, **VARIANTS[variant])
        )
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
    print(
        f"default model, greedy, {args.new_tokens} new tokens, {torch.get_num_threads()} threads;"
        " baseline: transformers generate in fp32"
    )
    print(
        f"{'sluice':<14}{'workload':<15}{'sluice tok/s':>14}{'hf tok/s':>10}{'ratio':>8}"
        f"{'sluice TTFT ms':>16}{'hf TTFT ms':>12}"
    )
    for variant, rows in results.items():
        for name, ours in rows.items():
            ref = baseline.get(name)
            ratio = f"{ours.tokens_per_s / ref.tokens_per_s:.2f}x" if ref else "-"
            print(
                f"{variant:<14}{name:<15}{ours.tokens_per_s:>14.1f}"
                f"{(f'{ref.tokens_per_s:.1f}' if ref else '-'):>10}{ratio:>8}"
                f"{ours.ttft_ms:>16.1f}{(f'{ref.ttft_ms:.1f}' if ref else '-'):>12}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
