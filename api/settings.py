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
from api.limits import Limits
from api.preparation_pool import DEFAULT_MAX_WAITING, DEFAULT_PREPARE_TIMEOUT_S
from api.request_body import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES
from api.stall_guard import DEFAULT_STALL_TIMEOUT_S
from shared.engine_options import EngineOptions
from shared.flags import at_least_one, flag, group, optional_path, true_or_false
from shared.prompting.base import CONTENT_FORMATS
from shared.prompting.jinja import read_chat_template
from shared.registry import REASONING_PARSERS, ModelRegistry, ModelSpec, default_registry
from shared.tool_syntax import TOOL_CALL_SYNTAXES

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


@dataclass(slots=True)
class Settings:
    """How ``sluice serve`` runs: each flagged field is one of its flags (``shared.flags``).

    ``models`` are the names served; none: every entry of ``config``, else the default model.
    """

    models: tuple[str, ...] = field(
        default=(),
        metadata=flag(
            "a model to serve: registry name, alias, path or hub id (org/name[@revision]); "
            "repeat it to serve several (default: every entry of --config, else the default "
            "model)",
            names=("--model",),
            repeat=True,
        ),
    )
    config: Path | None = field(
        default=None,
        metadata=flag("TOML model registry ([models.<name>])", into=optional_path),
    )
    engine: EngineOptions = field(default_factory=EngineOptions, metadata=group())
    host: str = field(default="127.0.0.1", metadata=flag("the address to listen on"))
    port: int = field(default=8000, metadata=flag("the port to listen on", parse=int))
    root_path: str = field(
        default="", metadata=flag("the path prefix a proxy serves the API under")
    )
    ssl_keyfile: Path | None = field(  # HTTPS with both, as uvicorn takes them
        default=None, metadata=flag("HTTPS: the private key file", into=optional_path)
    )
    ssl_certfile: Path | None = field(
        default=None, metadata=flag("HTTPS: the certificate file", into=optional_path)
    )
    log_level: str = field(default="info", metadata=flag("Sluice's lines", choices=LOG_LEVELS))
    uvicorn_log_level: str = field(
        default="info", metadata=flag("uvicorn's own lines", choices=LOG_LEVELS)
    )
    log_format: str = field(
        default="text",
        metadata=flag("one object per line (json), for log shippers", choices=("text", "json")),
    )
    preparation_threads: int = 8  # concurrent preparations; more wait their turn
    max_preparing: int = field(
        default=DEFAULT_MAX_WAITING,
        metadata=flag(
            "503 when N requests already wait for a preparation thread",
            parse=at_least_one,
            metavar="N",
        ),
    )
    prepare_timeout_s: float = field(
        default=DEFAULT_PREPARE_TIMEOUT_S,
        metadata=flag(
            "503 if preparing a request (waiting for a thread included) takes over S seconds",
            names=("--prepare-timeout",),
            parse=float,
            metavar="S",
        ),
    )
    header_timeout_s: float = field(
        default=DEFAULT_HEADER_TIMEOUT_S,
        metadata=flag(
            "answer 408 to a request whose headers are not in S seconds after its first byte",
            names=("--header-timeout",),
            parse=float,
            metavar="S",
        ),
    )
    max_header_bytes: int = field(
        default=DEFAULT_MAX_HEADER_BYTES,
        metadata=flag(
            "answer 431 to a request whose request line and headers pass N bytes",
            parse=at_least_one,
            metavar="N",
        ),
    )
    keep_alive_timeout_s: float = field(
        default=DEFAULT_KEEP_ALIVE_TIMEOUT_S,
        metadata=flag(
            "close a kept-alive connection idle for S seconds",
            names=("--keep-alive-timeout",),
            parse=float,
            metavar="S",
        ),
    )
    max_body_bytes: int = field(
        default=DEFAULT_MAX_BODY_BYTES,
        metadata=flag(
            "refuse a request body larger than N bytes with a 413",
            parse=at_least_one,
            metavar="N",
        ),
    )
    body_timeout_s: float = field(
        default=DEFAULT_BODY_TIMEOUT_S,
        metadata=flag(
            "answer 408 to a request whose body has not arrived S seconds after it began",
            names=("--body-timeout",),
            parse=float,
            metavar="S",
        ),
    )
    stall_timeout_s: float = field(
        default=DEFAULT_STALL_TIMEOUT_S,
        metadata=flag(
            "end a response whose client has taken nothing of it for S seconds",
            names=("--stall-timeout",),
            parse=float,
            metavar="S",
        ),
    )
    images: ImageOptions = field(default_factory=ImageOptions, metadata=group())
    image_token_budget: int = field(
        default=DEFAULT_IMAGE_TOKEN_BUDGET,
        metadata=flag(
            "image tokens the requests running at once may hold together; past it a request "
            "with images is a 503 to retry later",
            parse=at_least_one,
            metavar="N",
        ),
    )
    # Distributed mode (workers behind Redis) when set; see api/admission.py and api/limits.py.
    redis_url: str | None = field(
        default=None,
        metadata=flag("run on workers behind this Redis", names=("--redis",), metavar="URL"),
    )
    limits: Limits = field(default_factory=Limits, metadata=group())
    placement: PlacementPolicy = field(default_factory=PlacementPolicy, metadata=group())
    # Async jobs (api/jobs).
    job_retention_s: float = field(
        default=86_400.0,
        metadata=flag(
            "async jobs and their events are kept S seconds after submission",
            names=("--job-retention",),
            parse=float,
            metavar="S",
        ),
    )
    max_batch_jobs: int = field(
        default=100,
        metadata=flag("POST /v1/jobs/batch: at most N", parse=at_least_one, metavar="N"),
    )
    # Files and batches (api/batches).
    max_file_bytes: int = field(
        default=64 * 2**20,
        metadata=flag("POST /v1/files: a larger file is a 413", parse=at_least_one, metavar="N"),
    )
    max_file_bytes_per_key: int = field(
        default=512 * 2**20,
        metadata=flag(
            "what one API key's files may hold together", parse=at_least_one, metavar="N"
        ),
    )
    max_files_per_key: int = field(
        default=10_000,
        metadata=flag(
            "how many files one API key may hold (batch outputs are not counted)",
            parse=at_least_one,
            metavar="N",
        ),
    )
    batch_concurrency: int = field(
        default=32,
        metadata=flag(
            "a batch runs at most N of its requests at once", parse=at_least_one, metavar="N"
        ),
    )
    batch_completion_window_s: float = field(
        default=86_400.0,
        metadata=flag(
            "a batch's requests not done S seconds after it was created expire",
            names=("--batch-completion-window",),
            parse=float,
            metavar="S",
        ),
    )
    # Who may call (api/auth.py).
    api_keys: tuple[str, ...] = field(
        default=(),
        metadata=flag(
            "require this API key (repeatable)", names=("--api-key",), repeat=True, metavar="KEY"
        ),
    )
    api_keys_file: Path | None = field(
        default=None,
        metadata=flag(
            "TOML file of named keys stored as SHA-256 hashes ([keys.<name>])",
            names=("--api-keys",),
            metavar="FILE",
            into=optional_path,
        ),
    )
    metrics_token: str | None = field(
        default=None,
        metadata=flag("GET /metrics needs this bearer token", metavar="TOKEN"),
    )
    allowed_origins: tuple[str, ...] = field(
        default=(),
        metadata=flag(
            "allow browser clients from this origin (repeatable; * for any); CORS is off without",
            repeat=True,
            metavar="ORIGIN",
        ),
    )
    default_additional_properties: bool = field(
        default=False,
        metadata=flag(
            "what a JSON schema object that names properties and leaves out "
            "additionalProperties allows in structured outputs and forced tool calls: false "
            "(the default) keeps to the named keys; true reads it as JSON Schema does",
            parse=true_or_false,
            choices=(False, True),
            metavar="{false,true}",
        ),
    )
    chat_template_content_format: str | None = field(
        default=None,
        metadata=flag(
            "how the chat template gets message content: one string for text, or a list of "
            "typed parts (openai); auto (the default) decides from the template",
            choices=CONTENT_FORMATS,
        ),
    )
    tool_call_parser: str | None = field(
        default=None,
        metadata=flag(
            "the syntax the served models write tool calls in, as vLLM's (default: each "
            "registry entry's tool_parser)",
            choices=TOOL_CALL_SYNTAXES,
        ),
    )
    reasoning_parser: str | None = field(
        default=None,
        metadata=flag(
            "the served models reason in <think> blocks, answered as reasoning apart from the "
            "content (default: as each registry entry's capabilities say)",
            choices=REASONING_PARSERS,
        ),
    )
    chat_template: str | None = field(
        default=None,
        metadata=flag(
            "a Jinja chat template for the served models, replacing their own: a file, or the "
            "template in one line (\\n for a line break)",
            metavar="FILE|TEMPLATE",
        ),
    )
    served_model_names: tuple[str, ...] = field(
        default=(),
        metadata=flag(
            "the names clients use for the served model instead of its own (one --model); the "
            "first is the one /v1/models and the metrics show",
            names=("--served-model-name",),
            several=True,
            metavar="NAME",
        ),
    )


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
