"""The ``sluice`` command: serve, worker, warmup, generate, bench.

Each subcommand imports its side lazily, so ``sluice serve --redis`` never
pulls in torch and ``sluice generate`` never pulls in the web stack.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from shared.execution import ENFORCE_EAGER_HELP, default_enforce_eager
from shared.flag_environment import apply_environment
from shared.precision import (
    DTYPE_HELP,
    QUANTIZATION_CHOICES,
    QUANTIZATION_HELP,
    default_dtype,
)
from shared.registry import REASONING_PARSERS
from shared.sizes import add_gpu_memory_utilization, byte_size_argument
from shared.tool_syntax import TOOL_CALL_SYNTAXES
from shared.version import package_version


def _at_least_one(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _generation_time(text: str) -> float:
    """An argparse type for --total-timeout: seconds, less than a request stream's lifetime.

    Workers give a request's stream and lease an hour to live when its run
    starts and renew it only every few dozen events: a run allowed longer
    could lose them while waiting without events.
    """
    from shared.keys import FINISHED_STREAM_TTL_S

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not 0 < value < FINISHED_STREAM_TTL_S:
        raise argparse.ArgumentTypeError(
            f"must be more than 0 and less than {FINISHED_STREAM_TTL_S} s, got {value:g}"
        )
    return value


def _enforce_eager(args: argparse.Namespace) -> bool:
    """``--enforce-eager`` or ``--no-enforce-eager`` when given, else the default."""
    return default_enforce_eager() if args.enforce_eager is None else args.enforce_eager


def _add_engine_args(parser: argparse.ArgumentParser, *, several_models: bool = False) -> None:
    if several_models:
        parser.add_argument(
            "--model",
            action="append",
            help="a model to serve: registry name, alias, path or hub id (org/name[@revision]); "
            "repeat it to serve several (default: every entry of --config, else the default "
            "model)",
        )
    else:
        parser.add_argument("--model", default="default", help="model name, alias, path or hub id")
    parser.add_argument(
        "--dtype",
        default=default_dtype(),
        help=DTYPE_HELP,
    )
    parser.add_argument(
        "--quantization",
        default="auto",
        choices=QUANTIZATION_CHOICES,
        help=QUANTIZATION_HELP,
    )
    parser.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=ENFORCE_EAGER_HELP,
    )
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument(
        "--kv-cache-memory",
        "--kv-cache-memory-bytes",  # vLLM's spelling
        type=byte_size_argument,
        default=None,
        metavar="SIZE",
        help="the KV cache's size, e.g. 512MiB or 2GiB (default: one --max-model-len "
        "sequence or --max-num-seqs sequences of 128 tokens, whichever is more, at most 2 GiB)",
    )
    add_gpu_memory_utilization(parser)


def _warmup(args: argparse.Namespace) -> int:
    """Load each model ``sluice serve`` would serve with these options, as it would, compiling
    what its first start would: the compile cache then holds it for every later start on this
    machine (the same CPU and thread count)."""
    from api.backends.embedded import engine_args_for
    from api.settings import Settings, load_models
    from engine.llm_engine import LLMEngine

    config = Path(args.config) if args.config else None
    for spec in load_models(Settings(models=tuple(args.model or ()), config=config))[1]:
        started = time.perf_counter()
        engine_args = engine_args_for(
            spec,
            dtype=args.dtype,
            quantization=args.quantization,
            enforce_eager=False,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            kv_cache_bytes=args.kv_cache_memory,
            registry_file=args.config,
        )
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

    try:
        llm = LLM(
            args.model,
            dtype=args.dtype,
            quantization=args.quantization,
            enforce_eager=_enforce_eager(args),
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            kv_cache_bytes=args.kv_cache_memory,
            gpu_memory_utilization=args.gpu_memory_utilization,
        )
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
    from api.backends.placement import PlacementPolicy
    from api.images.destinations import DestinationPolicy
    from api.images.resolution import ImageOptions, ImageQuota
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
    settings = Settings(
        models=tuple(args.model or ()),
        config=Path(args.config) if args.config else None,
        host=args.host,
        port=args.port,
        root_path=args.root_path,
        ssl_keyfile=Path(args.ssl_keyfile) if args.ssl_keyfile else None,
        ssl_certfile=Path(args.ssl_certfile) if args.ssl_certfile else None,
        log_level=args.log_level,
        uvicorn_log_level=args.uvicorn_log_level,
        dtype=args.dtype,
        quantization=args.quantization,
        enforce_eager=_enforce_eager(args),
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        kv_cache_bytes=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        redis_url=args.redis,
        queue_timeout_s=args.queue_timeout,
        first_token_timeout_s=args.first_token_timeout,
        total_timeout_s=args.total_timeout,
        max_inflight=args.max_inflight,
        placement=PlacementPolicy(
            enabled=args.placement == "prefix",
            load_cost=args.placement_load_cost,
            min_match=args.placement_min_match,
            wait_s=args.placement_wait,
        ),
        job_retention_s=args.job_retention,
        max_batch_jobs=args.max_batch_jobs,
        max_file_bytes=args.max_file_bytes,
        max_file_bytes_per_key=args.max_file_bytes_per_key,
        max_files_per_key=args.max_files_per_key,
        batch_concurrency=args.batch_concurrency,
        batch_completion_window_s=args.batch_completion_window,
        api_keys=tuple(args.api_key or ()),
        api_keys_file=Path(args.api_keys) if args.api_keys else None,
        metrics_token=args.metrics_token,
        log_format=args.log_format,
        max_body_bytes=args.max_body_bytes,
        body_timeout_s=args.body_timeout,
        header_timeout_s=args.header_timeout,
        max_header_bytes=args.max_header_bytes,
        keep_alive_timeout_s=args.keep_alive_timeout,
        prepare_timeout_s=args.prepare_timeout,
        max_preparing=args.max_preparing,
        stall_timeout_s=args.stall_timeout,
        allowed_origins=tuple(args.allowed_origins or ()),
        default_additional_properties=args.default_additional_properties == "true",
        chat_template_content_format=args.chat_template_content_format,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        chat_template=args.chat_template,
        served_model_names=tuple(args.served_model_name or ()),
        images=ImageOptions(
            DestinationPolicy.allowing(args.image_allow or ()),
            ImageQuota(args.max_images, args.max_image_bytes, args.max_image_pixels),
            args.image_fetch_timeout,
        ),
        image_token_budget=args.image_token_budget,
    )
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


def _add_image_args(parser: argparse.ArgumentParser) -> None:
    from api.images import budget, resolution

    parser.add_argument(
        "--image-allow",
        action="append",
        metavar="HOST|NET",
        help="image URLs may reach this host name, address or network although it is not "
        "public (repeatable; loopback, private, link-local and metadata addresses are refused)",
    )
    parser.add_argument(
        "--max-images",
        type=_at_least_one,
        default=resolution.DEFAULT_MAX_IMAGES,
        metavar="N",
        help="images one request may hold; more is a 400",
    )
    parser.add_argument(
        "--max-image-bytes",
        type=_at_least_one,
        default=resolution.DEFAULT_MAX_IMAGE_BYTES,
        metavar="N",
        help="encoded bytes one request's images may hold together, inline and fetched",
    )
    parser.add_argument(
        "--max-image-pixels",
        type=_at_least_one,
        default=resolution.DEFAULT_MAX_IMAGE_PIXELS,
        metavar="N",
        help="decoded pixels one request's images may hold together",
    )
    parser.add_argument(
        "--image-fetch-timeout",
        type=float,
        default=resolution.DEFAULT_FETCH_TIMEOUT_S,
        metavar="S",
        help="fetching a request's image URLs must end within S seconds, or it is a 504",
    )
    parser.add_argument(
        "--image-token-budget",
        type=_at_least_one,
        default=budget.DEFAULT_IMAGE_TOKEN_BUDGET,
        metavar="N",
        help="image tokens the requests running at once may hold together; past it a "
        "request with images is a 503 to retry later",
    )


def _add_placement_args(parser: argparse.ArgumentParser) -> None:
    from api.backends.placement import DEFAULT_LOAD_COST, DEFAULT_MIN_MATCH, DEFAULT_WAIT_S

    parser.add_argument(
        "--placement",
        choices=["prefix", "shared"],
        default="prefix",
        help="with --redis: prefix puts a request on the worker caching its prompt's prefix "
        "unless it is busier than the cache is worth; shared puts every one on the shared queue",
    )
    parser.add_argument(
        "--placement-load-cost",
        type=float,
        default=DEFAULT_LOAD_COST,
        metavar="TOKENS",
        help="cached prompt tokens that one more job held by a worker outweighs",
    )
    parser.add_argument(
        "--placement-min-match",
        type=int,
        default=DEFAULT_MIN_MATCH,
        metavar="TOKENS",
        help="a worker caching fewer of the prompt's tokens is no reason to place there",
    )
    parser.add_argument(
        "--placement-wait",
        type=float,
        default=DEFAULT_WAIT_S,
        metavar="S",
        help="a job placed on a worker's own queue goes to the shared queue after S seconds",
    )


LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sluice", description=__doc__)
    parser.add_argument("--version", action="version", version=f"sluice {package_version()}")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="complete prompts offline")
    _add_engine_args(generate)
    generate.add_argument("--max-tokens", type=int, default=128)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("prompt", nargs="+")
    generate.set_defaults(run=_generate)

    warmup = commands.add_parser(
        "warmup",
        help="build the engine's kernels and compile its decode graphs ahead of a first start",
    )
    _add_engine_args(warmup, several_models=True)
    warmup.add_argument("--config", default=None, help="TOML model registry ([models.<name>])")
    warmup.set_defaults(run=_warmup)

    serve = commands.add_parser("serve", help="serve the HTTP APIs")
    _add_engine_args(serve, several_models=True)
    serve.add_argument("--version", action="version", version=f"sluice {package_version()}")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--root-path", default="", help="the path prefix a proxy serves the API under"
    )
    serve.add_argument("--ssl-keyfile", default=None, help="HTTPS: the private key file")
    serve.add_argument("--ssl-certfile", default=None, help="HTTPS: the certificate file")
    serve.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="Sluice's lines")
    serve.add_argument(
        "--uvicorn-log-level", default="info", choices=LOG_LEVELS, help="uvicorn's own lines"
    )
    serve.add_argument("--config", default=None, help="TOML model registry ([models.<name>])")
    serve.add_argument(
        "--redis", default=None, metavar="URL", help="run on workers behind this Redis"
    )
    serve.add_argument(
        "--queue-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="503 if no worker (or the embedded engine) starts a request within S seconds",
    )
    serve.add_argument(
        "--first-token-timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="504 without a first token after S seconds",
    )
    serve.add_argument(
        "--total-timeout",
        type=_generation_time,
        default=600.0,
        metavar="S",
        help="504 if a generation runs longer than S seconds",
    )
    serve.add_argument(
        "--max-inflight",
        type=_at_least_one,  # 0 would not mean "unbounded": it would refuse every request
        default=256,
        metavar="N",
        help="429 beyond N queued + running requests per model",
    )
    _add_placement_args(serve)
    _add_image_args(serve)
    serve.add_argument(
        "--job-retention",
        type=float,
        default=86_400.0,
        metavar="S",
        help="async jobs and their events are kept S seconds after submission",
    )
    serve.add_argument(
        "--max-batch-jobs",
        type=int,
        default=100,
        metavar="N",
        help="POST /v1/jobs/batch: at most N",
    )
    serve.add_argument(
        "--max-file-bytes",
        type=int,
        default=64 * 2**20,
        metavar="N",
        help="POST /v1/files: a larger file is a 413",
    )
    serve.add_argument(
        "--max-file-bytes-per-key",
        type=int,
        default=512 * 2**20,
        metavar="N",
        help="what one API key's files may hold together",
    )
    serve.add_argument(
        "--max-files-per-key",
        type=int,
        default=10_000,
        metavar="N",
        help="how many files one API key may hold (batch outputs are not counted)",
    )
    serve.add_argument(
        "--batch-concurrency",
        type=int,
        default=32,
        metavar="N",
        help="a batch runs at most N of its requests at once",
    )
    serve.add_argument(
        "--batch-completion-window",
        type=float,
        default=86_400.0,
        metavar="S",
        help="a batch's requests not done S seconds after it was created expire",
    )
    serve.add_argument(
        "--api-key",
        action="append",
        metavar="KEY",
        help="require this API key (repeatable)",
    )
    serve.add_argument(
        "--api-keys",
        metavar="FILE",
        help="TOML file of named keys stored as SHA-256 hashes ([keys.<name>])",
    )
    serve.add_argument(
        "--metrics-token", metavar="TOKEN", help="GET /metrics needs this bearer token"
    )
    serve.add_argument("--log-format", default="text", choices=["text", "json"])
    serve.add_argument(
        "--max-body-bytes",
        type=_at_least_one,
        default=32 * 2**20,
        metavar="N",
        help="refuse a request body larger than N bytes with a 413 (default 32 MiB)",
    )
    serve.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="answer 408 to a request whose body has not arrived S seconds after it began",
    )
    serve.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="answer 408 to a request whose headers are not in S seconds after its first byte",
    )
    serve.add_argument(
        "--max-header-bytes",
        type=_at_least_one,
        default=64 * 1024,
        metavar="N",
        help="answer 431 to a request whose request line and headers pass N bytes",
    )
    serve.add_argument(
        "--keep-alive-timeout",
        type=float,
        default=5.0,
        metavar="S",
        help="close a kept-alive connection idle for S seconds",
    )
    serve.add_argument(
        "--prepare-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="503 if preparing a request (waiting for a thread included) takes over S seconds",
    )
    serve.add_argument(
        "--max-preparing",
        type=_at_least_one,
        default=256,
        metavar="N",
        help="503 when N requests already wait for a preparation thread",
    )
    serve.add_argument(
        "--stall-timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="end a response whose client has taken nothing of it for S seconds",
    )
    serve.add_argument(
        "--allowed-origins",
        action="append",
        metavar="ORIGIN",
        help="allow browser clients from this origin (repeatable; * for any); CORS is off without",
    )
    serve.add_argument(
        "--default-additional-properties",
        default="false",
        choices=["false", "true"],
        help="what a JSON schema object that names properties and leaves out "
        "additionalProperties allows in structured outputs and forced tool calls: false "
        "(default) keeps to the named keys; true reads it as JSON Schema does",
    )
    serve.add_argument(
        "--chat-template-content-format",
        choices=["auto", "string", "openai"],
        help="how the chat template gets message content: one string for text, or a list of "
        "typed parts (openai); auto (the default) decides from the template",
    )
    serve.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_SYNTAXES,
        default=None,
        help="the syntax the served models write tool calls in, as vLLM's (default: each "
        "registry entry's tool_parser)",
    )
    serve.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default=None,
        help="the served models reason in <think> blocks, answered as reasoning apart from "
        "the content (default: as each registry entry's capabilities say)",
    )
    serve.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE|TEMPLATE",
        help="a Jinja chat template for the served models, replacing their own: a file, or "
        "the template in one line (\\n for a line break)",
    )
    serve.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the names clients use for the served model instead of its own (one --model); "
        "the first is the one /v1/models and the metrics show",
    )
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
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
