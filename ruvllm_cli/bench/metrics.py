"""Benchmark metrics as pure functions over the engine's `time.perf_counter` stamps.

Definitions (all per request unless named aggregate; docs/benchmark.md repeats them):
- TTFT: first token - arrival (the request entered the engine).
- prefill time: first token - scheduled (the start of the first engine step that
  ran any of the request's prompt); it covers the prompt's forward pass(es) and the
  sampling of the first token. Prefill tok/s: computed prompt tokens / prefill time.
- decode time: last token - first token; decode tok/s: (generated - 1) / decode time.
- inter-token latency (ITL): the gaps between consecutive token stamps.
- end-to-end latency: finished - arrival.
- aggregate output tok/s and requests/s: over the wall time of each iteration
  (first arrival to last finish), summed over iterations.
- aggregate decode tok/s: decode tokens of every request over each iteration's
  decode span (its first first token to its last token), summed over iterations.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Sequence


@dataclass(frozen=True)
class RequestSample:
    """One measured request: its token counts and timestamps (seconds, perf_counter)."""

    prompt_tokens: int
    cached_tokens: int
    arrival: float
    scheduled: float
    first_token: float
    finished: float
    token_times: tuple[float, ...]
    finish_reason: str

    @property
    def generated_tokens(self) -> int:
        return len(self.token_times)


@dataclass(frozen=True)
class IterationSample:
    """One iteration: the requests submitted together and how long they took in all."""

    index: int
    requests: tuple[RequestSample, ...] = field(default_factory=tuple)

    @property
    def start(self) -> float:
        return min(r.arrival for r in self.requests)

    @property
    def end(self) -> float:
        return max(r.finished for r in self.requests)

    @property
    def wall_s(self) -> float:
        return self.end - self.start

    @property
    def decode_span_s(self) -> float:
        """From the first request's first token to the last token of any: every decode
        token of the iteration falls inside it."""
        return max(r.token_times[-1] for r in self.requests) - min(r.token_times[0] for r in self.requests)


# ---- statistics ---------------------------------------------------------------------
def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between closest ranks
    (numpy's default method); None for no values."""
    if not values:
        return None
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def stdev(values: Sequence[float]) -> float | None:
    """Sample standard deviation (n - 1); None with fewer than two values."""
    return statistics.stdev(values) if len(values) >= 2 else None


def ratio(numerator: float, denominator: float) -> float | None:
    """numerator / denominator, or None when the denominator is not positive."""
    return numerator / denominator if denominator > 0 else None


# ---- one request ----------------------------------------------------------------------
def ttft_s(sample: RequestSample) -> float:
    return sample.first_token - sample.arrival


def prefill_s(sample: RequestSample) -> float:
    return sample.first_token - sample.scheduled


def decode_s(sample: RequestSample) -> float:
    return sample.token_times[-1] - sample.token_times[0]


def e2e_s(sample: RequestSample) -> float:
    return sample.finished - sample.arrival


def inter_token_s(token_times: Sequence[float]) -> list[float]:
    """Gaps between consecutive token stamps (one fewer than the stamps)."""
    return [later - earlier for earlier, later in zip(token_times, token_times[1:])]


def decode_tokens_per_s(token_times: Sequence[float]) -> float | None:
    """(tokens - 1) / (last - first stamp): the first token belongs to prefill."""
    if len(token_times) < 2:
        return None
    return ratio(len(token_times) - 1, token_times[-1] - token_times[0])


def prefill_tokens(sample: RequestSample) -> int:
    """Prompt tokens the model computed (prefix-cache hits are not computed)."""
    return sample.prompt_tokens - sample.cached_tokens


# ---- summaries --------------------------------------------------------------------------
def _ms(values: Sequence[float]) -> list[float]:
    return [v * 1000.0 for v in values]


def distribution_ms(name: str, seconds: Sequence[float], with_stdev: bool = False) -> dict[str, float | None]:
    """`{name}_ms_mean/p50/p95/p99` (and `_stdev`) of values given in seconds."""
    values = _ms(seconds)
    summary = {f"{name}_ms_mean": mean(values)}
    for q in (50, 95, 99):
        summary[f"{name}_ms_p{q}"] = percentile(values, q)
    if with_stdev:
        summary[f"{name}_ms_stdev"] = stdev(values)
    return summary


def _single_value(values: Sequence[int]) -> int | None:
    """The common value when every request agrees, else None (they must agree)."""
    return values[0] if values and all(v == values[0] for v in values) else None


