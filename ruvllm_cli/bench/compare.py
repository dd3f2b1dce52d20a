"""`--compare OLD.json`: each metric beside a previous run's, and a regression gate.

The gate (exit 1) watches two figures: decode tok/s (a drop of more than the
threshold percent) and median TTFT, `ttft_ms_p50` (a rise of more than it); the
median rather than the mean so that one slow outlier does not fail a CI job.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ruvllm_cli.bench.formatters import number
from ruvllm_cli.errors import RuvllmError, UsageError

GATED_HIGHER = ("decode_tokens_per_s",)
GATED_LOWER = ("ttft_ms_p50",)
# Settings that make two runs incomparable when they differ.
COMPARABLE = (("model", "name"), ("config", "prompt_length"), ("config", "gen_length"),
              ("config", "concurrency"), ("system", "device"), ("system", "quantization"))


@dataclass(frozen=True)
class MetricChange:
    name: str
    old: float | None
    new: float | None
    change_pct: float | None
    direction: int          # +1 higher is better, -1 lower is better, 0 neither
    regression: bool        # a gated metric that moved the wrong way beyond the threshold


@dataclass(frozen=True)
class Comparison:
    changes: tuple[MetricChange, ...]
    differences: tuple[str, ...]    # settings that differ between the runs
    threshold_pct: float

    @property
    def regressions(self) -> tuple[MetricChange, ...]:
        return tuple(change for change in self.changes if change.regression)


def direction(name: str) -> int:
    """+1 when a larger value is better, -1 when smaller is, 0 for plain counts."""
    if name.endswith(("_per_s", "_gb_s", "_pct")):
        return 1
    if "_ms_" in name or name.endswith(("_s", "_mb")) or name == "preemptions":
        return -1
    return 0


def change_pct(old: float | None, new: float | None) -> float | None:
    """(new - old) / old in percent; None when either is missing or old is zero."""
    if old is None or new is None or old == 0:
        return None
    return (new - old) / abs(old) * 100.0


def is_regression(name: str, change: float | None, threshold_pct: float) -> bool:
    if change is None:
        return False
    if name in GATED_HIGHER:
        return change < -threshold_pct
    if name in GATED_LOWER:
        return change > threshold_pct
    return False


def load_previous(path: str | Path) -> dict[str, Any]:
    """A report written by `ruvllm benchmark --format json`."""
    try:
        report = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UsageError(f"--compare: cannot read {path}: {error}",
                         "pass a file written by `ruvllm benchmark --format json`") from None
    if not isinstance(report, dict) or not isinstance(report.get("metrics"), dict):
        raise UsageError(f"--compare: {path} is not a benchmark report (no `metrics` object)",
                         "pass a file written by `ruvllm benchmark --format json`")
    return report


def _numeric(value: Any) -> float | int | None:
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _differences(old: Mapping[str, Any], new: Mapping[str, Any]) -> tuple[str, ...]:
    found = []
    for section, key in COMPARABLE:
        before, after = old.get(section, {}).get(key), new.get(section, {}).get(key)
        if before != after:
            found.append(f"{section}.{key}: {before} -> {after}")
    return tuple(found)


def compare_reports(old: Mapping[str, Any], new: Mapping[str, Any], threshold_pct: float) -> Comparison:
    """Every numeric metric of `new` beside the same one in `old`."""
    changes = []
    for name, value in new["metrics"].items():
        before, after = _numeric(old["metrics"].get(name)), _numeric(value)
        if after is None and before is None:
            continue
        change = change_pct(before, after)
        changes.append(MetricChange(name, before, after, change, direction(name),
                                    is_regression(name, change, threshold_pct)))
    return Comparison(tuple(changes), _differences(old, new), threshold_pct)


def _change_cell(change: MetricChange) -> str:
    if change.change_pct is None:
        return "n/a"
    text = f"{change.change_pct:+.1f}%"
    better = change.direction * change.change_pct
    if change.regression:
        return f"[bold red]{text} regression[/bold red]"
    if change.direction == 0 or abs(change.change_pct) < 0.05:
        return text
    return f"[green]{text}[/green]" if better > 0 else f"[yellow]{text}[/yellow]"


def print_comparison(comparison: Comparison, console: Console, previous_name: str) -> None:
    table = Table(title=f"Compared with {escape(previous_name)} (gate: ±{comparison.threshold_pct:g}% on "
                        "decode_tokens_per_s and ttft_ms_p50)", title_justify="left", header_style="bold")
    for column, justify in (("metric", "left"), ("previous", "right"), ("now", "right"), ("change", "right")):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    for change in comparison.changes:
        table.add_row(change.name, number(change.old, 2), number(change.new, 2), _change_cell(change))
    console.print(table)
    if comparison.differences:
        console.print("[yellow]Warning:[/yellow] the runs differ in "
                      + escape("; ".join(comparison.differences)))


def raise_on_regression(comparison: Comparison) -> None:
    """Exit 1 (a RuvllmError) when a gated metric regressed beyond the threshold."""
    regressions = comparison.regressions
    if not regressions:
        return
    parts = [f"{c.name} {number(c.old, 2)} -> {number(c.new, 2)} ({c.change_pct:+.1f}%)" for c in regressions]
    raise RuvllmError(f"performance regression beyond {comparison.threshold_pct:g}%: " + "; ".join(parts),
                      "compare on the same machine, or raise --threshold if this change is expected")
