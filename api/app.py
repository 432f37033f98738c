"""The HTTP app: the routes, and how errors are answered.

Every generation route is the same handler driven by one row of
``api.protocols.table.PROTOCOLS``: read the JSON body, prepare it in a bounded threadpool, hand
the prepared request to the backend, and answer with SSE or JSON. Adding a
protocol is adding a row. Every error, whatever raised it, is rendered in the
shape of the protocol whose path was called, with the status it deserves.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import anyio
from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException

from api import choices
from api.access_log import AccessLog, AccessRecord
from api.auth import Authentication, KeyRing, caller_key, caller_name
from api.backends.base import Backend
from api.batches import anthropic_batches, openai_batches
from api.batches.files import Files, files_router
from api.batches.objects import MemoryObjects, ObjectStore
from api.batches.service import Batches
from api.errors import ApiError, bad_request
from api.info_routes import info_router
from api.jobs.manager import JobManager
from api.jobs.responses import StoredResponses, responses_router
from api.jobs.routes import jobs_router
from api.jobs.store import JobStore, MemoryJobStore
from api.openapi_bodies import document_bodies, json_body
from api.preparation import Prepared, encode_request, new_request_id
from api.protocols import messages, responses
from api.protocols.base import Protocol
from api.protocols.messages_schema import CountTokensBody
from api.protocols.openai_common import choices_per_prompt
from api.protocols.table import BY_PATH, PROTOCOLS, error_shape, route_path
from api.rate_limits import MemoryRateLimiter, RateLimiter, RedisRateLimiter
from api.serving import Serving
from api.settings import Settings, load_models
from api.stall_guard import StallGuard
from api.store_errors import store_unreachable
from api.streaming import collect, event_source
from api.unexpected_errors import UnexpectedErrors
from shared.events import InferenceEvent, Text
from shared.registry import ModelSpec

if TYPE_CHECKING:
    from api.backends.channel import RequestChannel

log = logging.getLogger(__name__)
# Names the request fields that were ignored because no reader of the protocol knows them.
IGNORED_FIELDS_HEADER = "sluice-ignored-fields"
MAX_IGNORED_HEADER = 1000
STORE_RETRY_AFTER_S = 2
PLAYGROUND = Path(__file__).parent / "playground"  # static files, no build step

T = TypeVar("T")


def create_app(settings: Settings | None = None, backend: Backend | None = None) -> FastAPI:
    """The app for ``settings``; ``backend`` defaults to the embedded engine."""
    settings = settings or Settings()
    registry, specs = load_models(settings)
    channel = _request_channel(settings)
    serving = Serving(
        registry,
        backend or _default_backend(specs, settings, channel),
        settings,
        _rate_limiter(channel),
    )
    app = FastAPI(title="Sluice", lifespan=serving.lifespan)
    app.state.serving = serving
    manager = JobManager(serving, _job_store(settings), BY_PATH, channel)
    stored = StoredResponses(manager)
    for protocol in PROTOCOLS:
        if protocol is responses.PROTOCOL:
            route = _responses_route(serving, stored)
        elif protocol.choice_bodies is not None:
            route = _choices_route(protocol, serving)
        else:
            route = _generation_route(protocol, serving)
        body = json_body(protocol.request_model)
        app.add_api_route(protocol.path, route, methods=["POST"], openapi_extra=body)
    app.include_router(responses_router(stored))
    app.add_api_route(
        messages.COUNT_TOKENS_PATH,
        _count_tokens_route(serving),
        methods=["POST"],
        openapi_extra=json_body(CountTokensBody),
    )
    app.include_router(info_router(serving))
    app.mount("/playground", StaticFiles(directory=PLAYGROUND, html=True), name="playground")
    app.add_api_route("/", _to_playground, methods=["GET"], include_in_schema=False)
    app.add_api_route("/health", _health_route(serving), methods=["GET"])
    app.add_api_route("/ready", _ready_route(serving), methods=["GET"])
    app.add_api_route("/metrics", _metrics_route(serving), methods=["GET"])
    app.include_router(jobs_router(manager, settings))
    keys = KeyRing.configured(settings.api_keys, settings.api_keys_file)
    _add_batches(app, manager, keys, settings)
    _install_error_handlers(app, serving)
    document_bodies(app)
    log.info("%s", keys.describe())
    app.add_middleware(Authentication, keys=keys, metrics_token=settings.metrics_token)
    if settings.allowed_origins:  # outside authentication: a preflight carries no key
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.allowed_origins),
            allow_methods=["GET", "POST", "DELETE"],
            allow_headers=["*"],
            expose_headers=["x-request-id", IGNORED_FIELDS_HEADER, "retry-after"],
        )
    app.add_middleware(StallGuard, timeout_s=settings.stall_timeout_s)
    app.add_middleware(AccessLog, metrics=serving.metrics)  # outermost: sees every answer
    return app


def _request_channel(settings: Settings) -> RequestChannel | None:
    """With ``redis_url``: the one channel to the workers that requests and jobs share."""
    if not settings.redis_url:
        return None
    from api.backends.channel import RequestChannel

    return RequestChannel(settings.redis_url, settings.limits)


def _default_backend(
    specs: list[ModelSpec], settings: Settings, channel: RequestChannel | None
) -> Backend:
    """Per model: workers behind Redis with ``redis_url`` (no torch here), else an embedded
    engine; several models behind one backend that routes by model."""
    backends = {spec.name: _model_backend(spec, settings, channel) for spec in specs}
    if len(backends) == 1:
        return next(iter(backends.values()))
    from api.backends.several import SeveralModels

    return SeveralModels(backends)


def _model_backend(spec: ModelSpec, settings: Settings, channel: RequestChannel | None) -> Backend:
    if settings.redis_url:
        from api.backends.distributed import DistributedBackend

        return DistributedBackend(settings.redis_url, spec, settings, channel)
    return _embedded_backend(spec, settings)


def _rate_limiter(channel: RequestChannel | None) -> RateLimiter:
    """Keys' buckets in Redis, shared by the replicas, with workers; else in this process."""
    return RedisRateLimiter(channel.redis) if channel is not None else MemoryRateLimiter()


