"""The distributed backend: requests go to GPU workers as Celery tasks over Redis.

This process never loads a model (nor torch): it keeps the served model's
tokenizer for preparation, places each request on a worker's queue
(``api.backends.placement``), answers health and the context length from the
fleet watcher's snapshot (``api.backends.fleet``), admits requests against
it (``api.admission``), and runs each request through the process's
``RequestChannel`` (``api.backends.channel``), which it shares with async
jobs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from redis.exceptions import RedisError

from api.admission import Admission
from api.backends.base import Backend, BackendHealth, Place, ServedModel
from api.backends.channel import RequestChannel
from api.backends.fleet import FleetCollector, FleetWatcher
from api.backends.fleet_snapshot import FleetSnapshot
from api.backends.placement import Placer
from api.error_kinds import api_error
from shared import keys
from shared.events import InferenceEvent
from shared.generation_config import NO_DEFAULTS, sampling_defaults
from shared.heap import freeze_startup_heap
from shared.images.layout import ImageProcessing
from shared.images.loading import image_processing_for
from shared.registry import ModelSpec
from shared.tokenizer_loader import LoadedTokenizer, load_tokenizer
from shared.wire import PreparedRequest, QueuedRequest

if TYPE_CHECKING:
    from api.rate_limits import RateLimitTicket
    from api.settings import Settings

log = logging.getLogger(__name__)


class DistributedBackend(Backend):
    """Runs requests on workers through Redis; see the module docstring.

    ``channel``: the process's request channel, when async jobs share it;
    otherwise the backend makes one of its own.
    """

    def __init__(
        self,
        redis_url: str,
        spec: ModelSpec,
        settings: Settings,
        channel: RequestChannel | None = None,
    ) -> None:
        self._spec = spec
        self._max_model_len = settings.engine.max_model_len
        self._limits = settings.limits
        self._channel = channel or RequestChannel(redis_url, self._limits)
        self._fleet = FleetWatcher(self._channel.redis, spec.name)
        self._admission = Admission(self._limits, lambda: self.snapshot, self._count_outstanding)
        placer = Placer(self._channel.redis, spec.name, lambda: self.snapshot, settings.placement)
        self._channel.placers[spec.name] = placer
        self._collector = FleetCollector(
            spec.served_name, lambda: self.snapshot, settings.engine.max_num_seqs, placer.placed
        )
        self._tokenizer: LoadedTokenizer | None = None
        self._sampling_defaults = NO_DEFAULTS
        self._image_processing: ImageProcessing | None = None
        self._served: ServedModel | None = None
        self._load_error: str | None = None

    async def start(self) -> None:
        """Start the channel and the fleet watcher, then load the tokenizer."""
        await self._channel.start()
        self._fleet.start()
        try:
            self._image_processing = await asyncio.to_thread(image_processing_for, self._spec)
            self._tokenizer = await asyncio.to_thread(load_tokenizer, self._spec.tokenizer)
            self._sampling_defaults = await asyncio.to_thread(sampling_defaults, self._spec.weights)
        except Exception as exc:  # reported by /ready, like a model that fails to load
            log.exception("loading the tokenizer failed")
            self._load_error = f"loading the tokenizer failed: {exc}"
        else:
            freeze_startup_heap()

    async def stop(self) -> None:
        """Stop watching; the channel ends open requests with an ``Error``."""
        await self._fleet.stop()
        await self._channel.stop()

    async def admit(self, model: str | None = None) -> Place:
        """Admission for one request, before its preparation (429/503 ``ApiError``).

        Its place is kept in Redis by the submission, not by the ``Place`` returned.
        """
        await self._admission.admit()
        return Place()

    def metrics_collector(self) -> FleetCollector:
        """Per-model queue and worker gauges."""
        return self._collector

    @property
    def snapshot(self) -> FleetSnapshot:
        return self._fleet.snapshot

    def health(self) -> BackendHealth:
        """Ready once the tokenizer is loaded, Redis answers and the context length is known.

        The counters are the sums over the live workers' reports.
        """
        snapshot = self.snapshot
        workers = snapshot.workers
        detail = self._not_ready_because(snapshot)
        return BackendHealth(
            ready=detail is None,
            detail=detail or f"{len(snapshot.live)} live worker(s)",
            aborted=sum(worker.aborted for worker in workers),
            steps=sum(worker.steps for worker in workers),
            generated_tokens=sum(worker.generated_tokens for worker in workers),
        )

    def _not_ready_because(self, snapshot: FleetSnapshot) -> str | None:
        if self._load_error is not None:
            return self._load_error
        if self._tokenizer is None:
            return "loading the tokenizer"
        if self._fleet.stale or not self._channel.reader.connected:
            return "Redis is unreachable"
        if self._context_length(snapshot) <= 0:
            return "waiting for a worker to report the model's context length"
        return None

    def models(self) -> list[ServedModel]:
        """The served model; its context length is the smallest any live worker allows."""
        if self._tokenizer is None:
            return []
        length = self._context_length(self.snapshot)
        if self._served is None or self._served.context_length != length:
            self._served = ServedModel(
                self._spec, self._tokenizer, length, self._image_processing, self._sampling_defaults
            )
        return [self._served]

    def _context_length(self, snapshot: FleetSnapshot) -> int:
        limits = [self._spec.context_length, self._max_model_len or 0]
        limits += [worker.max_model_len for worker in snapshot.workers]
        positive = [limit for limit in limits if limit > 0]
        return min(positive) if positive else 0

    takes_shares = True  # the submit script takes a key's share as it admits the request

    def infer(
        self, request: PreparedRequest, ticket: RateLimitTicket | None = None
    ) -> AsyncIterator[InferenceEvent]:
        """The request's events; closing the iterator before its end cancels it on the worker.

        ``ticket``'s share is taken by the script that queues the request; a
        refusal raises its 429 before the first event.
        """
        deadlines = self._limits.deadlines(time.time())
        job = QueuedRequest(request, deadlines, origin=self._channel.process_id)
        return self._channel.request(job, self._limits.max_inflight, ticket)

    async def _count_outstanding(self) -> int:
        """The model's live in-flight entries, read now; a 503 if Redis is unreachable."""
        try:
            key = keys.inflight(self._spec.name)
            return await self._channel.redis.zcount(key, time.time(), "+inf")
        except (RedisError, OSError) as exc:
            raise api_error("unavailable", f"Redis is unreachable ({exc}); retry later.") from exc


__all__ = ["DistributedBackend"]
