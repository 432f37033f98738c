"""Constrained decoding (a JSON schema through llguidance) against unconstrained decoding.

    python -m bench.structured [--requests 32] [--new-tokens 96] [--rounds 2]
                               [--schemas 20] [--threads N]

On the default model, the same concurrent chat requests run greedy, once
unconstrained and once each with a JSON-schema constraint, interleaved round by
round so both see the same machine. A constrained answer stops when its JSON
object is complete, so the two differ in length: the comparison is generated
tokens per second of wall time, and CPU time per generated token, of all
threads and of the main one alone (it steps the engine; with one torch thread
it runs the model too, and the other threads' time is mask filling).
A third run per round, unconstrained with each request held to its constrained
answer's length, has the same batch shape step by step as the constrained
one: against it, what remains is the cost of the constraint itself, while
against the plain run the shorter answers also leave the batch thinner.

Torch gets every core but one (``--threads`` to choose): the masks are filled
on a helper thread while the forward pass runs, and torch threads that
spin-wait on a shared core slow both down.

Then the grammar's own costs: compiling a schema the engine has not seen
(``Constraints.matcher`` on a cold cache: schema to grammar, validation,
matcher), the same schema again (a cache hit), the first mask of a fresh
grammar (llguidance builds its lexer states as they are reached), and per
decode step of the constrained rounds: filling the masks on the helper thread,
the main thread's wait for them and their unpacking, and applying them to the
logits.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import llguidance.numpy
import torch

from engine.constraints import GrammarMask, PendingMasks
from engine.llm import LLM
from shared.sampling import SamplingParams, StructuredOutputs

UNCONSTRAINED, CONSTRAINED, LENGTH_MATCHED = "unconstrained", "json schema", "length-matched"
MODES = (UNCONSTRAINED, CONSTRAINED, LENGTH_MATCHED)  # the order of each round
THROUGHPUT_GOAL = 0.9  # constrained tok/s over unconstrained tok/s, at least
COMPILE_GOAL_MS = 5.0  # p50 of compiling a typical schema, at most

TOPICS = ["a librarian", "a ship's cook", "a mountain guide", "a data engineer", "a beekeeper"]


def schema(name_field: str = "name") -> dict[str, Any]:
    """A typical response schema; ``name_field`` makes each one a distinct grammar."""
    text = {"type": "string", "maxLength": 40}
    return {
        "type": "object",
        "properties": {
            name_field: text,
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "city": text,
            "role": {"enum": ["admin", "editor", "viewer"]},
            "tags": {"type": "array", "items": text, "maxItems": 3},
        },
        "required": [name_field, "age", "role", "tags"],
        "additionalProperties": False,
    }


def chat_prompts(count: int) -> list[str]:
    """ChatML user turns asking for a profile, each a little different."""
    return [
        "<|im_start|>user\n"
        f"Invent user number {i}, {TOPICS[i % len(TOPICS)]}, and describe them as a JSON "
        "object with name, age, city, role and tags.<|im_end|>\n<|im_start|>assistant\n"
        for i in range(count)
    ]


@dataclass(slots=True)
class Run:
    mode: str
    tokens: int
    wall_s: float
    cpu_s: float  # every thread of the process
    main_cpu_s: float  # the thread that steps the engine (and, with one torch thread, runs it)
    steps: int
    valid: int  # answers that parse as a JSON object with every required field
    lengths: list[int] = field(default_factory=list)  # generated tokens of each request

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s

    @property
    def cpu_ms_per_token(self) -> float:
        return self.cpu_s / self.tokens * 1e3

    @property
    def main_ms_per_token(self) -> float:
        return self.main_cpu_s / self.tokens * 1e3


@dataclass(slots=True)
class StepTimes:
    """Seconds per decode step spent on masks, recorded while the engine runs."""

    fill: list[float] = field(default_factory=list)  # helper thread, all rows of the step
    wait: list[float] = field(default_factory=list)  # main thread: PendingMasks.result
    apply: list[float] = field(default_factory=list)  # main thread: GrammarMask.apply


@dataclass(slots=True)
class GrammarCosts:
    compile_s: list[float]
    cache_hit_s: list[float]
    first_mask_s: list[float]


def run(
    llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams], mode: str
) -> Run:
    """All ``prompts`` at once through the offline loop, timed in wall and CPU seconds."""
    required = set(schema()["required"])
    steps = llm.engine.stats.steps
    wall, cpu, main = time.perf_counter(), time.process_time(), time.thread_time()
    outputs = llm.generate(prompts, params)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    main = time.thread_time() - main
    lengths = [len(output.token_ids) for output in outputs]
    valid = sum(required <= _json_keys(output.text) for output in outputs)
    steps = llm.engine.stats.steps - steps
    return Run(mode, sum(lengths), wall, cpu, main, steps, valid, lengths)


def combined(runs: list[Run], mode: str) -> Run:
    """Every round of one mode as one run."""
    mine = [r for r in runs if r.mode == mode]
    return Run(
        mode,
        sum(r.tokens for r in mine),
        sum(r.wall_s for r in mine),
        sum(r.cpu_s for r in mine),
        sum(r.main_cpu_s for r in mine),
        sum(r.steps for r in mine),
        sum(r.valid for r in mine),
    )


def _json_keys(text: str) -> set[str]:
    try:
        value = json.loads(text)
    except ValueError:
        return set()
    return set(value) if isinstance(value, dict) else set()


@contextmanager
def timed(owner: object, name: str, samples: list[float]) -> Iterator[None]:
    """Record the duration of every call to ``owner.name`` while the block runs."""
    original: Callable[..., Any] = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            samples.append(time.perf_counter() - start)

    setattr(owner, name, wrapper)
    try:
        yield
    finally:
        setattr(owner, name, original)


@contextmanager
def step_times() -> Iterator[StepTimes]:
    times = StepTimes()
    with (
        timed(llguidance.numpy, "fill_next_token_bitmask_par", times.fill),
        timed(PendingMasks, "result", times.wait),
        timed(GrammarMask, "apply", times.apply),
    ):
        yield times


def workload(
    llm: LLM, requests: int, new_tokens: int
) -> tuple[list[list[int]], dict[str, SamplingParams]]:
    """The encoded prompts, and the sampling parameters of each mode."""
    prompts = [llm.encode(text) for text in chat_prompts(requests)]
    unconstrained = SamplingParams(max_tokens=new_tokens, temperature=0.0)
    constrained = dataclasses.replace(
        unconstrained, structured_outputs=StructuredOutputs(json=schema())
    )
    return prompts, {UNCONSTRAINED: unconstrained, CONSTRAINED: constrained}


def warm_up(llm: LLM, prompts: list[list[int]], params: dict[str, SamplingParams]) -> None:
    """A few tokens of each mode; this also compiles the schema, as serving it once would."""
    for mode, p in params.items():
        run(llm, prompts[:2], dataclasses.replace(p, max_tokens=4), mode)


def interleaved(
    llm: LLM, prompts: list[list[int]], params: dict[str, SamplingParams], rounds: int
) -> list[Run]:
    """Each mode in turn, ``rounds`` times over.

    The length-matched run is unconstrained with each request held to exactly
    the length its constrained answer had in the same round.
    """
    runs: list[Run] = []
    for _ in range(rounds):
        runs.append(run(llm, prompts, params[UNCONSTRAINED], UNCONSTRAINED))
        runs.append(run(llm, prompts, params[CONSTRAINED], CONSTRAINED))
        matched = [
            dataclasses.replace(params[UNCONSTRAINED], max_tokens=length, ignore_eos=True)
            for length in runs[-1].lengths
        ]
        runs.append(run(llm, prompts, matched, LENGTH_MATCHED))
    return runs


def grammar_costs(llm: LLM, count: int) -> GrammarCosts:
    """Compile ``count`` schemas the engine has not seen, then one of them ``count`` times."""
    constraints = llm.engine.constraints  # its llguidance tokenizer was built in the warm-up
    compiled = constraints.compiled
    specs = [StructuredOutputs(json=schema(f"name_{i}")) for i in range(count)]
    compile_s, first_mask_s = [], []
    for spec in specs:
        start = time.perf_counter()
        matcher = constraints.matcher(spec, [])
        compile_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        matcher.compute_bitmask()
        first_mask_s.append(time.perf_counter() - start)
    cache_hit_s = []
    for _ in range(count):
        start = time.perf_counter()
        constraints.matcher(specs[0], [])
        cache_hit_s.append(time.perf_counter() - start)
    if constraints.compiled - compiled != count:
        raise RuntimeError(f"{constraints.compiled - compiled} compiles for {count} new schemas")
    return GrammarCosts(compile_s, cache_hit_s, first_mask_s)


def percentile(values: list[float], percent: float) -> float:
    """Nearest-rank percentile; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(1, math.ceil(percent / 100 * len(ordered))) - 1]


