"""Prometheus metrics of one app, in its own registry (never the process-global one).

Server-side counters and histograms are updated by the handlers; engine figures are
read on the engine thread at scrape time (`read_engine_snapshot`) and exported by a
collector as they were at that moment."""

from __future__ import annotations

from collections import Counter as Counter_
from dataclasses import dataclass, fields
from typing import Any, Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


@dataclass(frozen=True)
class EngineSnapshot:
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_queries: int
    prefix_hits: int
    prefix_cached_blocks: int
    prefix_evictions: int
    preemptions: int
    steps: int
    preemptions_by: tuple[tuple[int, str, int], ...] = ()   # (priority, mode, count)

    GAUGES = ("running", "waiting", "kv_blocks_used", "kv_blocks_total", "prefix_cached_blocks")

    @classmethod
    def zero(cls) -> "EngineSnapshot":
        return cls(**{f.name: 0 for f in fields(cls) if f.type == "int"})

    def counters_only(self) -> "EngineSnapshot":
        """These figures with the gauges at 0: what an unloaded engine still adds to the
        server's counters, so that they never go back (section 17 of docs/design.md)."""
        from dataclasses import replace

        return replace(self, **{name: 0 for name in self.GAUGES})

    @classmethod
    def total(cls, snapshots: Sequence["EngineSnapshot"]) -> "EngineSnapshot":
        """Several engines' figures as one (replicas behind one server): each count summed."""
        counts = {f.name: sum(getattr(s, f.name) for s in snapshots) for f in fields(cls) if f.type == "int"}
        by: Counter_[tuple[int, str]] = Counter_()
        for snapshot in snapshots:
            for priority, mode, count in snapshot.preemptions_by:
                by[(priority, mode)] += count
        return cls(**counts, preemptions_by=tuple((p, m, n) for (p, m), n in sorted(by.items())))


def read_engine_snapshot(engine: Any) -> EngineSnapshot:
    """Run on the engine thread (`EngineLoop.call`)."""
    blocks = engine.block_manager
    return EngineSnapshot(
        running=len(engine.scheduler.running), waiting=len(engine.scheduler.waiting),
        kv_blocks_used=blocks.num_used_blocks, kv_blocks_total=blocks.num_blocks,
        prefix_queries=blocks.stats.queries, prefix_hits=blocks.stats.hits,
        prefix_cached_blocks=blocks.num_cached_blocks, prefix_evictions=blocks.stats.evictions,
        preemptions=engine.stats.preemptions, steps=engine.stats.steps,
        preemptions_by=tuple((p, m, n) for (p, m), n in sorted(engine.scheduler.preemptions.items())))


class EngineCollector(Collector):
    def __init__(self) -> None:
        self.snapshot: EngineSnapshot | None = None

    def describe(self) -> list[Metric]:
        return []   # values appear only once an engine is attached

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot
        if s is None:
            return
        yield _gauge("ruvllm_num_requests_running", "Sequences in the running batch.", s.running)
        yield _gauge("ruvllm_num_requests_waiting", "Sequences waiting for a batch slot.", s.waiting)
        yield _gauge("ruvllm_kv_cache_blocks_used", "KV-cache blocks in use.", s.kv_blocks_used)
        yield _gauge("ruvllm_kv_cache_blocks_total", "KV-cache blocks in the pool.", s.kv_blocks_total)
        yield _gauge("ruvllm_kv_cache_usage_ratio", "Share of KV-cache blocks in use.",
                     s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0)
        yield _counter("ruvllm_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                       s.prefix_queries)
        yield _counter("ruvllm_prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_hits)
        yield _gauge("ruvllm_prefix_cache_hit_rate", "Prefix-cache hits / queries, in tokens.",
                     s.prefix_hits / s.prefix_queries if s.prefix_queries else 0.0)
        yield _gauge("ruvllm_prefix_cache_blocks", "KV blocks that hold a reusable prefix.",
                     s.prefix_cached_blocks)
        yield _counter("ruvllm_prefix_cache_evictions", "Cached prefix blocks reused for new content.",
                       s.prefix_evictions)
        yield _counter("ruvllm_num_preemptions", "Sequences preempted for want of KV blocks.", s.preemptions)
        yield _counter("ruvllm_engine_steps", "Engine steps (forward passes).", s.steps)
        by = CounterMetricFamily("ruvllm_preemptions", "Preemptions by the preempted request's priority (those "
                                 "beyond +-100 counted at +-100) and by mode (recompute, or swap to the swap "
                                 "pool).", labels=["priority", "mode"])
        for priority, mode, count in s.preemptions_by:
            by.add_metric([str(priority), mode], count)
        yield by


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


class ServerMetrics:
    """Every metric of one server."""

    def __init__(self, requests_in_flight: Callable[[], float], sequences_in_flight: Callable[[], float]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("ruvllm_http_requests", "HTTP requests by endpoint and status.",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("ruvllm_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("ruvllm_generation_tokens", "Tokens generated.", registry=r)
        self.ttft = Histogram("ruvllm_time_to_first_token_seconds", "Request arrival to first token, per sequence.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.queue_time = Histogram("ruvllm_request_queue_time_seconds",
                                    "Reaching the engine to its first scheduled step, per sequence.",
                                    buckets=TTFT_BUCKETS, registry=r)
        self.e2e_latency = Histogram("ruvllm_e2e_request_latency_seconds", "Request arrival to last byte.",
                                     buckets=LATENCY_BUCKETS, registry=r)
        self.in_flight = Gauge("ruvllm_http_requests_in_flight", "Generation requests admitted, not finished.",
                               registry=r)
        self.in_flight.set_function(requests_in_flight)
        self.sequences_in_flight = Gauge("ruvllm_sequences_in_flight",
                                         "Sequences of the admitted requests (n per prompt), not finished.", registry=r)
        self.sequences_in_flight.set_function(sequences_in_flight)
        self.engine = EngineCollector()
        r.register(self.engine)

    def render(self, snapshot: EngineSnapshot | None) -> bytes:
        self.engine.snapshot = snapshot
        return generate_latest(self.registry)