def summarize(iterations: Sequence[IterationSample]) -> dict[str, float | int | None]:
    """Latency and throughput metrics over every request of the measured iterations."""
    requests = [r for it in iterations for r in it.requests]
    gaps = [gap for r in requests for gap in inter_token_s(r.token_times)]
    decode_tokens = sum(max(r.generated_tokens - 1, 0) for r in requests)
    total_wall = sum(it.wall_s for it in iterations)
    metrics: dict[str, float | int | None] = {}
    metrics.update(distribution_ms("ttft", [ttft_s(r) for r in requests], with_stdev=True))
    metrics.update(distribution_ms("prefill", [prefill_s(r) for r in requests], with_stdev=True))
    metrics["prefill_tokens_per_s"] = ratio(sum(prefill_tokens(r) for r in requests),
                                            sum(prefill_s(r) for r in requests))
    # Summed decode tokens over summed decode time: the per-stream speed, equal to
    # 1 / mean inter-token latency.
    metrics["decode_tokens_per_s"] = ratio(decode_tokens, sum(decode_s(r) for r in requests))
    metrics.update(distribution_ms("itl", gaps, with_stdev=True))
    metrics.update(distribution_ms("e2e", [e2e_s(r) for r in requests], with_stdev=True))
    metrics["output_tokens_per_s"] = ratio(sum(r.generated_tokens for r in requests), total_wall)
    metrics["requests_per_s"] = ratio(len(requests), total_wall)
    metrics["generated_tokens_per_request"] = _single_value([r.generated_tokens for r in requests])
    metrics["prompt_tokens_per_request"] = _single_value([r.prompt_tokens for r in requests])
    metrics["cached_prompt_tokens"] = sum(r.cached_tokens for r in requests)
    metrics["measured_requests"] = len(requests)
    return metrics


def aggregate_decode_tokens_per_s(iterations: Sequence[IterationSample]) -> float | None:
    """The streams' decode tokens together per second of decode span: with one stream,
    its decode tok/s; with N decoding side by side, about N times that."""
    tokens = sum(max(r.generated_tokens - 1, 0) for it in iterations for r in it.requests)
    return ratio(tokens, sum(it.decode_span_s for it in iterations)) if iterations else None


def spread(name: str, values: Sequence[float | None]) -> dict[str, float | None]:
    """`{name}_min/_max/_stdev/_cv_pct` over per-iteration values (the coefficient of
    variation: stdev / mean in percent; stdev and cv need two values)."""
    known = [v for v in values if v is not None]
    deviation, average = stdev(known), mean(known)
    cv = 100.0 * deviation / average if deviation is not None and average else None
    return {f"{name}_min": min(known, default=None), f"{name}_max": max(known, default=None),
            f"{name}_stdev": deviation, f"{name}_cv_pct": cv}


def achieved_bandwidth_gb_s(weight_bytes: int, decode_tok_s: float | None) -> float | None:
    """Weight bytes read per second, in GB/s (10^9 bytes), from the bytes a decode step
    reads of the weights (`decode_weight_bytes`).

    Each decode step reads those once and yields one token per running stream, so the
    per-stream decode rate is the step rate at any concurrency. KV-cache and
    activation traffic are not counted: this is a lower bound."""
    if decode_tok_s is None:
        return None
    return weight_bytes * decode_tok_s / 1e9


def bandwidth_utilization_pct(achieved_gb_s: float | None, peak_gb_s: float | None) -> float | None:
    """Achieved bandwidth as a percentage of the figure the user gave, else None."""
    if achieved_gb_s is None or not peak_gb_s:
        return None
    return 100.0 * achieved_gb_s / peak_gb_s


def sample_record(sample: RequestSample) -> dict[str, float | int | str | None]:
    """One request's raw values for the JSON `samples`."""
    return {
        "prompt_tokens": sample.prompt_tokens,
        "cached_prompt_tokens": sample.cached_tokens,
        "generated_tokens": sample.generated_tokens,
        "finish_reason": sample.finish_reason,
        "ttft_ms": ttft_s(sample) * 1000.0,
        "prefill_ms": prefill_s(sample) * 1000.0,
        "decode_ms": decode_s(sample) * 1000.0,
        "e2e_ms": e2e_s(sample) * 1000.0,
        "decode_tokens_per_s": decode_tokens_per_s(sample.token_times),
        "itl_ms": _ms(inter_token_s(sample.token_times)),
    }


def iteration_record(iteration: IterationSample) -> dict[str, object]:
    """One iteration's raw values for the JSON `samples`."""
    tokens = sum(r.generated_tokens for r in iteration.requests)
    return {
        "iteration": iteration.index,
        "wall_ms": iteration.wall_s * 1000.0,
        "output_tokens_per_s": ratio(tokens, iteration.wall_s),
        "requests": [sample_record(r) for r in iteration.requests],
    }
