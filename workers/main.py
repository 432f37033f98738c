"""``sluice worker``: load one model, then serve its queue until told to stop.

The model is loaded once, before Celery starts, so a bad ``--model`` or
``--config`` fails at once with a clear message and every job finds the
engine ready. SIGTERM is a warm shutdown: the worker stops taking jobs,
lets running generations finish for ``--drain-grace`` seconds and then
hands the rest back to the queue, where another worker resumes them from
their streams. SIGQUIT hands everything back at once.

A worker whose engine thread dies shuts itself down the same way, without
the grace (its generations can never finish): it takes no more jobs, hands
back what it runs and exits with code 1, for its supervisor to restart it.

Also runnable as ``python -m workers.main``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import socket
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from shared import keys, logs
from shared.flag_environment import apply_environment
from shared.flags import add_flags, from_flags
from shared.heap import freeze_startup_heap
from shared.registry import ModelRegistry, ModelSpec, default_registry
from workers.broker.app import create_app
from workers.heartbeat import WorkerIdentity
from workers.settings import DEFAULT_DRAIN_GRACE_S, WorkerSettings

if TYPE_CHECKING:
    from engine.config import EngineArgs
    from engine.llm_engine import LLMEngine
    from workers.vllm_engine import VllmEngine

log = logging.getLogger("workers")

EXIT_ENGINE_DIED = 1  # a warm shutdown alone exits 0, as if the worker had been asked to
GIL_SWITCH_INTERVAL_S = 0.0001
"""How long a thread may hold the GIL while another waits (Python's default: 5 ms).

The engine thread is mostly Python between small kernels, so it holds the
GIL nearly all the time; each Redis reply the broker consumer, a task thread
or the outbox receives waits up to the full interval to be handled, and so
does every job passing from the consumer thread to a task thread of Celery's
pool (figures: the README's benchmark section)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sluice worker", description=__doc__.split("\n\n")[0])
    add_flags(parser, WorkerSettings)
    apply_environment(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    settings = from_flags(WorkerSettings, parser.parse_args(argv))
    if settings.redis_url is None:
        parser.error("--redis (or SLUICE_REDIS) is required")
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    logs.configure(settings.loglevel, settings.log_format)
    try:
        config = settings.config
        registry = ModelRegistry.from_toml(config) if config else default_registry()
        spec = registry.resolve(settings.model, hub=True)
        queues = worker_queues(registry, spec, split_queues(settings.queues))
        engine = (
            load_vllm_engine(spec, settings)
            if settings.engine_kind == "vllm"
            else load_engine(own_engine_args(spec, settings))
        )
    except Exception as exc:  # unknown, missing or broken model, bad config
        print(f"sluice worker: {exc}", file=sys.stderr)
        return 2
    worker_id = settings.worker_id or default_worker_id()
    if not worker_id.isprintable() or keys.OWN_QUEUE_MARK in worker_id:
        print(f"sluice worker: worker id {worker_id!r} is not a plain name", file=sys.stderr)
        return 2
    identity = WorkerIdentity(worker_id, spec.name)
    return serve(
        settings.redis_url,
        identity,
        engine,
        queues,
        drain_grace_s=settings.drain_grace_s,
        loglevel=settings.loglevel.upper(),
        metrics_port=settings.metrics_port,
    )


def own_engine_args(spec: ModelSpec, settings: WorkerSettings) -> EngineArgs:
    """This project's engine's arguments from the command line."""
    if settings.engine_args:
        raise ValueError("--engine-arg sets vLLM's engine arguments: it needs --engine vllm")
    from engine.config import EngineArgs

    config = str(settings.config) if settings.config else None
    engine_args = EngineArgs.serving(spec, settings.engine, config)
    return dataclasses.replace(engine_args, num_kv_blocks=settings.num_kv_blocks)


def load_vllm_engine(spec: ModelSpec, settings: WorkerSettings) -> VllmEngine:
    """vLLM's engine on ``spec``'s checkpoint. This project's own engine flags that vLLM
    spells otherwise are refused by name rather than dropped."""
    options = settings.engine
    own = {
        "--quantization": options.quantization != "auto",
        "--num-kv-blocks": settings.num_kv_blocks is not None,
        "--kv-cache-memory": options.kv_cache_bytes is not None,
        "--gpu-memory-utilization": options.gpu_memory_utilization is not None,
    }
    if given := [flag for flag, set_ in own.items() if set_]:
        raise ValueError(
            f"{', '.join(given)}: not an option of --engine vllm; pass vLLM's own as "
            "--engine-arg KEY=VALUE (e.g. gpu_memory_utilization=0.9, kv_cache_memory_bytes=...)"
        )
    if spec.weights.suffix == ".gguf":
        raise ValueError(
            f"model {spec.name!r} is a GGUF file; --engine vllm serves an HF checkpoint"
        )
    from workers.vllm_engine import VllmArgs, VllmEngine  # vLLM is imported only here

    engine_args: dict[str, Any] = {"dtype": options.dtype, "enforce_eager": options.enforce_eager}
    engine_args |= settings.engine_args
    log.info("loading %s on vLLM", spec.weights)
    return VllmEngine(
        VllmArgs(
            model=str(spec.weights),
            tokenizer=str(spec.tokenizer),
            max_num_seqs=options.max_num_seqs,
            max_model_len=options.max_model_len or spec.context_length or None,
            engine_args=engine_args,
        )
    )


def serve(
    redis_url: str,
    identity: WorkerIdentity,
    engine: LLMEngine | VllmEngine,
    queues: list[str],
    *,
    drain_grace_s: float = DEFAULT_DRAIN_GRACE_S,
    loglevel: str = "INFO",
    metrics_port: int | None = None,
) -> int:
    """Run the Celery worker in this (main) thread until a shutdown signal; the exit code.

    The code is ``EXIT_ENGINE_DIED`` when the worker shut itself down because
    its engine thread died: Celery's warm shutdown alone would exit 0, and a
    supervisor would take the worker for one that was asked to stop.
    """
    from celery import signals

    from workers.runtime import WorkerRuntime
    from workers.task import register_task

    queues = [queues[0], identity.own_queue, *queues[1:]]
    runtime = WorkerRuntime.start(redis_url, identity, engine)
    if metrics_port is not None:
        runtime.serve_metrics(metrics_port)
    app = create_app(redis_url, queues, engine.args.max_num_seqs, runtime.link)
    register_task(app, runtime.context)

    def on_shutdown(how: str = "Warm", **_: Any) -> None:
        runtime.drain_in_background(drain_grace_s if how == "Warm" else 0.0)

    signals.worker_shutting_down.connect(on_shutdown, weak=False)
    worker = app.Worker(
        hostname=f"sluice@{identity.worker_id}",
        queues=queues,
        loglevel=loglevel,
        quiet=True,
        without_gossip=True,
        without_mingle=True,
        without_heartbeat=True,
    )
    log.info(
        "worker %s serves %s on %s (capacity %d; %s)",
        identity.worker_id,
        identity.model,
        ", ".join(queues),
        engine.args.max_num_seqs,
        engine.description,
    )
    freeze_startup_heap()
    try:
        worker.start()
    finally:
        signals.worker_shutting_down.disconnect(on_shutdown)
        runtime.stop()
    if runtime.engine_died:
        log.error(
            "worker %s exits with code %d: its engine thread died",
            identity.worker_id,
            EXIT_ENGINE_DIED,
        )
        return EXIT_ENGINE_DIED
    return worker.exitcode or 0


def worker_queues(registry: ModelRegistry, spec: ModelSpec, extra: Sequence[str]) -> list[str]:
    """The model's own queue, then ``extra``; another model's queue is refused.

    This worker would take that model's jobs only to answer each with an
    error, while a worker of the right model could have run it.
    """
    foreign = {keys.queue_name(other.name): other.name for other in registry.specs()}
    foreign.pop(keys.queue_name(spec.name), None)
    for queue in extra:
        if any(not char.isprintable() for char in queue):  # a taken record is split on newlines
            raise ValueError(f"queue name {queue!r} holds a control character")
        if queue in foreign:
            raise ValueError(
                f"queue {queue!r} holds the jobs of model {foreign[queue]!r}; "
                f"a worker of {spec.name!r} cannot run them"
            )
    return [keys.queue_name(spec.name), *extra]


def load_engine(args: EngineArgs) -> LLMEngine:
    from engine.llm_engine import LLMEngine  # torch is imported only here

    log.info("loading %s", args.model)
    return LLMEngine(args)


def split_queues(values: Sequence[str]) -> list[str]:
    return [name for value in values for name in value.split(",") if name]


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


if __name__ == "__main__":
    sys.exit(main())
