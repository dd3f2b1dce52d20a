"""The report as JSON, CSV, or rich tables (latency, throughput, memory, system)."""

from __future__ import annotations

import csv
import io
import json
from typing import Any, Mapping, Sequence

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ruvllm_cli.bench.report import flatten
from ruvllm_cli.quantization import Quantization

NA = "n/a"
MIB = 1024**2


def to_json(report: Mapping[str, Any]) -> str:
    return json.dumps(report, indent=2) + "\n"


def to_csv(report: Mapping[str, Any]) -> str:
    """One header row and one data row: the flattened names and their values."""
    flat = flatten(report)
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(flat.keys())
    writer.writerow([_cell(value) for value in flat.values()])
    return buffer.getvalue()


def _cell(value: Any) -> Any:
    """A CSV cell: empty for null, compact JSON for a list (`lora.adapters`, `config.lora`)."""
    if value is None:
        return ""
    return json.dumps(value, separators=(",", ":")) if isinstance(value, (list, dict)) else value


def number(value: float | int | None, digits: int = 1, unit: str = "") -> str:
    """`12.3 ms`-style text, or n/a for a value that was not measured."""
    if value is None:
        return NA
    text = f"{value:,.{digits}f}" if isinstance(value, float) else f"{value:,}"
    return f"{text} {unit}".rstrip()