def print_runs(runs: list[Run], requests: int) -> None:
    print(
        f"{'round':<7}{'mode':<16}{'tokens':>8}{'steps':>7}{'JSON ok':>9}{'wall s':>9}"
        f"{'tok/s':>9}{'CPU ms/tok':>12}{'main ms/tok':>13}"
    )
    for index, r in enumerate(runs):
        print(
            f"{index // len(MODES) + 1:<7}{r.mode:<16}{r.tokens:>8}{r.steps:>7}"
            f"{f'{r.valid}/{requests}':>9}{r.wall_s:>9.1f}{r.tokens_per_s:>9.1f}"
            f"{r.cpu_ms_per_token:>12.2f}{r.main_ms_per_token:>13.2f}"
        )


def print_summary(runs: list[Run]) -> None:
    """Each mode over all rounds, then the constrained one against both baselines.

    The per-round ratios show how much the machine moved between rounds.
    """
    total = {mode: combined(runs, mode) for mode in MODES}
    ours = total[CONSTRAINED]
    print(
        f"{'all rounds':<36}{'tok/s':>9}{'CPU ms/tok':>12}{'main ms/tok':>13}{'goal':>11}"
        f"{'met':>5}  tok/s ratio per round"
    )
    for mode in MODES:
        r = total[mode]
        print(
            f"{mode:<36}{r.tokens_per_s:>9.1f}{r.cpu_ms_per_token:>12.2f}"
            f"{r.main_ms_per_token:>13.2f}{'-':>11}{'-':>5}"
        )
    for baseline, goal in ((UNCONSTRAINED, THROUGHPUT_GOAL), (LENGTH_MATCHED, None)):
        base = total[baseline]
        speed = ours.tokens_per_s / base.tokens_per_s
        cost = ours.cpu_ms_per_token / base.cpu_ms_per_token
        main_cost = ours.main_ms_per_token / base.main_ms_per_token
        met = "-" if goal is None else ("yes" if speed >= goal else "no")
        rounds = zip(
            [r for r in runs if r.mode == CONSTRAINED],
            [r for r in runs if r.mode == baseline],
            strict=True,
        )
        per_round = ", ".join(f"{c.tokens_per_s / b.tokens_per_s:.2f}x" for c, b in rounds)
        print(
            f"{f'ratio {CONSTRAINED} / {baseline}':<36}{speed:>8.2f}x{cost:>11.2f}x"
            f"{main_cost:>12.2f}x"
            f"{'-' if goal is None else f'>= {goal:.2f}x':>11}{met:>5}  {per_round}"
        )


