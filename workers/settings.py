"""How ``sluice worker`` runs: each flagged field is one of its flags (``shared.flags``)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared.engine_options import EngineOptions
from shared.flags import at_least_one, flag, group, optional_path
from shared.logs import LOG_FORMATS

ENGINES = ("sluice", "vllm")
DEFAULT_DRAIN_GRACE_S = 30.0


def engine_arg(value: str) -> tuple[str, Any]:
    """``KEY=VALUE``: VALUE as JSON when it parses (numbers, booleans, objects), else text."""
    key, sep, text = value.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {value!r}")
    try:
        return key.replace("-", "_"), json.loads(text)
    except json.JSONDecodeError:
        return key.replace("-", "_"), text


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    """One worker: its Redis, its model and engine, its queues and how it stops."""

    redis_url: str | None = field(
        default=None,
        metadata=flag("Redis URL, e.g. redis://localhost:6379/0 (required)", names=("--redis",)),
    )
    model: str = field(default="default", metadata=flag("model name, alias, path or hub id"))
    config: Path | None = field(
        default=None, metadata=flag("TOML model registry", into=optional_path)
    )
    engine_kind: str = field(
        default="sluice",
        metadata=flag(
            "sluice: this project's engine; vllm: vLLM's, in process (an HF checkpoint "
            "directory or hub id; install the vllm extra)",
            names=("--engine",),
            choices=ENGINES,
        ),
    )
    engine_args: dict[str, Any] = field(
        default_factory=dict,
        metadata=flag(
            "one of vLLM's engine arguments (--engine vllm), e.g. tensor_parallel_size=2; "
            "VALUE is read as JSON when it parses, else as a string; repeatable",
            names=("--engine-arg",),
            parse=engine_arg,
            repeat=True,
            metavar="KEY=VALUE",
            into=dict,
        ),
    )
    queues: tuple[str, ...] = field(
        default=(),
        metadata=flag(
            "extra queues to consume besides the model's own (names, or comma-separated)",
            several=True,
        ),
    )
    engine: EngineOptions = field(default_factory=EngineOptions, metadata=group())
    num_kv_blocks: int | None = field(
        default=None,
        metadata=flag(
            "KV cache blocks of 16 tokens, in place of --kv-cache-memory (default: sized as "
            "--kv-cache-memory's default)",
            parse=at_least_one,
            metavar="N",
        ),
    )
    worker_id: str | None = field(
        default=None, metadata=flag("this worker's name (default: <hostname>-<pid>)")
    )
    drain_grace_s: float = field(
        default=DEFAULT_DRAIN_GRACE_S,
        metadata=flag(
            "on SIGTERM, seconds running generations get to finish before being handed back",
            names=("--drain-grace",),
            parse=float,
            metavar="S",
        ),
    )
    metrics_port: int | None = field(
        default=None,
        metadata=flag(
            "serve this worker's engine load on http://0.0.0.0:PORT/metrics, under vLLM's "
            "names (default: none)",
            parse=int,
            metavar="PORT",
        ),
    )
    loglevel: str = field(default="INFO", metadata=flag("the log level of the worker's lines"))
    log_format: str = field(
        default="text",
        metadata=flag("one object per line (json), for log shippers", choices=LOG_FORMATS),
    )