def _job_store(settings: Settings) -> JobStore:
    """Redis with workers (shared by replicas, kept across restarts), else this process's memory.

    The in-memory store of the embedded mode does not survive a restart.
    """
    if settings.redis_url:
        from api.jobs.redis_store import RedisJobStore

        return RedisJobStore(settings.redis_url, settings.job_retention_s)
    return MemoryJobStore(settings.job_retention_s)


def _add_batches(app: FastAPI, manager: JobManager, keys: KeyRing, settings: Settings) -> None:
    """Files, OpenAI's Batch API and Anthropic's Message Batches, kept where jobs are (Redis,
    else this process)."""
    objects: ObjectStore = MemoryObjects()
    if settings.redis_url:
        from api.batches.objects import RedisObjects

        objects = RedisObjects(settings.redis_url)
    files = Files(
        objects,
        max_file_bytes=settings.max_file_bytes,
        max_bytes_per_key=settings.max_file_bytes_per_key,
        max_files_per_key=settings.max_files_per_key,
        default_expiry_s=settings.job_retention_s,
        body_timeout_s=settings.body_timeout_s,
    )
    finalizers = {
        openai_batches.API: openai_batches.output_finalizer(files),
        anthropic_batches.API: anthropic_batches.results_finalizer(files),
    }
    batches = Batches(
        manager, objects, keys, finalizers, settings.batch_concurrency, settings.job_retention_s
    )
    window_s = settings.batch_completion_window_s
    app.include_router(APIRouter(lifespan=batches.lifespan))
    app.include_router(files_router(files))
    app.include_router(openai_batches.openai_batches_router(batches, files, window_s))
    app.include_router(anthropic_batches.anthropic_batches_router(batches, files, window_s))


def _embedded_backend(spec: ModelSpec, settings: Settings) -> Backend:
    from api.backends.embedded import EmbeddedBackend
    from engine.config import EngineArgs

    registry_file = str(settings.config) if settings.config else None
    args = EngineArgs.serving(spec, settings.engine, registry_file)
    return EmbeddedBackend(spec, args, limits=settings.limits)


# --- routes --------------------------------------------------------------------


async def _to_playground() -> Response:
    """The root is the playground: a chat page over ``/v1/chat/completions``."""
    return RedirectResponse("/playground/")


def _generation_route(protocol: Protocol, serving: Serving) -> Callable[..., Awaitable[Response]]:
    async def generate(request: Request) -> Response:
        arrived = time.monotonic()
        body = await serving.read_json(request)  # first: a slow upload holds no place
        response, _ = await _generate(serving, protocol, request, body, arrived)
        return response

    generate.__name__ = f"create_{protocol.name.replace('.', '_')}"
    return generate


def _choices_route(protocol: Protocol, serving: Serving) -> Callable[..., Awaitable[Response]]:
    """The generation route, or ``api.choices`` when a body asks for several choices."""

    async def create(request: Request) -> Response:
        arrived = time.monotonic()
        body = await serving.read_json(request)
        bodies = choices.choice_bodies(protocol, body)
        if len(bodies) == 1:
            response, _ = await _generate(serving, protocol, request, bodies[0], arrived)
            return response
        per_prompt = choices_per_prompt(body)
        answer = await choices.start(serving, protocol, request, bodies, arrived, per_prompt)
        response = await _unless_client_leaves(request, answer) or Response(status_code=499)
        rate_limits = request.state.access.rate_limits
        if rate_limits is not None:
            response.headers.update(rate_limits.headers)
        return response

    create.__name__ = f"create_{protocol.name.replace('.', '_')}"
    return create


