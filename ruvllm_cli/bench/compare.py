"""`--compare OLD.json`: each metric beside a previous run's, and a regression gate.

The gate (exit 1) watches two figures: decode tok/s (a drop of more than the
threshold percent) and median TTFT, `ttft_ms_p50` (a rise of more than it); the
median rather than the mean so that one slow outlier does not fail a CI job. A move
within the runs' noise (from their per-iteration spread, bench/noise.py) is not a
regression, whatever the threshold: it is shown, and warned about.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ruvllm_cli.bench.formatters import number
from ruvllm_cli.bench.noise import gate_noise_pct
from ruvllm_cli.errors import RuvllmError, UsageError

GATED_HIGHER = ("decode_tokens_per_s",)
GATED_LOWER = ("ttft_ms_p50",)
# Settings that make two runs incomparable when they differ.
COMPARABLE = (("model", "name"), ("config", "prompt_length"), ("config", "gen_length"),
              ("config", "concurrency"), ("config", "kernels"), ("system", "device"), ("system", "quantization"),
              ("system", "dtype"), ("system", "torch_threads"))


@dataclass(frozen=True)
class MetricChange:
    name: str
    old: float | None
    new: float | None
    change_pct: float | None
    direction: int          # +1 higher is better, -1 lower is better, 0 neither
    regression: bool        # a gated metric that moved the wrong way beyond the threshold and the noise
    noise_pct: float | None = None   # how far noise alone may move it the wrong way (gated metrics)
    within_noise: bool = False       # beyond the threshold the wrong way, but not beyond the noise


@dataclass(frozen=True)
class Comparison:
    changes: tuple[MetricChange, ...]
    differences: tuple[str, ...]    # settings that differ between the runs
    threshold_pct: float
    busy_runs: tuple[str, ...] = ()  # "the previous run" / "this run", where other processes used the CPU

    @property
    def regressions(self) -> tuple[MetricChange, ...]:
        return tuple(change for change in self.changes if change.regression)

    @property
    def within_noise(self) -> tuple[MetricChange, ...]:
        return tuple(change for change in self.changes if change.within_noise)


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
    check_report(report, path)
    return report


def check_report(report: dict[str, Any], path: str | Path) -> None:
    """Refused before the run, not found wrong after it: a report of another schema
    version, a section that is not an object (a raw AttributeError had come after the
    whole run, with the exit status of a regression), or a gated figure that is not a
    number (the gate had been skipped with nothing said: an empty report passed)."""
    from ruvllm_cli.bench.report import SCHEMA_VERSION

    hint = "pass a file written by `ruvllm benchmark --format json` (this version)"
    version = report.get("schema_version")   # earlier versions' metrics are this one's
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= SCHEMA_VERSION:
        raise UsageError(f"--compare: {path} is a report of schema version {version!r}; this ruvllm reads "
                         f"1 to {SCHEMA_VERSION}", hint)
    for section in {section for section, _ in COMPARABLE} | {"noise"}:
        if section in report and not isinstance(report[section], dict):   # null too: never written
            raise UsageError(f"--compare: {path}: `{section}` is not an object", hint)
    for name in (*GATED_HIGHER, *GATED_LOWER):
        value = report["metrics"].get(name)
        if value is not None and _numeric(value) is None:
            raise UsageError(f"--compare: {path}: metrics.{name} is {value!r}, not a number", hint)
    if all(report["metrics"].get(name) is None for name in (*GATED_HIGHER, *GATED_LOWER)):
        raise UsageError(f"--compare: {path} has none of the figures the gate compares "
                         f"({', '.join(GATED_HIGHER + GATED_LOWER)})", hint)


def _numeric(value: Any) -> float | int | None:
    """A figure to compare: a finite number (NaN, which Python's JSON reads, compares
    false with everything, and a NaN baseline had passed every gate)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return value


def _differences(old: Mapping[str, Any], new: Mapping[str, Any]) -> tuple[str, ...]:
    found = []
    for section, key in COMPARABLE:
        before, after = (old.get(section) or {}).get(key), (new.get(section) or {}).get(key)
        if before != after:
            found.append(f"{section}.{key}: {before} -> {after}")
    return tuple(found)


