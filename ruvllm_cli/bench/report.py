"""The benchmark report: one dict with `model`, `config`, `system`, `metrics`,
(`structured` for a `--json-schema` run, `lora` for a `--lora` one), `noise`, `samples`.

Field names are a contract (CI scripts read them); docs/benchmark.md lists them and
tests/bench pins them. Add fields freely, never rename one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ruvllm_cli.bench import metrics as m
from ruvllm_cli.bench.metrics import IterationSample
from ruvllm_cli.bench.runner import BenchRun
from ruvllm_cli.engine.request import FinishReason

SCHEMA_VERSION = 4   # 2: config.kernels and config.weight_cache; 3: every latency's stdev, prefill's percentiles;
#                      4: config.threads, metrics.decode_weight_bytes (the bandwidth's bytes)
SECTIONS = ("model", "config", "system", "metrics")


@dataclass(frozen=True)
class Measurements:
    """Figures measured outside the runner: load time, memory, weight size."""

    load_time_s: float
    weight_bytes: int
    decode_weight_bytes: int   # what a decode step reads of them (loader.decode_weight_bytes)
    peak_rss_mb: float | None
    cuda_max_allocated_mb: float | None
    grammar_compile_s: float | None = None   # --json-schema: its first compile, before the run


def model_section(located: Any, model_config: Any, argument: str) -> dict[str, Any]:
    # a GGUF file's config has no `architectures`: its model type (general.architecture) instead
    architectures = getattr(model_config, "architectures", None) or [getattr(model_config, "model_type", None)]
    return {
        "name": located.served_name,
        "argument": argument,
        "repo_id": located.ref.repo_id,
        "revision": located.ref.revision,
        "path": str(located.path),
        "architecture": architectures[0],
    }


def metrics_section(run: BenchRun, measured: Measurements, memory_bandwidth_gb_s: float | None) -> dict[str, Any]:
    """Every metric, in the order the tables and the docs show them."""
    summary = m.summarize(run.iterations)
    achieved = m.achieved_bandwidth_gb_s(measured.decode_weight_bytes, summary["decode_tokens_per_s"])
    return {
        "load_time_s": measured.load_time_s,
        **summary,
        "preemptions": run.preemptions,
        "peak_rss_mb": measured.peak_rss_mb,
        "cuda_max_allocated_mb": measured.cuda_max_allocated_mb,
        "weight_bytes": measured.weight_bytes,
        "decode_weight_bytes": measured.decode_weight_bytes,
        "achieved_bandwidth_gb_s": achieved,
        "bandwidth_utilization_pct": m.bandwidth_utilization_pct(achieved, memory_bandwidth_gb_s),
    }


def structured_section(run: BenchRun, measured: Measurements, unconstrained_decode: float | None,
                       schema_file: str | None) -> dict[str, Any]:
    """The constrained side against the unconstrained one (`metrics`), measured in the same iterations."""
    assert run.constrained is not None
    requests = [r for iteration in run.constrained.iterations for r in iteration.requests]
    constrained_decode = m.summarize(run.constrained.iterations)["decode_tokens_per_s"]
    ratio = None
    if constrained_decode is not None and unconstrained_decode is not None:
        ratio = m.ratio(constrained_decode, unconstrained_decode)
    compile_s = measured.grammar_compile_s
    return {
        "schema_file": schema_file,
        "decode_tok_s_unconstrained": unconstrained_decode,
        "decode_tok_s_constrained": constrained_decode,
        "ratio": ratio,
        "constrained_tokens_per_request": m.mean([r.generated_tokens for r in requests]),
        "constrained_requests": len(requests),
        "constrained_completed_requests": sum(r.finish_reason == FinishReason.STOP.value for r in requests),
        "mask_ms_per_token": run.constrained.mask.ms_per_token,
        "grammar_compile_ms": compile_s * 1000.0 if compile_s is not None else None,
    }


def lora_section(run: BenchRun) -> dict[str, Any]:
    """The mixed side (requests spread over the base model and the adapters) against the
    base side (`metrics`), measured in the same iterations."""
    assert run.mixed is not None
    mixed = run.mixed
    base_decode = m.aggregate_decode_tokens_per_s(run.iterations)
    mixed_decode = m.aggregate_decode_tokens_per_s(mixed.iterations)
    ratio = None
    if base_decode is not None and mixed_decode is not None:
        ratio = m.ratio(mixed_decode, base_decode)
    return {
        "adapters": [{"name": a.name, "rank": a.rank, "mixed_requests": a.requests} for a in mixed.adapters],
        "aggregate_decode_tok_s_base": base_decode,
        "aggregate_decode_tok_s_mixed": mixed_decode,
        "ratio": ratio,
        "ttft_ms_p50_base": _ttft_p50_ms(run.iterations),
        "ttft_ms_p50_mixed": _ttft_p50_ms(mixed.iterations),
        "mixed_requests": sum(len(it.requests) for it in mixed.iterations),
        "mixed_base_requests": mixed.base_requests,
        "slot_loads_warmup": mixed.slot_loads_warmup,
        "slot_loads_measured": mixed.slot_loads_measured,
    }


def _ttft_p50_ms(iterations: tuple[IterationSample, ...]) -> float | None:
    return m.percentile([m.ttft_s(r) * 1000.0 for it in iterations for r in it.requests], 50)


def build_report(model: dict[str, Any], config: dict[str, Any], system: dict[str, Any],
                 run: BenchRun, measured: Measurements, noise: dict[str, Any] | None = None) -> dict[str, Any]:
    """Assemble the report; `config["memory_bandwidth_gb_s"]` is the user's figure, if
    any; `noise` is bench.noise.noise_section's."""
    metrics = metrics_section(run, measured, config.get("memory_bandwidth_gb_s"))
    report: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "model": model,
        "config": config,
        "system": system,
        "metrics": metrics,
    }
    if run.constrained is not None:
        report["structured"] = structured_section(run, measured, metrics["decode_tokens_per_s"],
                                                  config.get("json_schema"))
    if run.mixed is not None:
        report["lora"] = lora_section(run)
    if noise is not None:
        report["noise"] = noise
    report["samples"] = [m.iteration_record(iteration) for iteration in run.iterations]
    return report


def flatten(report: Mapping[str, Any]) -> dict[str, Any]:
    """`{"config": {"prompt_length": 128}}` -> `{"config.prompt_length": 128}`; the
    per-iteration `samples` are left out (CSV holds one row per run)."""
    flat: dict[str, Any] = {}
    for key, value in report.items():
        if key == "samples":
            continue
        if isinstance(value, Mapping):
            for inner, item in value.items():
                flat[f"{key}.{inner}"] = item
        else:
            flat[key] = value
    return flat