def _responses_route(
    serving: Serving, stored: StoredResponses
) -> Callable[..., Awaitable[Response]]:
    """Responses: the generation route, with the previous response resolved, the background
    queued as a job, and a finished foreground response stored (``api.jobs.responses``)."""

    async def create_response(request: Request) -> Response:
        arrived = time.monotonic()
        owner = caller_name(request)
        body = await serving.read_json(request)
        if isinstance(body, dict) and body.get("background") is True:
            return await stored.submit_background(body, caller_key(request))  # resolves it
        body = await stored.resolve_previous(body, owner)
        response, prepared = await _generate(serving, responses.PROTOCOL, request, body, arrived)
        processor = request.state.access.processor
        if not prepared.request.echo["store"] or processor is None:
            return response
        if prepared.request.stream:  # kept once the last event is sent
            response.background = BackgroundTask(stored.keep, prepared, processor, body, owner)
        else:  # kept before the answer, so that a retrieve right after it finds it
            await stored.keep(prepared, processor, body, owner)
        return response

    return create_response


async def _generate(
    serving: Serving, protocol: Protocol, request: Request, body: dict, arrived: float
) -> tuple[Response, Prepared]:
    """Admit, prepare and run one request body; the answer (SSE or JSON) and the request."""
    request_id = new_request_id(protocol)
    access: AccessRecord = request.state.access
    access.place = await serving.admit(body)  # released when the request ends
    key = caller_key(request)
    prepared = await serving.prepare(protocol, body, request_id, key)
    access.rate_limits = await serving.limit(key, prepared)  # 429 beyond the key's limits
    processor, events = serving.run(prepared, arrived, access.rate_limits)
    access.model, access.processor = prepared.request.model, processor
    access.response_id = prepared.context.request_id
    events = _noting_first_token(events, access)
    if prepared.request.stream:
        answer: Awaitable[Response] = event_source(processor, events, protocol.done_marker)
    else:
        answer = _json_response(collect(processor, events))
    response = await _unless_client_leaves(request, answer) or Response(status_code=499)
    _report_ignored(prepared, response)
    if access.rate_limits is not None:
        response.headers.update(access.rate_limits.headers)
    return response, prepared


async def _noting_first_token(
    events: AsyncIterator[InferenceEvent], access: AccessRecord
) -> AsyncIterator[InferenceEvent]:
    """``events``, with the time of the first generated token left in the access record."""
    try:
        async for event in events:
            if access.first_token_at is None and isinstance(event, Text) and event.token_ids:
                access.first_token_at = time.monotonic()
            yield event
    finally:
        await events.aclose()


def _report_ignored(prepared: Prepared, response: Response) -> None:
    """Fields no protocol reader knows are ignored, and said to be: in a header and the log."""
    ignored = prepared.request.ignored_fields
    if ignored:
        # JSON string escapes keep any name a valid header value; a long list is cut.
        names = ", ".join(json.dumps(name)[1:-1] for name in ignored)[:MAX_IGNORED_HEADER]
        log.warning("%s: ignored unknown fields: %s", prepared.context.request_id, names)
        response.headers[IGNORED_FIELDS_HEADER] = names


async def _json_response(body: Awaitable[dict]) -> Response:
    """The whole response, as one awaitable that the client leaving can cancel."""
    return JSONResponse(await body)


def _count_tokens_route(serving: Serving) -> Callable[..., Awaitable[Response]]:
    async def count_tokens(request: Request) -> Response:
        parsed = messages.parse_count_tokens(await serving.read_json(request))
        encoded = await serving.off_loop(encode_request, parsed, serving.context())
        return JSONResponse(messages.count_tokens_body(len(encoded.token_ids)))

    return count_tokens


def _health_route(serving: Serving) -> Callable[..., Awaitable[Response]]:
    async def health() -> Response:
        """Liveness: 200 while the process can serve; 503 once its backend cannot (the model
        failed to load, the engine died) and the process is stopping. Readiness is ``/ready``."""
        health = serving.backend.health()
        if health.failed:
            return JSONResponse({"status": "failed", "detail": health.detail}, status_code=503)
        return JSONResponse({"status": "ok"})

    return health


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


def _install_error_handlers(app: FastAPI, serving: Serving) -> None:

    def respond(request: Request, error: ApiError) -> Response:
        protocol = error_shape(route_path(request.scope))
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

    def unexpected_response(request: Request, exc: Exception) -> Response:
        if store_unreachable(exc):  # Redis is down or slow: nothing the client did, retry
            log.warning("%s: the store failed: %s", request.url.path, exc)
            message = "The server's store (Redis) did not answer; retry shortly."
            headers = {"Retry-After": str(STORE_RETRY_AFTER_S)}
            return respond(request, ApiError(503, message, "overloaded_error", headers=headers))
        log.exception("unhandled error on %s", request.url.path, exc_info=exc)
        return respond(request, ApiError(500, f"Internal server error: {exc}", "api_error"))

    async def unexpected(request: Request, exc: Exception) -> Response:
        return unexpected_response(request, exc)

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)  # what the middlewares themselves raise
    app.add_middleware(UnexpectedErrors, render=unexpected_response)  # right around the routes


__all__ = ["create_app"]
