"""What the routes share: the backend, the accepted names, the preparation pool, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any, TypeVar

from fastapi import FastAPI, Request

from api.auth import ApiKey
from api.backends.base import Backend, Place, ServedModel
from api.errors import ApiError
from api.images.budget import DecodingBudget, ImageTokenBudget
from api.metrics import ServingMetrics
from api.output_parser import OutputParser
from api.preparation import PreparationContext, Prepared, prepare
from api.preparation_pool import PreparationPool
from api.protocols.base import Protocol
from api.rate_limits import KeyShare, MemoryRateLimiter, RateLimiter, RateLimitTicket
from api.request_body import read_json, read_json_value
from api.settings import Settings
from api.streaming import StreamProcessor
from shared.events import InferenceEvent
from shared.registry import ModelRegistry

T = TypeVar("T")
log = logging.getLogger(__name__)


class Serving:
    """The backend behind every route, with preparation in a bounded pool (``settings``)."""

    def __init__(
        self,
        registry: ModelRegistry,
        backend: Backend,
        settings: Settings,
        rate_limiter: RateLimiter | None = None,
    ) -> None:
        self.registry = registry
        self._names = frozenset(registry.names())
        self.backend = backend
        self.rate_limiter = rate_limiter or MemoryRateLimiter()
        self.max_body_bytes = settings.max_body_bytes  # what a request body may hold, at most
        self.body_timeout_s = settings.body_timeout_s  # how long it may take to arrive
        self.pool = PreparationPool(
            settings.preparation_threads, settings.max_preparing, settings.prepare_timeout_s
        )
        self.metrics = ServingMetrics(backend.health)
        collector = backend.metrics_collector()
        if collector is not None:
            self.metrics.registry.register(collector)
        # The process's image budgets: tokens of the requests running, bytes being decoded
        # (waited for no longer than a preparation may take).
        self.image_tokens = ImageTokenBudget(settings.image_token_budget)
        decoding = DecodingBudget(settings.images.decoding.limit, settings.prepare_timeout_s)
        self.images = replace(settings.images, decoding=decoding)
        self.additional_properties = settings.default_additional_properties
        self._context: PreparationContext | None = None
        self._served: list[ServedModel] = []
        # Why the backend can serve no more, once it cannot; ``on_failure`` then stops the
        # server (``api.server`` sets it), so an orchestrator restarts the process.
        self.failure: str | None = None
        self.on_failure: Callable[[], None] = lambda: None

    @asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        await self.backend.start()
        watch = asyncio.create_task(self._stop_on_failure())
        try:
            yield
        finally:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch
            self.pool.close()
            await self.backend.stop()

    async def _stop_on_failure(self) -> None:
        self.failure = await self.backend.failure()
        log.error("the server stops: %s", self.failure)
        self.on_failure()

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
            self._context, self._served = (
                PreparationContext(
                    self.registry,
                    models,
                    self.images,
                    self.image_tokens,
                    self.additional_properties,
                ),
                served,
            )
        return self._context

    async def read_json(self, request: Request, value: bool = False) -> Any:
        """The request's JSON body (an object; any value with ``value``) within the limits."""
        read = read_json_value if value else read_json
        return await read(request, self.max_body_bytes, timeout_s=self.body_timeout_s)

    async def admit(self, body: dict[str, Any]) -> Place:
        """Before a request is prepared: the backend refuses work it has no room for (429/503).

        ``body`` is the request's, for the model it names. The caller releases the
        place once the request has ended.
        """
        name = body.get("model")
        known = isinstance(name, str) and name in self._names  # else preparation answers it
        return await self.backend.admit(self.registry.resolve(name).name if known else None)

    async def off_loop(self, function: Callable[..., T], *args: Any) -> T:
        """Run CPU work (rendering, tokenizing) in the bounded pool, under the prepare timeout."""
        return await self.pool.run(function, *args)

    async def prepare(
        self,
        protocol: Protocol,
        body: dict[str, Any],
        request_id: str,
        key: ApiKey | None = None,
    ) -> Prepared:
        """The prepared request, under ``key``'s models and priority when there is one.

        A key's priority is its requests' default and the most urgent (lowest) they may ask for.
        The request holds its images' tokens until ``run``'s events end; a caller that does
        not run it gives them back with ``Prepared.release``.
        """
        prepared = await self.off_loop(prepare, protocol, body, self.context(), request_id)
        if key is not None:
            spec = prepared.model.spec
            if not any(key.allows(name) for name in (spec.name, *spec.public_names)):
                prepared.release()
                raise ApiError(
                    404,
                    f"The model '{prepared.request.model}' does not exist or you do not have "
                    "access to it.",
                    "not_found_error",
                    "model",
                    "model_not_found",
                )
            prepared.wire.priority = max(prepared.wire.priority, key.priority)
        return prepared

    async def limit(
        self,
        key: ApiKey | None,
        prepared: Prepared,
        *,
        holds_place: bool = True,
        tokens: int | None = None,
    ) -> RateLimitTicket | None:
        """The key's share for a prepared request, taken now, or a 429 with the rate-limit headers.

        The reservation is its prompt tokens and resolved ``max_tokens``; the
        ticket gives back what the request did not use when it ends (``tokens``
        reserves another amount: a request of several prompts). An async
        job (``holds_place`` false) takes requests and tokens but no concurrent
        place. A backend that admits requests in Redis (``takes_shares``) takes
        a request's share in the same script that admits it: the ticket comes
        back untaken, for ``run`` to hand to it.
        """
        if key is None or not key.limits.any:
            return None
        limits = key.limits if holds_place else replace(key.limits, max_concurrent=None)
        wire = prepared.wire
        reserved = len(wire.prompt_token_ids) + wire.sampling.max_tokens
        share = KeyShare(key.name, limits, reserved if tokens is None else tokens)
        ticket = RateLimitTicket(
            self.rate_limiter, share, prepared.protocol.anthropic_rate_limit_headers
        )
        if not (holds_place and self.backend.takes_shares):
            try:
                ticket.take(await self.rate_limiter.acquire(share.key, share.limits, share.tokens))
            except ApiError:  # refused: the request will not run, nor hold its images' tokens
                prepared.release()
                raise
        return ticket

    def run(
        self, prepared: Prepared, arrived: float, ticket: RateLimitTicket | None = None
    ) -> tuple[StreamProcessor, AsyncIterator[InferenceEvent]]:
        """Start generating: the processor that reads the events, and the events.

        ``ticket``: the key's share from ``limit``, which the backend takes as it
        admits the request when it takes shares (its first event raises the 429).
        """
        request, wire = prepared.request, prepared.wire
        processor = StreamProcessor(
            prepared.protocol.builder(request, prepared.context),
            OutputParser(prepared.parser_config),
            prepared.model.tokenizer,
            prompt_tokens=len(wire.prompt_token_ids),
            logprobs=request.logprobs is not None,
            first_prompt_token=wire.prompt_token_ids[0],
        )
        backend = self.backend
        # Only a backend that takes shares sees the ticket; for others it is taken already.
        generation = backend.infer(wire, ticket) if backend.takes_shares else backend.infer(wire)
        generation = prepared.holding(generation)  # images' tokens, held to the end
        events = self.metrics.track(prepared, generation, arrived)
        return processor, events
