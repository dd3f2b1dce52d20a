"""The model pool's figures in /metrics, labelled by model (its first name)."""

from __future__ import annotations

from typing import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ruvllm_cli.server.models import ModelPool, ModelStatus


class PoolCollector(Collector):
    """Read at scrape time on the event loop, which owns the pool."""

    def __init__(self, pool: ModelPool) -> None:
        self.pool = pool

    def describe(self) -> list[Metric]:
        return []   # the models are known only once the app has them

    def collect(self) -> Iterator[Metric]:
        loaded = GaugeMetricFamily("ruvllm_model_loaded", "1 while the model is loaded, else 0.", labels=["model"])
        counts = {key: CounterMetricFamily(f"ruvllm_model_{key}", doc, labels=["model"]) for key, doc in (
            ("loads", "Times the model was loaded on demand."),
            ("unloads", "Times the model was unloaded (idle for --keep-alive, or to make room)."),
            ("load_failures", "Loads of the model that failed."))}
        for entry in self.pool.entries:
            loaded.add_metric([entry.name], float(entry.status is ModelStatus.LOADED))
            for key, family in counts.items():
                family.add_metric([entry.name], entry.counts[key])
        yield loaded
        yield from counts.values()
