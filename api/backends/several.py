"""Several models behind one API: one backend per model, each request to its model's.

Each model keeps the backend it would have alone (an engine thread of its
own, or its own queues and worker pool behind Redis); this one routes by the
prepared request's model and answers for all of them together: ready once
every model is, failed once any has failed, counters summed.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from api.backends.base import Backend, BackendHealth, Place, ServedModel
from shared.events import InferenceEvent
from shared.wire import PreparedRequest

if TYPE_CHECKING:
    from api.rate_limits import RateLimitTicket


class SeveralModels(Backend):
    """Routes each request to ``backends[request.model]`` (keyed by registry name)."""

    def __init__(self, backends: Mapping[str, Backend]) -> None:
        self._backends = dict(backends)  # of one kind: all embedded, or all distributed
        self.takes_shares = all(backend.takes_shares for backend in self._backends.values())

    async def start(self) -> None:
        await asyncio.gather(*(backend.start() for backend in self._backends.values()))

    async def stop(self) -> None:
        await asyncio.gather(*(backend.stop() for backend in self._backends.values()))

    def health(self) -> BackendHealth:
        healths = {name: backend.health() for name, backend in self._backends.items()}
        waiting_for = [f"{name}: {health.detail}" for name, health in healths.items()]
        values = list(healths.values())
        return BackendHealth(
            ready=all(health.ready for health in values),
            detail="; ".join(waiting_for),
            failed=any(health.failed for health in values),
            aborted=sum(health.aborted for health in values),
            steps=sum(health.steps for health in values),
            generated_tokens=sum(health.generated_tokens for health in values),
        )

    def models(self) -> list[ServedModel]:
        return [model for backend in self._backends.values() for model in backend.models()]

    async def admit(self, model: str | None = None) -> Place:
        """The model's own admission; a name no backend serves is admitted, for preparation
        to answer with the error that lists the served models."""
        backend = self._backends.get(model or "")
        return await backend.admit() if backend is not None else Place()

    def infer(
        self, request: PreparedRequest, ticket: RateLimitTicket | None = None
    ) -> AsyncIterator[InferenceEvent]:
        backend = self._backends[request.model]
        return backend.infer(request, ticket) if self.takes_shares else backend.infer(request)

    async def failure(self) -> str:
        failures = [
            asyncio.ensure_future(self._named_failure(name, backend))
            for name, backend in self._backends.items()
        ]
        try:
            done, _ = await asyncio.wait(failures, return_when=asyncio.FIRST_COMPLETED)
            return next(iter(done)).result()
        finally:
            for waiting in failures:
                waiting.cancel()

    @staticmethod
    async def _named_failure(name: str, backend: Backend) -> str:
        return f"model {name}: {await backend.failure()}"

    def metrics_collector(self) -> Collector | None:
        collectors = [
            collector
            for backend in self._backends.values()
            if (collector := backend.metrics_collector()) is not None
        ]
        return _Merged(collectors) if collectors else None


class _Merged(Collector):
    """The models' collectors as one: each family once, with every model's samples."""

    def __init__(self, collectors: list[Collector]) -> None:
        self._collectors = collectors

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for collector in self._collectors:
            for family in collector.collect():
                if family.name in families:
                    families[family.name].samples.extend(family.samples)
                else:
                    families[family.name] = family
        yield from families.values()
