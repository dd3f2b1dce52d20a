"""How noisy a benchmark run was: each headline figure's spread over the measured
iterations, and whether other processes competed for the CPU meanwhile.

Two identical runs on a busy machine gave 23 and 119 decode tok/s: a figure is only
worth comparing with its spread beside it. The spread is over iterations (each
iteration's own figure), not over requests, so it shows the machine's drift.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Any, Sequence

from ruvllm_cli.bench import metrics as m

HIGH_SPREAD_PCT = 10.0   # a coefficient of variation above this gets a warning
# (noise key, the per-iteration summary's key, unit, label)
FIGURES = (("decode_tokens_per_s", "decode_tokens_per_s", "tok/s", "decode"),
           ("prefill_tokens_per_s", "prefill_tokens_per_s", "tok/s", "prefill"),
           ("ttft_ms", "ttft_ms_mean", "ms", "TTFT"),
           ("output_tokens_per_s", "output_tokens_per_s", "tok/s", "output"))
# The gated --compare metrics: the noise figure that measures each one's spread, and
# whether higher is better.
GATE_SPREAD = {"decode_tokens_per_s": ("decode_tokens_per_s", True), "ttft_ms_p50": ("ttft_ms", False)}


@dataclass(frozen=True)
class CpuContention:
    """The CPU beside the measured iterations: cores, this run's torch threads, the
    highest 1-minute load average seen, and the cores other processes kept busy."""

    cores: int
    threads: int
    load_average_max: float | None
    other_cpu_cores: float | None

    @property
    def busy(self) -> bool:
        """Other work took CPU this run needed: other processes' use over the measured
        iterations plus our threads beyond the cores (a quarter core of slack). The
        load average decides only where that use could not be read: it trails the
        last minute (a test run that ended just before still shows as 24 on 16 idle
        cores) and counts this run's own threads."""
        if self.other_cpu_cores is not None:
            return self.other_cpu_cores + self.threads > self.cores + 0.25
        # the load average is the whole machine's, whatever cores this process may use
        return self.load_average_max is not None and self.load_average_max > (os.cpu_count() or self.cores)


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


class LoadMonitor:
    """Samples the load average after each measured iteration, and the CPU time other
    processes used over them: the system's busy time minus this process's."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.loads: list[float] = []
        self._start: tuple[float, float, float] | None = None
        self._end: tuple[float, float, float] | None = None

    def start(self) -> None:
        self._start = _cpu_clock()
        self.sample()

    def sample(self) -> None:
        try:
            self.loads.append(os.getloadavg()[0])
        except (AttributeError, OSError):  # pragma: no cover - no load average here
            pass
        self._end = _cpu_clock()

    def result(self) -> CpuContention:
        other = None
        if self._start is not None and self._end is not None and self._end[0] > self._start[0]:
            wall, busy, own = (end - start for start, end in zip(self._start, self._end))
            other = max(0.0, (busy - own) / wall)
        return CpuContention(usable_cores(), self.threads, max(self.loads, default=None), other)


def _cpu_clock() -> tuple[float, float, float]:
    """(wall seconds, CPU seconds the cores this process may use were busy, CPU seconds
    of this process). Only those cores: under taskset or a cgroup's cpuset the whole
    machine's had counted work on cores this run could not use ("other processes kept
    1.59 cores busy" of one)."""
    import psutil

    per_cpu = psutil.cpu_times(percpu=True)
    try:
        usable = [per_cpu[i] for i in sorted(os.sched_getaffinity(0)) if i < len(per_cpu)]
    except AttributeError:  # pragma: no cover - not Linux
        usable = per_cpu
    busy = sum(getattr(times, name, 0.0) for times in usable
               for name in ("user", "nice", "system", "irq", "softirq", "steal"))
    own = psutil.Process().cpu_times()
    return time.monotonic(), busy, own.user + own.system


def noise_section(iterations: Sequence[m.IterationSample], contention: CpuContention) -> dict[str, Any]:
    """The report's `noise`: every figure's spread over the iterations, and the CPU."""
    per_iteration = [m.summarize([iteration]) for iteration in iterations]
    section: dict[str, Any] = {"iterations": len(iterations)}
    for name, key, _, _ in FIGURES:
        section.update(m.spread(name, [figures[key] for figures in per_iteration]))
    section.update(cpu_cores=contention.cores, torch_threads=contention.threads,
                   load_average_max=contention.load_average_max, other_cpu_cores=contention.other_cpu_cores,
                   high_spread=bool(_spread_out(section)), busy=contention.busy)
    return section


def _spread_out(noise: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(name, unit, label) of the figures whose spread is above HIGH_SPREAD_PCT."""
    return [(name, unit, label) for name, _, unit, label in FIGURES
            if (noise.get(f"{name}_cv_pct") or 0.0) > HIGH_SPREAD_PCT]


def noise_warnings(noise: dict[str, Any]) -> list[str]:
    """The lines to warn with (stderr): a wide spread, a busy CPU; none for a quiet run."""
    lines = []
    wide = _spread_out(noise)
    if wide:
        parts = [f"{label} {noise[f'{name}_min']:.4g}-{noise[f'{name}_max']:.4g} {unit} "
                 f"(±{noise[f'{name}_cv_pct']:.0f}%)" for name, unit, label in wide]
        lines.append(f"the figures varied widely over the {noise['iterations']} iterations: "
                     + ", ".join(parts) + "; compare runs only beyond that spread")
    if noise.get("busy"):
        load, other = noise.get("load_average_max"), noise.get("other_cpu_cores")
        seen = [f"the machine's load average up to {load:.2f}" if load is not None else "",
                f"other processes kept {other:.2f} cores busy" if other is not None else ""]
        hint = ""
        threads = noise.get("torch_threads")
        if isinstance(threads, int) and threads > 1:
            # measured: 0.5B q4k on 2 cores beside one busy process, 21-23 tok/s with 2 threads, 49-52 with 1
            hint = (f"; every step waits for the slowest of its {threads} threads, so beside other work "
                    f"--threads {threads - 1} (or fewer) often runs faster")
        lines.append("other processes used the CPU during the run (" + "; ".join(filter(None, seen))
                     + "): the figures are likely low and noisy" + hint)
    return lines


def gate_noise_pct(old: dict[str, Any] | None, new: dict[str, Any] | None, metric: str) -> float | None:
    """How far, in percent, a gated metric may move the wrong way by noise alone; None
    when neither run recorded a spread. Noise is taken as multiplicative: a figure's
    log has a stdev of about cv/100 per iteration, and the bound is twice the two
    runs' combined one, 2σ = 2 × √(cv_old² + cv_new²) / 100, turned back into percent
    for the metric's bad direction: a fall of 1 − e^(−2σ), a rise of e^(2σ) − 1."""
    if metric not in GATE_SPREAD:
        return None
    name, higher_is_better = GATE_SPREAD[metric]
    cvs = [run.get(f"{name}_cv_pct") for run in (old or {}, new or {})]
    known = [cv for cv in cvs if isinstance(cv, (int, float))]
    if not known:
        return None
    two_sigma = 2.0 * math.sqrt(sum(cv * cv for cv in known)) / 100.0
    return 100.0 * (1.0 - math.exp(-two_sigma) if higher_is_better else math.exp(two_sigma) - 1.0)
