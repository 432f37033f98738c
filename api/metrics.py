"""Prometheus metrics: what the API sees per request, and what the engine reports.

Each app gets its own ``CollectorRegistry``, so several apps in one process
(tests) do not collide. Request metrics are observed by wrapping the
backend's event iterator (``ServingMetrics.track``); engine gauges are read
from the backend's health snapshot at scrape time.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from api.backends.base import BackendHealth
from shared.events import Finish, InferenceEvent, Ready, Text

if TYPE_CHECKING:
    from api.preparation import Prepared

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class ServingMetrics:
    def __init__(self, health: Callable[[], BackendHealth]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "sluice_requests",
            "HTTP generation requests by protocol and status code.",
            ["protocol", "status"],
            registry=self.registry,
        )
        self.time_to_first_token = Histogram(
            "sluice_time_to_first_token_seconds",
            "From the request's arrival to its first generated token.",
            ["protocol"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            "sluice_inter_token_latency_seconds",
            "Between consecutive generated tokens of one request.",
            ["protocol"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.prompt_tokens = self._token_counter("prompt", "Prompt tokens processed.")
        self.cached_prompt_tokens = self._token_counter(
            "cached_prompt", "Prompt tokens served from the prefix cache (the workers' caches)."
        )
        self.completion_tokens = self._token_counter("completion", "Completion tokens generated.")
        self.registry.register(_EngineCollector(health))

    def _token_counter(self, kind: str, documentation: str) -> Counter:
        labels = ["model", "protocol"]
        return Counter(f"sluice_{kind}_tokens", documentation, labels, registry=self.registry)

    def count_request(self, protocol: str, status: int) -> None:
        self.requests.labels(protocol, str(status)).inc()

    async def track(
        self, prepared: Prepared, events: AsyncIterator[InferenceEvent], arrived: float
    ) -> AsyncIterator[InferenceEvent]:
        """Pass ``events`` through, observing latency and token counts by protocol and model.

        Closing this iterator closes ``events`` (which cancels the request).
        """
        protocol, model = prepared.protocol.name, prepared.model.spec.name
        last_token: float | None = None
        inter_token = self.inter_token_latency.labels(protocol)  # looked up once, not per token
        try:
            async for event in events:
                now = time.monotonic()
                if isinstance(event, Text) and event.token_ids:
                    if last_token is None:
                        self.time_to_first_token.labels(protocol).observe(now - arrived)
                    else:
                        inter_token.observe(now - last_token)
                    last_token = now
                elif isinstance(event, Ready):
                    self.prompt_tokens.labels(model, protocol).inc(event.prompt_tokens)
                    cached = self.cached_prompt_tokens.labels(model, protocol)
                    cached.inc(event.cached_tokens)
                elif isinstance(event, Finish):
                    completion = self.completion_tokens.labels(model, protocol)
                    completion.inc(event.completion_tokens)
                yield event
        finally:
            close = getattr(events, "aclose", None)
            if close is not None:
                await close()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    """Engine gauges and counters, read from the backend at scrape time."""

    def __init__(self, health: Callable[[], BackendHealth]) -> None:
        self._health = health

    def collect(self) -> Iterator[Metric]:
        health = self._health()
        yield GaugeMetricFamily(
            "sluice_engine_ready", "1 once the model is loaded.", value=int(health.ready)
        )
        yield GaugeMetricFamily(
            "sluice_engine_running_requests",
            "Sequences in the running batch.",
            value=health.running,
        )
        yield GaugeMetricFamily(
            "sluice_engine_waiting_requests",
            "Requests waiting to be scheduled.",
            value=health.waiting,
        )
        yield CounterMetricFamily(
            "sluice_engine_aborted_requests",
            "Requests the engine stopped early (client gone, shutdown).",
            value=health.aborted,
        )
        yield CounterMetricFamily("sluice_engine_steps", "Engine steps run.", value=health.steps)
        yield CounterMetricFamily(
            "sluice_engine_generated_tokens",
            "Tokens the engine sampled.",
            value=health.generated_tokens,
        )
