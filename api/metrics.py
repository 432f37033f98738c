"""Prometheus metrics: what the API sees per request, and what the engine reports.

The series a vLLM dashboard or autoscaling rule reads have vLLM's names and
``model_name`` label: per request (``ServingMetrics.track``, observed by the
replica that served it, so summing replicas counts each request once) and per
engine (``shared.engine_metrics``: running, waiting, KV cache usage, preemptions;
read at scrape time from the embedded engine, or from the fleet in
distributed mode, where every replica reports the same fleet and a query
takes the ``max``). What vLLM has no name for keeps a ``sluice_`` one.

Each app gets its own ``CollectorRegistry``, so several apps in one process
(tests) do not collide.
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
        self.time_to_first_token = self._histogram(
            "time_to_first_token_seconds", "From the request's arrival to its first token."
        )
        self.inter_token_latency = self._histogram(
            "inter_token_latency_seconds", "Between consecutive tokens of one request."
        )
        self.e2e_latency = self._histogram(
            "e2e_request_latency_seconds", "From the request's arrival to its last event."
        )
        self.queue_time = self._histogram(
            "request_queue_time_seconds",
            "From the request's arrival to the end of the engine step that first scheduled "
            "it (preparation and, in distributed mode, the queue included).",
        )
        self.prompt_tokens = self._counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = self._counter("generation_tokens", "Tokens generated.")
        self.prefix_cache_queries = self._counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = self._counter(
            "prefix_cache_hits", "Prompt tokens served from the prefix cache."
        )
        self.request_success = Counter(
            "vllm:request_success",
            "Requests finished, by why they finished (stop, length, abort).",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.registry.register(_EngineCollector(health))

    def _histogram(self, name: str, documentation: str) -> Histogram:
        return Histogram(
            f"vllm:{name}",
            documentation,
            ["model_name"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )

    def _counter(self, name: str, documentation: str) -> Counter:
        return Counter(f"vllm:{name}", documentation, ["model_name"], registry=self.registry)

    def count_request(self, protocol: str, status: int) -> None:
        self.requests.labels(protocol, str(status)).inc()

    async def track(
        self, prepared: Prepared, events: AsyncIterator[InferenceEvent], arrived: float
    ) -> AsyncIterator[InferenceEvent]:
        """Pass ``events`` through, observing latency and token counts by protocol and model.

        Closing this iterator closes ``events`` (which cancels the request).
        """
        model = prepared.model.spec.served_name
        last_token: float | None = None
        inter_token = self.inter_token_latency.labels(model)  # looked up once, not per token
        try:
            async for event in events:
                now = time.monotonic()
                if isinstance(event, Text) and event.token_ids:
                    if last_token is None:
                        self.time_to_first_token.labels(model).observe(now - arrived)
                    else:
                        inter_token.observe(now - last_token)
                    last_token = now
                elif isinstance(event, Ready):
                    self.queue_time.labels(model).observe(now - arrived)
                    self.prompt_tokens.labels(model).inc(event.prompt_tokens)
                    self.prefix_cache_queries.labels(model).inc(event.prompt_tokens)
                    self.prefix_cache_hits.labels(model).inc(event.cached_tokens)
                elif isinstance(event, Finish):
                    self.generation_tokens.labels(model).inc(event.completion_tokens)
                    self.request_success.labels(model, str(event.reason)).inc()
                    self.e2e_latency.labels(model).observe(now - arrived)
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
