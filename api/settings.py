"""How ``sluice serve`` runs: the settings every part of the API reads, and the served model."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from api.backends.placement import PlacementPolicy
from api.connection_limits import (
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_KEEP_ALIVE_TIMEOUT_S,
    DEFAULT_MAX_HEADER_BYTES,
)
from api.images.budget import DEFAULT_IMAGE_TOKEN_BUDGET
from api.images.resolution import ImageOptions
from api.preparation_pool import DEFAULT_MAX_WAITING, DEFAULT_PREPARE_TIMEOUT_S
from api.request_body import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES
from api.stall_guard import DEFAULT_STALL_TIMEOUT_S
from shared.execution import default_enforce_eager
from shared.precision import default_dtype
from shared.prompting.jinja import read_chat_template
from shared.registry import ModelRegistry, ModelSpec, default_registry


@dataclass(slots=True)
class Settings:
    """How ``sluice serve`` runs; ``config`` is a TOML model registry.

    ``models`` are the names served; none: every entry of ``config``, else the default model.
    """

    models: tuple[str, ...] = ()
    config: Path | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    root_path: str = ""  # behind a proxy that serves the API under this path prefix
    ssl_keyfile: Path | None = None  # HTTPS with both, as uvicorn takes them
    ssl_certfile: Path | None = None
    log_level: str = "info"  # the project's lines
    uvicorn_log_level: str = "info"  # uvicorn's own lines (vLLM's --uvicorn-log-level)
    dtype: str = field(default_factory=default_dtype)
    quantization: str = "auto"
    enforce_eager: bool = field(default_factory=default_enforce_eager)  # see shared.execution
    max_model_len: int | None = None
    max_num_seqs: int = 64
    kv_cache_bytes: int | None = None  # --kv-cache-memory; None: sized from the two above
    gpu_memory_utilization: float | None = None  # --gpu-memory-utilization, on CUDA
    preparation_threads: int = 8  # concurrent preparations; more wait their turn
    max_preparing: int = DEFAULT_MAX_WAITING  # preparations waiting for a thread before a 503
    prepare_timeout_s: float = DEFAULT_PREPARE_TIMEOUT_S  # one preparation step, waiting included
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S  # headers slower to arrive: a 408
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES  # a larger request head is a 431
    keep_alive_timeout_s: float = DEFAULT_KEEP_ALIVE_TIMEOUT_S  # an idle connection is closed
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # a larger request body is a 413
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S  # a body slower to arrive is a 408
    stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S  # a client not reading this long is dropped
    images: ImageOptions = field(default_factory=ImageOptions)  # fetch policy, quota, timeout
    image_token_budget: int = DEFAULT_IMAGE_TOKEN_BUDGET  # running requests' image tokens
    # Distributed mode (workers behind Redis) when set; see api/admission.py and api/limits.py.
    redis_url: str | None = None
    queue_timeout_s: float = 30.0  # a worker must start the request by then: 503
    first_token_timeout_s: float = 60.0  # the first token must come by then: 504
    total_timeout_s: float = 600.0  # the whole generation must end by then: 504
    max_inflight: int = 256  # queued + in-flight requests per model before a 429
    placement: PlacementPolicy = field(default_factory=PlacementPolicy)  # which worker's queue
    # Async jobs (api/jobs): kept this long after submission; a batch holds at most this many.
    job_retention_s: float = 86_400.0
    max_batch_jobs: int = 100
    # Files and batches (api/batches): a file's size, a key's files together (bytes and how
    # many), a batch's lines running at once, and how long they may take before what is left
    # expires.
    max_file_bytes: int = 64 * 2**20
    max_file_bytes_per_key: int = 512 * 2**20
    max_files_per_key: int = 10_000
    batch_concurrency: int = 32
    batch_completion_window_s: float = 86_400.0
    # Who may call (api/auth.py): plain keys, a TOML file of named keys, the /metrics token.
    api_keys: tuple[str, ...] = ()
    api_keys_file: Path | None = None
    metrics_token: str | None = None
    log_format: str = "text"  # or "json": one object per line, for log shippers
    allowed_origins: tuple[str, ...] = ()  # CORS for browser clients; none: CORS off
    # What an object schema that leaves out additionalProperties allows (shared/constraints.py).
    default_additional_properties: bool = False
    # How chat templates get message content; None: each registry entry's own (shared/registry.py).
    chat_template_content_format: str | None = None
    # The syntax of tool calls (vLLM's --tool-call-parser); None: each registry entry's own.
    tool_call_parser: str | None = None
    # vLLM's --reasoning-parser: the served model reasons in <think> blocks; None: as its entry.
    reasoning_parser: str | None = None
    # vLLM's --chat-template: a Jinja template file, or the template itself, for the served models.
    chat_template: str | None = None
    # vLLM's --served-model-name: the names clients use for the one served model; the first shows.
    served_model_names: tuple[str, ...] = ()


def load_models(settings: Settings) -> tuple[ModelRegistry, list[ModelSpec]]:
    """The registry this server answers with (the served models only) and their entries."""
    registry = ModelRegistry.from_toml(settings.config) if settings.config else default_registry()
    names = settings.models
    if not names and settings.config:
        own = ModelRegistry.from_toml(settings.config, include_default=False)
        names = tuple(spec.name for spec in own.specs())
    resolved = [registry.resolve(name, hub=True) for name in names or ("default",)]
    specs = list({spec.name: spec for spec in resolved}.values())  # a model named twice is one
    specs = [spec.replaced(**_flag_changes(spec, settings)) for spec in specs]
    if settings.served_model_names:
        if len(specs) > 1:
            raise ValueError(
                "--served-model-name names one served model; give each of several its "
                "names in a --config entry's aliases"
            )
        specs = [specs[0].replaced(served_names=settings.served_model_names)]
    return ModelRegistry(specs), specs


def _flag_changes(spec: ModelSpec, settings: Settings) -> dict[str, Any]:
    """What the flags that override a registry entry's fields change in a served entry."""
    changes: dict[str, Any] = {}
    if settings.reasoning_parser is not None:  # every parser named reads <think> blocks
        changes["capabilities"] = spec.capabilities | {"thinking"}
    if settings.tool_call_parser is not None:
        changes["tool_parser"] = settings.tool_call_parser
    if settings.chat_template_content_format is not None:
        changes["chat_template_content_format"] = settings.chat_template_content_format
    if settings.chat_template is not None:
        changes["prompt_format"] = "jinja"
        changes["chat_template"] = read_chat_template(settings.chat_template)
    return changes
