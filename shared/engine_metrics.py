"""An engine's load under vLLM's metric names, for whichever process reports it.

The embedded API, a worker's own ``/metrics`` port and the API's fleet view
(the sum of a model's workers) all expose the same four series with vLLM's
names and ``model_name`` label, so a dashboard or autoscaling rule written for
vLLM reads them. A worker's series are its engine's (sum them over workers);
the fleet view is the same on every API replica (take the ``max``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """One model's engine load: its engine's, or the sum of its workers' engines.

    An engine's host reads it with ``engine.engine_host.read_load``. The fleet
    view (``api.backends.fleet.fleet_load``) fills the first five and leaves
    the counts of steps, tokens and aborts at 0: no series here exposes them.
    """

    running: int = 0  # sequences in the running batch
    waiting: int = 0  # admitted but not yet scheduled (distributed: queued ones included)
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    preemptions: int = 0  # since start
    steps: int = 0  # since start, as every count below
    generated_tokens: int = 0
    aborted: int = 0  # requests the engine stopped early


def engine_families(model: str, load: EngineLoad) -> list[Metric]:
    """vLLM's engine series for one model's engine, or the sum of its workers' engines."""
    running = GaugeMetricFamily(
        "vllm:num_requests_running", "Requests in the running batch.", labels=["model_name"]
    )
    running.add_metric([model], load.running)
    waiting = GaugeMetricFamily(
        "vllm:num_requests_waiting",
        "Requests waiting to be scheduled (distributed: every outstanding request not running).",
        labels=["model_name"],
    )
    waiting.add_metric([model], load.waiting)
    usage = GaugeMetricFamily(
        "vllm:kv_cache_usage_perc", "KV cache blocks in use (1 = full).", labels=["model_name"]
    )
    usage.add_metric(
        [model], load.kv_blocks_used / load.kv_blocks_total if load.kv_blocks_total else 0.0
    )
    preemptions = CounterMetricFamily(
        "vllm:num_preemptions", "Requests preempted for KV blocks.", labels=["model_name"]
    )
    preemptions.add_metric([model], load.preemptions)
    return [running, waiting, usage, preemptions]


class EngineLoadCollector(Collector):
    """``engine_families`` of one model, read from ``load`` at scrape time."""

    def __init__(self, model: str, load: Callable[[], EngineLoad]) -> None:
        self._model = model
        self._load = load

    def collect(self) -> Iterator[Metric]:
        yield from engine_families(self._model, self._load())