# ---- tables -----------------------------------------------------------------------------
def decimal_bytes(count: int) -> str:
    """Bytes in decimal units, like the GB/s beside them."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= size:
            return f"{count / size:.2f} {unit}"
    return f"{count} B"


def _table(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]], numeric: bool = True) -> Table:
    table = Table(title=title, title_justify="left", header_style="bold")
    for index, column in enumerate(columns):
        table.add_column(column, justify="right" if index and numeric else "left", overflow="fold")
    for row in rows:
        table.add_row(*(escape(cell) for cell in row))
    return table


def latency_table(metrics: Mapping[str, Any]) -> Table:
    def row(label: str, name: str) -> list[str]:
        return [label, *(number(metrics.get(f"{name}_ms_{stat}"), 2) for stat in ("mean", "p50", "p95", "p99", "stdev"))]

    # (schema 2's reports had only a mean for prefill and a stdev for end-to-end: n/a)
    rows = [row("TTFT", "ttft"), row("Prefill", "prefill"), row("Inter-token", "itl"), row("End-to-end", "e2e")]
    return _table("Latency (ms, per request)", ["", "mean", "p50", "p95", "p99", "stdev"], rows)


def throughput_table(metrics: Mapping[str, Any], concurrency: int) -> Table:
    bandwidth = number(metrics.get("achieved_bandwidth_gb_s"), 2, "GB/s of weights read")
    output_label = f"Output ({concurrency} streams together)" if concurrency > 1 else "Output (1 stream)"
    rows = [
        ["Prefill (per request)", number(metrics.get("prefill_tokens_per_s"), 1, "tok/s"), ""],
        ["Decode (per stream)", number(metrics.get("decode_tokens_per_s"), 2, "tok/s"), bandwidth],
        [output_label, number(metrics.get("output_tokens_per_s"), 2, "tok/s"), "aggregate"],
        ["Requests", number(metrics.get("requests_per_s"), 3, "req/s"), "aggregate"],
        ["Tokens per request", f"{number(metrics.get('prompt_tokens_per_request'))} in, "
                               f"{number(metrics.get('generated_tokens_per_request'))} out", ""],
    ]
    return _table("Throughput", ["", "value", ""], rows)


def structured_table(structured: Mapping[str, Any]) -> Table:
    """--json-schema: the same workload constrained and unconstrained, one run."""
    completed = (f"{number(structured.get('constrained_completed_requests'))} of "
                 f"{number(structured.get('constrained_requests'))} completed the schema")
    rows = [
        ["Unconstrained decode (per stream)", number(structured.get("decode_tok_s_unconstrained"), 2, "tok/s")],
        ["Constrained decode (per stream)", number(structured.get("decode_tok_s_constrained"), 2, "tok/s")],
        ["Ratio (constrained ÷ unconstrained)", number(structured.get("ratio"), 3)],
        ["Tokens per constrained request", f"{number(structured.get('constrained_tokens_per_request'))} "
                                           f"({completed})"],
        ["Grammar mask per token", number(structured.get("mask_ms_per_token"), 3, "ms")],
        ["Grammar compile (once)", number(structured.get("grammar_compile_ms"), 1, "ms")],
    ]
    return _table(f"Structured output (--json-schema {structured.get('schema_file')})", ["", "value"], rows)


def lora_table(lora: Mapping[str, Any]) -> Table:
    """--lora: the same workload on the base model alone and mixed over the adapters, one run."""
    adapters = lora.get("adapters") or []
    mix = ", ".join([f"{number(lora.get('mixed_base_requests'))} base"] +
                    [f"{number(a.get('mixed_requests'))} {a.get('name')}" for a in adapters])
    rows = [
        ["Adapters", ", ".join(f"{a.get('name')} (rank {a.get('rank')})" for a in adapters)],
        ["Base decode (aggregate)", number(lora.get("aggregate_decode_tok_s_base"), 2, "tok/s")],
        ["Mixed decode (aggregate)", number(lora.get("aggregate_decode_tok_s_mixed"), 2, "tok/s")],
        ["Ratio (mixed ÷ base)", number(lora.get("ratio"), 3)],
        ["TTFT p50 base", number(lora.get("ttft_ms_p50_base"), 2, "ms")],
        ["TTFT p50 mixed", number(lora.get("ttft_ms_p50_mixed"), 2, "ms")],
        ["Mixed requests", f"{number(lora.get('mixed_requests'))} ({mix})"],
        ["Adapter slot loads", f"{number(lora.get('slot_loads_warmup'))} in warm-up, "
                               f"{number(lora.get('slot_loads_measured'))} measured"],
    ]
    return _table("LoRA adapters (--lora: base model alone vs mixed over the adapters)", ["", "value"], rows)


def memory_table(metrics: Mapping[str, Any]) -> Table:
    weights = metrics.get("weight_bytes")
    rows = [
        ["Peak RSS (process high-water mark)", number(metrics.get("peak_rss_mb"), 1, "MiB")],
        ["CUDA max allocated", number(metrics.get("cuda_max_allocated_mb"), 1, "MiB")],
        ["Weights", number(weights / MIB if weights is not None else None, 1, "MiB")],
        ["Model load time", number(metrics.get("load_time_s"), 2, "s")],
        ["Preemptions (KV cache full)", number(metrics.get("preemptions"))],
    ]
    return _table("Memory and load", ["", "value"], rows)


def system_table(report: Mapping[str, Any]) -> Table:
    system, model = report["system"], report["model"]
    cores = (f"{number(system.get('cpu_cores_physical'))} physical, "
             f"{number(system.get('cpu_cores_logical'))} logical")
    commit = system.get("git_commit")
    rows = [
        ["Model", f"{model.get('name')} ({model.get('architecture') or NA})"],
        ["Device", f"{system.get('device')}: {system.get('device_name') or NA}"],
        ["Weights / compute", precision(report)],
        ["CPU", system.get("cpu_model") or NA],
        ["Cores", cores],
        ["torch threads", number(system.get("torch_threads"))],
        ["RAM", number(system.get("ram_total_gb"), 1, "GiB")],
        ["OS", system.get("os") or NA],
        ["Python / torch / transformers", f"{system.get('python_version')} / {system.get('torch_version')} / "
                                          f"{system.get('transformers_version') or NA}"],
        ["ruvllm", f"{system.get('ruvllm_version')} ({commit[:12] + commit[40:] if commit else 'commit n/a'})"],
    ]
    return _table("System", ["", "value"], rows, numeric=False)


def verdict(metrics: Mapping[str, Any], given_gb_s: float | None = None) -> str:
    """Decode speed against the memory-bandwidth bound, from measured figures only."""
    decode = metrics.get("decode_tokens_per_s")
    achieved = metrics.get("achieved_bandwidth_gb_s")
    weights = metrics.get("decode_weight_bytes", metrics.get("weight_bytes"))
    if decode is None or achieved is None or weights is None:
        return "Verdict: decode speed not measured (a generation of one token has no decode phase)."
    line = (f"Verdict: decode {decode:.2f} tok/s per stream × {decimal_bytes(weights)} of weights = "
            f"{achieved:.2f} GB/s read")
    utilization = metrics.get("bandwidth_utilization_pct")
    if utilization is None or not given_gb_s:
        return line + ("; pass --memory-bandwidth GBPS (your machine's memory bandwidth) to see how close "
                       "that is to the limit.")
    return line + f", {utilization:.3g}% of the {given_gb_s:g} GB/s given with --memory-bandwidth."


def precision(report: Mapping[str, Any]) -> str:
    """The weights and the compute, as the load line says them ("f16: 16-bit weights,
    float32 compute"); it had printed "float32 (F16)"."""
    config, system = report["config"], report["system"]
    try:
        return Quantization(config.get("quantization")).precision(str(system.get("dtype")))
    except ValueError:   # not a quantization of ours: as the report has it
        return f"{system.get('dtype')} / {system.get('quantization')}"


def headline(report: Mapping[str, Any]) -> str:
    config, system = report["config"], report["system"]
    return (f"ruvllm benchmark · {report['model']['name']} · {system['device']} · {precision(report)} "
            f"· prompt {config['prompt_length']} + {config['gen_length']} tokens · "
            f"concurrency {config['concurrency']} · {config['iterations']} iterations "
            f"({config['warmup']} warm-up)")


def print_tables(report: Mapping[str, Any], console: Console) -> None:
    metrics = report["metrics"]
    console.print(f"[bold]{escape(headline(report))}[/bold]")
    console.print(latency_table(metrics))
    console.print(throughput_table(metrics, report["config"]["concurrency"]))
    if "structured" in report:
        console.print(structured_table(report["structured"]))
    if "lora" in report:
        console.print(lora_table(report["lora"]))
    console.print(memory_table(metrics))
    console.print(system_table(report))
    console.print(escape(verdict(metrics, report["config"].get("memory_bandwidth_gb_s"))))


def to_text(report: Mapping[str, Any]) -> str:
    """The tables as plain text (for --output with --format table)."""
    buffer = io.StringIO()
    print_tables(report, Console(file=buffer, no_color=True, highlight=False, width=110, soft_wrap=True))
    return buffer.getvalue()