def print_grammar(costs: GrammarCosts, steps: StepTimes, rows: int) -> None:
    lines: list[tuple[str, list[float], float | None]] = [  # name, seconds, goal for p50 in ms
        (f"compile, {len(costs.compile_s)} distinct schemas", costs.compile_s, COMPILE_GOAL_MS),
        ("same schema (cache hit)", costs.cache_hit_s, None),
        ("first mask, fresh grammar", costs.first_mask_s, None),
        (f"mask fill/step, <= {rows} rows", steps.fill, None),
        ("mask wait/step (main)", steps.wait, None),
        ("mask apply/step (main)", steps.apply, None),
    ]
    print(f"{'grammar cost':<32}{'n':>6}{'p50 ms':>9}{'p99 ms':>9}{'goal':>15}{'met':>5}")
    for name, samples, goal_ms in lines:
        p50_ms = percentile(samples, 50) * 1e3
        goal = "-" if goal_ms is None else f"p50 <= {goal_ms:g} ms"
        met = "-" if goal_ms is None else ("yes" if p50_ms <= goal_ms else "no")
        print(
            f"{name:<32}{len(samples):>6}{p50_ms:>9.3f}"
            f"{percentile(samples, 99) * 1e3:>9.3f}{goal:>15}{met:>5}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32, help="concurrent chat requests")
    parser.add_argument("--new-tokens", type=int, default=96, help="max_tokens of each request")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the three runs")
    parser.add_argument("--schemas", type=int, default=20, help="distinct schemas to compile")
    parser.add_argument("--threads", type=int, help="torch threads (default: all cores but one)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads or max(1, torch.get_num_threads() - 1))

    llm = LLM(max_num_seqs=args.requests)
    prompts, params = workload(llm, args.requests, args.new_tokens)
    warm_up(llm, prompts, params)
    with step_times() as steps:
        runs = interleaved(llm, prompts, params, args.rounds)
    costs = grammar_costs(llm, args.schemas)
    print(
        f"default model, greedy, {args.requests} concurrent chat requests, up to "
        f"{args.new_tokens} new tokens, {args.rounds} rounds interleaved, "
        f"{torch.get_num_threads()} torch threads; baselines: the same requests unconstrained,"
        " and held to the constrained lengths"
    )
    print_runs(runs, args.requests)
    print()
    print_summary(runs)
    print()
    print_grammar(costs, steps, args.requests)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
