"""The HTTP app: the protocol table, the routes, and how errors are answered.

Every generation route is the same handler driven by one row of
``PROTOCOLS``: read the JSON body, prepare it in a bounded threadpool, hand
the prepared request to the backend, and answer with SSE or JSON. Adding a
protocol is adding a row. Every error, whatever raised it, is rendered in the
shape of the protocol whose path was called, with the status it deserves.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import anyio
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from api.backends.base import Backend, ServedModel
from api.errors import ApiError, bad_request
from api.jobs.routes import jobs_router
from api.jobs.store import JobStore, MemoryJobStore
from api.metrics import ServingMetrics
from api.output_parser import OutputParser
from api.preparation import (
    PreparationContext,
    Prepared,
    encode_request,
    new_request_id,
    prepare,
)
from api.protocols import chat_completions, messages, responses
from api.protocols.base import Protocol
from api.streaming import StreamProcessor, collect, event_source
from shared.events import InferenceEvent
from shared.registry import ModelRegistry, ModelSpec, default_registry

log = logging.getLogger(__name__)

T = TypeVar("T")

PROTOCOLS: tuple[Protocol, ...] = (
    chat_completions.PROTOCOL,
    responses.PROTOCOL,
    messages.PROTOCOL,
)
# Routes outside the table answer errors like the protocol whose path they extend;
# anything else (models, tokenize, unknown paths) answers like OpenAI.
DEFAULT_ERROR_SHAPE = chat_completions.PROTOCOL


@dataclass(slots=True)
class Settings:
    """How ``sluice serve`` runs; ``config`` is a TOML model registry."""

    model: str = "default"
    config: Path | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    dtype: str = "auto"
    quantization: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 64
    preparation_threads: int = 8  # concurrent preparations; more wait their turn
    # Distributed mode (workers behind Redis) when set; see api/admission.py for the policy.
    redis_url: str | None = None
    queue_timeout_s: float = 30.0  # a worker must start the request by then: 503
    first_token_timeout_s: float = 60.0  # the first token must come by then: 504
    total_timeout_s: float = 600.0  # the whole generation must end by then: 504
    max_inflight: int = 256  # queued + in-flight requests per model before a 429
    # Async jobs (api/jobs): kept this long after submission; a batch holds at most this many.
    job_retention_s: float = 86_400.0
    max_batch_jobs: int = 100


def load_models(settings: Settings) -> tuple[ModelRegistry, ModelSpec]:
    """The registry this server answers with (the served model only) and its entry."""
    registry = ModelRegistry.from_toml(settings.config) if settings.config else default_registry()
    spec = registry.resolve(settings.model)
    return ModelRegistry([spec]), spec


class Serving:
    """What the routes share: backend, accepted names, preparation limiter, metrics."""

    def __init__(self, registry: ModelRegistry, backend: Backend, preparation_threads: int) -> None:
        self.registry = registry
        self.backend = backend
        self.limiter = anyio.CapacityLimiter(preparation_threads)
        self.metrics = ServingMetrics(backend.health)
        self._context: PreparationContext | None = None
        self._served: list[ServedModel] = []

    @asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        await self.backend.start()
        try:
            yield
        finally:
            await self.backend.stop()

    def context(self) -> PreparationContext:
        """The preparation context; 503 until the backend has loaded its model."""
        health = self.backend.health()
        if not health.ready:
            raise ApiError(
                503,
                f"The model is not ready ({health.detail}); retry when GET /ready answers 200.",
                "overloaded_error",
                headers={"Retry-After": "5"},
            )
        served = self.backend.models()
        if self._context is None or served != self._served:  # a queue's context length can move
            models = {model.spec.name: model for model in served}
            self._context, self._served = PreparationContext(self.registry, models), served
        return self._context

    async def admit(self) -> None:
        """Before a request is prepared: a backend that refuses work (429/503) does it here."""
        admit = getattr(self.backend, "admit", None)
        if admit is not None:
            await admit()

    async def off_loop(self, function: Callable[..., T], *args: Any) -> T:
        """Run CPU work (rendering, tokenizing) in the bounded threadpool."""
        return await anyio.to_thread.run_sync(function, *args, limiter=self.limiter)

    async def prepare(self, protocol: Protocol, body: dict[str, Any], request_id: str) -> Prepared:
        return await self.off_loop(prepare, protocol, body, self.context(), request_id)

    def run(
        self, prepared: Prepared, arrived: float
    ) -> tuple[StreamProcessor, AsyncIterator[InferenceEvent]]:
        """Start generating: the processor that reads the events, and the events."""
        request, wire = prepared.request, prepared.wire
        processor = StreamProcessor(
            prepared.protocol.builder(request, prepared.context),
            OutputParser(prepared.parser_config),
            prepared.model.tokenizer,
            prompt_tokens=len(wire.prompt_token_ids),
            logprobs=request.logprobs is not None,
        )
        events = self.metrics.track(prepared.protocol.name, self.backend.infer(wire), arrived)
        return processor, events


def create_app(settings: Settings | None = None, backend: Backend | None = None) -> FastAPI:
    """The app for ``settings``; ``backend`` defaults to the embedded engine."""
    settings = settings or Settings()
    registry, spec = load_models(settings)
    serving = Serving(
        registry, backend or _default_backend(spec, settings), settings.preparation_threads
    )
    collector = getattr(serving.backend, "metrics_collector", None)
    if collector is not None:  # per-model queue and worker gauges in distributed mode
        serving.metrics.registry.register(collector)
    app = FastAPI(title="Sluice", lifespan=serving.lifespan)
    app.state.serving = serving
    for protocol in PROTOCOLS:
        app.add_api_route(protocol.path, _generation_route(protocol, serving), methods=["POST"])
    app.add_api_route(messages.COUNT_TOKENS_PATH, _count_tokens_route(serving), methods=["POST"])
    app.add_api_route("/v1/tokenize", _tokenize_route(serving), methods=["POST"])
    app.add_api_route("/v1/models", _models_route(serving), methods=["GET"])
    app.add_api_route("/health", _health, methods=["GET"])
    app.add_api_route("/ready", _ready_route(serving), methods=["GET"])
    app.add_api_route("/metrics", _metrics_route(serving), methods=["GET"])
    app.include_router(jobs_router(serving, _job_store(settings), settings))
    _install_error_handlers(app, serving)
    return app


def _default_backend(spec: ModelSpec, settings: Settings) -> Backend:
    """Workers behind Redis with ``redis_url`` (no torch here), else the embedded engine."""
    if settings.redis_url:
        from api.backends.distributed import DistributedBackend

        return DistributedBackend(settings.redis_url, spec, settings)
    return _embedded_backend(spec, settings)


def _job_store(settings: Settings) -> JobStore:
    """Redis with workers (shared by replicas, kept across restarts), else this process's memory.

    The in-memory store of the embedded mode does not survive a restart.
    """
    if settings.redis_url:
        from api.jobs.redis_store import RedisJobStore

        return RedisJobStore(settings.redis_url, settings.job_retention_s)
    return MemoryJobStore(settings.job_retention_s)


def _embedded_backend(spec: ModelSpec, settings: Settings) -> Backend:
    from api.backends.embedded import EmbeddedBackend, engine_args_for

    args = engine_args_for(
        spec,
        dtype=settings.dtype,
        quantization=settings.quantization,
        max_model_len=settings.max_model_len,
        max_num_seqs=settings.max_num_seqs,
        registry_file=str(settings.config) if settings.config else None,
    )
    return EmbeddedBackend(spec, args)


# --- routes --------------------------------------------------------------------


def _generation_route(protocol: Protocol, serving: Serving) -> Callable[..., Awaitable[Response]]:
    async def generate(request: Request) -> Response:
        arrived = time.monotonic()
        request_id = new_request_id(protocol)
        await serving.admit()
        prepared = await serving.prepare(protocol, await read_json(request), request_id)
        processor, events = serving.run(prepared, arrived)
        if prepared.request.stream:
            answer: Awaitable[Response] = event_source(processor, events, protocol.done_marker)
        else:
            answer = _json_response(collect(processor, events))
        response = await _unless_client_leaves(request, answer) or Response(status_code=499)
        serving.metrics.count_request(protocol.name, response.status_code)
        return response

    generate.__name__ = f"create_{protocol.name.replace('.', '_')}"
    return generate


async def _json_response(body: Awaitable[dict]) -> Response:
    """The whole response, as one awaitable that the client leaving can cancel."""
    return JSONResponse(await body)


def _count_tokens_route(serving: Serving) -> Callable[..., Awaitable[Response]]:
    async def count_tokens(request: Request) -> Response:
        parsed = messages.parse_count_tokens(await read_json(request))
        encoded = await serving.off_loop(encode_request, parsed, serving.context())
        return JSONResponse(messages.count_tokens_body(len(encoded.token_ids)))

    return count_tokens


def _tokenize_route(serving: Serving) -> Callable[..., Awaitable[Response]]:
    async def tokenize(request: Request) -> Response:
        """A Chat Completions body → the exact prompt and token ids the model would get."""
        parsed = chat_completions.PROTOCOL.parse(await read_json(request))
        encoded = await serving.off_loop(encode_request, parsed, serving.context())
        return JSONResponse(
            {
                "model": parsed.model,
                "prompt": encoded.rendered.prompt,
                "special_ranges": [list(span) for span in encoded.rendered.special_ranges],
                "token_ids": encoded.token_ids,
                "count": len(encoded.token_ids),
            }
        )

    return tokenize


def _models_route(serving: Serving) -> Callable[..., Awaitable[Response]]:
    created = int(time.time())

    async def list_models() -> Response:
        """OpenAI's list shape; every accepted name, aliases included, is a model."""
        data = [
            {"id": name, "object": "model", "created": created, "owned_by": "sluice"}
            for name in serving.registry.names()
        ]
        return JSONResponse({"object": "list", "data": data})

    return list_models