def compare_reports(old: Mapping[str, Any], new: Mapping[str, Any], threshold_pct: float) -> Comparison:
    """Every numeric metric of `new` beside the same one in `old`; a gated one that
    moved beyond the threshold regressed only if it also moved beyond the noise."""
    changes = []
    old_noise, new_noise = old.get("noise"), new.get("noise")
    for name, value in new["metrics"].items():
        before, after = _numeric(old["metrics"].get(name)), _numeric(value)
        if after is None and before is None:
            continue
        change = change_pct(before, after)
        noise = gate_noise_pct(old_noise, new_noise, name)
        beyond_threshold = is_regression(name, change, threshold_pct)
        beyond_noise = change is not None and (noise is None or abs(change) > noise)
        changes.append(MetricChange(name, before, after, change, direction(name), beyond_threshold and beyond_noise,
                                    noise, beyond_threshold and not beyond_noise))
    busy = tuple(label for label, noise in (("the previous run", old_noise), ("this run", new_noise))
                 if isinstance(noise, Mapping) and noise.get("busy"))
    return Comparison(tuple(changes), _differences(old, new), threshold_pct, busy)


def _change_cell(change: MetricChange) -> str:
    if change.change_pct is None:
        return "n/a"
    text = f"{change.change_pct:+.1f}%"
    better = change.direction * change.change_pct
    if change.regression:
        return f"[bold red]{text} regression[/bold red]"
    if change.within_noise:
        return f"[yellow]{text} within noise[/yellow]"
    if change.direction == 0 or abs(change.change_pct) < 0.05:
        return text
    return f"[green]{text}[/green]" if better > 0 else f"[yellow]{text}[/yellow]"


def print_comparison(comparison: Comparison, console: Console, previous_name: str) -> None:
    """The table (the report's own output); its warnings are the caller's, on stderr."""
    table = Table(title=f"Compared with {escape(previous_name)} (gate: ±{comparison.threshold_pct:g}% on "
                        "decode_tokens_per_s and ttft_ms_p50)", title_justify="left", header_style="bold")
    for column, justify in (("metric", "left"), ("previous", "right"), ("now", "right"), ("change", "right"),
                            ("noise", "right")):
        table.add_column(column, justify=justify, overflow="fold")  # type: ignore[arg-type]
    for change in comparison.changes:
        noise = _noise_cell(change)
        table.add_row(change.name, number(change.old, 2), number(change.new, 2), _change_cell(change), noise)
    console.print(table)


def _noise_cell(change: MetricChange) -> str:
    """The noise bound, signed the way the metric gets worse."""
    if change.noise_pct is None:
        return ""
    return f"{'-' if change.direction > 0 else '+'}{change.noise_pct:.0f}%"


def comparison_warnings(comparison: Comparison) -> list[str]:
    """What makes the comparison less than it seems: other settings, noise, a busy CPU."""
    lines = []
    if comparison.differences:
        lines.append("the runs differ in " + "; ".join(comparison.differences))
    for c in comparison.within_noise:
        lines.append(f"{c.name} moved {c.change_pct:+.1f}%, beyond the {comparison.threshold_pct:g}% threshold "
                     f"but within the runs' noise ({_noise_cell(c)}): not counted as a regression; "
                     "compare runs on a quiet machine")
    if comparison.busy_runs:
        lines.append(f"other processes used the CPU during {' and '.join(comparison.busy_runs)}: figures "
                     "from a busy machine are likely low")
    return lines


def raise_on_regression(comparison: Comparison) -> None:
    """Exit 1 (a RuvllmError) when a gated metric regressed beyond the threshold."""
    regressions = comparison.regressions
    if not regressions:
        return
    parts = [f"{c.name} {number(c.old, 2)} -> {number(c.new, 2)} ({c.change_pct:+.1f}%)" for c in regressions]
    raise RuvllmError(f"performance regression beyond {comparison.threshold_pct:g}%: " + "; ".join(parts),
                      "compare on the same machine, or raise --threshold if this change is expected")
