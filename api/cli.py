"""The ``sluice`` command: serve, worker, warmup, generate, bench.

Each subcommand imports its side lazily, so ``sluice serve --redis`` never
pulls in torch and ``sluice generate`` never pulls in the web stack.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

from shared.engine_options import EngineOptions
from shared.flag_environment import apply_environment
from shared.flags import add_flags, from_flags
from shared.version import package_version


def _add_engine_flags(parser: argparse.ArgumentParser, model_help: str) -> None:
    parser.add_argument("--model", default="default", help=model_help)
    add_flags(parser, EngineOptions)


def _warmup(args: argparse.Namespace) -> int:
    """Load each model ``sluice serve`` would serve with these options, as it would, compiling
    what its first start would: the compile cache then holds it for every later start on this
    machine (the same CPU and thread count)."""
    from api.settings import Settings, load_models
    from engine.config import EngineArgs
    from engine.llm_engine import LLMEngine

    options = dataclasses.replace(from_flags(EngineOptions, args), enforce_eager=False)
    config = Path(args.config) if args.config else None
    for spec in load_models(Settings(models=tuple(args.model or ()), config=config))[1]:
        started = time.perf_counter()
        engine_args = EngineArgs.serving(spec, options, args.config)
        try:
            engine = LLMEngine(engine_args)
            engine.warm_up()
        except (ValueError, OSError, RuntimeError) as exc:
            print(f"sluice warmup: {exc}", file=sys.stderr)
            return 2
        compiled = engine.runner.compiled
        built = (
            "decode graphs compiled"
            if compiled is not None and compiled.loaded
            else ("decode steps eager: no graph serves this model here")
        )
        elapsed = time.perf_counter() - started
        print(f"sluice warmup: {spec.name}: {built} ({elapsed:.0f} s)")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams

    options = from_flags(EngineOptions, args)
    try:
        llm = LLM(args.model, **dataclasses.asdict(options))
    except (ValueError, OSError) as exc:  # unknown model, missing weights, bad options
        print(f"sluice generate: {exc}", file=sys.stderr)
        return 2
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed
    )
    outputs = llm.generate(list(args.prompt), params)
    for output in outputs:
        print(output.text if len(outputs) == 1 else f"--- {output.request_id}\n{output.text}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from api.auth import KeyRing
    from api.server import run
    from api.settings import Settings, load_models

    for flag, given in (
        ("--kv-cache-memory", args.kv_cache_memory is not None),
        ("--gpu-memory-utilization", args.gpu_memory_utilization is not None),
        ("--enforce-eager", args.enforce_eager is not None),
    ):
        if args.redis and given:
            print(
                f"sluice serve: {flag} sets this process's engine; with --redis the "
                "workers run the engines: pass it to each `sluice worker`",
                file=sys.stderr,
            )
            return 2
    settings = from_flags(Settings, args)
    try:
        # A bad --model or --config fails here, with a clear message; a hub id is found in
        # the local cache or downloaded.
        for spec in load_models(settings)[1]:
            spec.weights  # noqa: B018
        KeyRing.configured(settings.api_keys, settings.api_keys_file)  # and a bad keys file
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"sluice serve: {exc}", file=sys.stderr)
        return 2
    return run(settings)


def _bench(args: argparse.Namespace) -> int:
    import importlib

    return importlib.import_module(f"bench.{args.which}").main(args.rest)


def build_parser(serve_flags: bool = True) -> argparse.ArgumentParser:
    """The whole command line; without ``serve_flags`` the serve command is left bare, so
    that the other commands never import the web stack that the serve settings name."""
    parser = argparse.ArgumentParser(prog="sluice", description=__doc__)
    parser.add_argument("--version", action="version", version=f"sluice {package_version()}")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="complete prompts offline")
    _add_engine_flags(generate, "model name, alias, path or hub id")
    generate.add_argument("--max-tokens", type=int, default=128)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("prompt", nargs="+")
    generate.set_defaults(run=_generate)

    warmup = commands.add_parser(
        "warmup",
        help="build the engine's kernels and compile its decode graphs ahead of a first start",
    )
    warmup.add_argument(
        "--model", action="append", help="a model `sluice serve` serves (repeatable)"
    )
    warmup.add_argument("--config", default=None, help="TOML model registry ([models.<name>])")
    add_flags(warmup, EngineOptions)
    warmup.set_defaults(run=_warmup)

    serve = commands.add_parser("serve", help="serve the HTTP APIs")
    serve.add_argument("--version", action="version", version=f"sluice {package_version()}")
    if serve_flags:
        from api.settings import Settings

        add_flags(serve, Settings)
    serve.set_defaults(run=_serve)
    apply_environment(serve)

    # Listed for --help; its options belong to workers.main, which main() hands them to.
    commands.add_parser("worker", help="run a GPU worker for distributed mode (--redis URL)")

    bench = commands.add_parser(
        "bench", help="run a benchmark (engine; serve: over HTTP; lowbit: the linear kernels)"
    )
    bench.add_argument("which", choices=["engine", "serve", "lowbit"])
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    bench.set_defaults(run=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:  # the worker parses its own options (sluice worker --help)
        from workers.main import main as worker_main

        return worker_main(argv[1:])
    args = build_parser(
        serve_flags=argv[:1] not in (["generate"], ["warmup"], ["bench"])
    ).parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