async def _health() -> Response:
    """Liveness: the process answers. Readiness is ``/ready``."""
    return JSONResponse({"status": "ok"})


def _ready_route(serving: Serving) -> Callable[..., Awaitable[Response]]:
    async def ready() -> Response:
        """200 once the model is loaded; 503 (with why) before that or if loading failed."""
        health = serving.backend.health()
        if not health.ready:
            return JSONResponse({"status": "not_ready", "detail": health.detail}, status_code=503)
        return JSONResponse({"status": "ready", "models": serving.registry.names()})

    return ready


def _metrics_route(serving: Serving) -> Callable[..., Awaitable[Response]]:
    async def metrics() -> Response:
        return Response(serving.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    return metrics


# --- request bodies and client disconnects ----------------------------------------


async def read_json(request: Request) -> dict[str, Any]:
    """The body as a JSON object; a 400 for another content type or malformed JSON."""
    content_type = request.headers.get("content-type", "")
    media_type = content_type.split(";", 1)[0].strip().lower()
    if media_type and media_type != "application/json" and not media_type.endswith("+json"):
        raise bad_request(f"Content-Type must be application/json, got {content_type!r}")
    raw = await request.body()
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request(f"The request body must be a JSON object, got {type(body).__name__}")
    return body


async def _unless_client_leaves(request: Request, work: Awaitable[T]) -> T | None:
    """Await ``work``, cancelling it (and returning None) if the client disconnects first.

    Starlette does not cancel a handler whose client left, so a whole
    (non-stream) response would otherwise run to the end for nobody, and a
    stream still waiting for its first event (queued behind busy workers)
    would stay queued and later run for nobody: sse-starlette only watches
    for the disconnect once it has the response. The body is already read,
    so the only message left to receive is the disconnect. Cancelling
    ``work`` (``collect`` or ``event_source``) closes the backend's
    iterator, which cancels the request (distributed: the cancel flag and
    channel, so a job not yet started is dropped unrun).
    """
    result: T | None = None
    failure: Exception | None = None
    async with anyio.create_task_group() as group:

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            group.cancel_scope.cancel()

        group.start_soon(watch)
        try:
            result = await work
        except Exception as exc:  # raised below, outside the group, so not in an ExceptionGroup
            failure = exc
        group.cancel_scope.cancel()
    if failure is not None:
        raise failure
    return result


# --- errors ---------------------------------------------------------------------


def error_shape(path: str) -> Protocol:
    """The protocol whose path ``path`` is or extends (the longest such path)."""
    owners = [p for p in PROTOCOLS if path == p.path or path.startswith(p.path + "/")]
    return max(owners, key=lambda p: len(p.path), default=DEFAULT_ERROR_SHAPE)


def _install_error_handlers(app: FastAPI, serving: Serving) -> None:
    protocol_paths = {protocol.path for protocol in PROTOCOLS}

    def respond(request: Request, error: ApiError) -> Response:
        protocol = error_shape(request.url.path)
        if request.url.path in protocol_paths:
            serving.metrics.count_request(protocol.name, error.status)
        return JSONResponse(
            protocol.error_body(error), status_code=error.status, headers=error.headers
        )

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return respond(request, exc)

    async def validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        first = exc.errors()[0] if exc.errors() else {}
        field = ".".join(str(part) for part in first.get("loc", ()) if part != "body") or None
        message = f"{field or 'request'}: {first.get('msg', 'invalid request')}"
        return respond(request, bad_request(message, field))

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return respond(request, ApiError(exc.status_code, str(exc.detail), kind))

    async def unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s", request.url.path, exc_info=exc)
        return respond(request, ApiError(500, f"Internal server error: {exc}", "api_error"))

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)


__all__ = [
    "PROTOCOLS",
    "Serving",
    "Settings",
    "create_app",
    "error_shape",
    "load_models",
    "read_json",
]
