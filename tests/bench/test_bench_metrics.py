"""Pure functions of the benchmark: metrics, prompts, flattening, formats, the compare gate."""

from __future__ import annotations

import csv
import json
import re
import io
import math
import random
from types import SimpleNamespace

import pytest

from ruvllm_cli.bench import compare as cmp
from ruvllm_cli.bench import metrics as m
from ruvllm_cli.bench import noise as nz
from ruvllm_cli.bench.formatters import to_csv, verdict
from ruvllm_cli.bench.report import flatten
from ruvllm_cli.bench.runner import BenchSettings, adapter_mix, check_fits, prompt_token_pool, random_prompts
from ruvllm_cli.errors import UsageError


def request(arrival: float, scheduled: float, stamps: list[float], finished: float | None = None,
            prompt: int = 10, cached: int = 0) -> m.RequestSample:
    return m.RequestSample(prompt_tokens=prompt, cached_tokens=cached, arrival=arrival, scheduled=scheduled,
                           first_token=stamps[0], finished=finished if finished is not None else stamps[-1],
                           token_times=tuple(stamps), finish_reason="length")


# ---- statistics -------------------------------------------------------------------------
@pytest.mark.parametrize(("values", "q", "expected"), [
    ([1, 2, 3, 4], 50, 2.5),
    ([1, 2, 3, 4], 0, 1),
    ([1, 2, 3, 4], 100, 4),
    ([1, 2, 3, 4], 95, 3.85),
    ([4, 1, 3, 2], 25, 1.75),          # order of the input does not matter
    (list(range(1, 101)), 99, 99.01),
    (list(range(1, 101)), 50, 50.5),
    ([7.0], 99, 7.0),
])
def test_percentile_interpolates_linearly_between_ranks(values, q, expected):
    assert m.percentile(values, q) == pytest.approx(expected)


def test_percentile_mean_stdev_of_nothing_are_none():
    assert m.percentile([], 50) is None
    assert m.mean([]) is None
    assert m.stdev([3.0]) is None
    assert m.stdev([2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0]) == pytest.approx(2.138089935)
    with pytest.raises(ValueError):
        m.percentile([1.0], 101)


def test_decode_rate_counts_tokens_after_the_first():
    # 5 tokens, the first at 1.0 s and the last at 1.2 s: 4 decode tokens in 0.2 s.
    assert m.decode_tokens_per_s([1.0, 1.05, 1.1, 1.15, 1.2]) == pytest.approx(20.0)
    assert m.decode_tokens_per_s([1.0]) is None
    assert m.inter_token_s([1.0, 1.5, 1.75]) == pytest.approx([0.5, 0.25])


def test_request_timings():
    sample = request(arrival=10.0, scheduled=10.5, stamps=[11.0, 11.5, 12.0], finished=12.25)
    assert m.ttft_s(sample) == pytest.approx(1.0)
    assert m.prefill_s(sample) == pytest.approx(0.5)
    assert m.decode_s(sample) == pytest.approx(1.0)
    assert m.e2e_s(sample) == pytest.approx(2.25)


def test_summarize_known_stamps():
    # Iteration 1: one request; iteration 2: two requests submitted together.
    a = request(0.0, 0.0, [0.1, 0.2, 0.3], finished=0.3, prompt=20)
    b = request(1.0, 1.0, [1.2, 1.3, 1.4], finished=1.4, prompt=20)
    c = request(1.0, 1.0, [1.2, 1.4, 1.6], finished=1.6, prompt=20, cached=16)
    summary = m.summarize([m.IterationSample(1, (a,)), m.IterationSample(2, (b, c))])
    assert summary["ttft_ms_mean"] == pytest.approx((100 + 200 + 200) / 3)
    assert summary["ttft_ms_p50"] == pytest.approx(200)
    assert summary["prefill_ms_mean"] == pytest.approx((100 + 200 + 200) / 3)
    assert summary["prefill_ms_p50"] == pytest.approx(200) and summary["prefill_ms_p99"] == pytest.approx(200)
    assert summary["ttft_ms_stdev"] == summary["prefill_ms_stdev"] == pytest.approx(57.7350, rel=1e-5)
    assert summary["itl_ms_stdev"] == pytest.approx(51.6398, rel=1e-5)   # gaps 100 x4, 200 x2
    # Computed prompt tokens: 20 + 20 + 4 over 0.1 + 0.2 + 0.2 s.
    assert summary["prefill_tokens_per_s"] == pytest.approx(44 / 0.5)
    # Decode: 6 tokens after the first ones, in 0.2 + 0.2 + 0.4 s.
    assert summary["decode_tokens_per_s"] == pytest.approx(6 / 0.8)
    assert summary["itl_ms_mean"] == pytest.approx(800 / 6)
    assert summary["itl_ms_p50"] == pytest.approx(100)
    assert summary["e2e_ms_mean"] == pytest.approx((300 + 400 + 600) / 3)
    assert summary["e2e_ms_stdev"] == pytest.approx(152.7525, rel=1e-5)
    # Aggregate: 9 tokens and 3 requests over 0.3 s + 0.6 s of iteration wall time.
    assert summary["output_tokens_per_s"] == pytest.approx(9 / 0.9)
    assert summary["requests_per_s"] == pytest.approx(3 / 0.9)
    assert summary["generated_tokens_per_request"] == 3
    assert summary["prompt_tokens_per_request"] == 20
    assert summary["cached_prompt_tokens"] == 16
    assert summary["measured_requests"] == 3


def test_aggregate_decode_counts_every_stream_over_the_decode_span():
    a = request(0.0, 0.0, [0.1, 0.2, 0.3])
    b = request(1.0, 1.0, [1.2, 1.3, 1.4])
    c = request(1.0, 1.0, [1.25, 1.45, 1.65])
    # One stream: its own decode rate (2 tokens in 0.2 s).
    assert m.aggregate_decode_tokens_per_s([m.IterationSample(1, (a,))]) == pytest.approx(10.0)
    # Two streams side by side: 4 decode tokens from 1.2 s (the first first token) to 1.65 s.
    assert m.IterationSample(2, (b, c)).decode_span_s == pytest.approx(0.45)
    assert m.aggregate_decode_tokens_per_s([m.IterationSample(2, (b, c))]) == pytest.approx(4 / 0.45)
    assert m.aggregate_decode_tokens_per_s([m.IterationSample(1, (a,)), m.IterationSample(2, (b, c))]) == \
        pytest.approx(6 / 0.65)
    assert m.aggregate_decode_tokens_per_s([]) is None
    assert m.aggregate_decode_tokens_per_s([m.IterationSample(1, (request(0.0, 0.0, [0.1]),))]) is None


def test_bandwidth_is_weight_bytes_times_decode_rate():
    assert m.achieved_bandwidth_gb_s(2_000_000_000, 10.0) == pytest.approx(20.0)
    assert m.achieved_bandwidth_gb_s(2_000_000_000, None) is None
    assert m.bandwidth_utilization_pct(20.0, 40.0) == pytest.approx(50.0)
    assert m.bandwidth_utilization_pct(20.0, None) is None


def test_verdict_never_invents_a_limit():
    metrics = {"decode_tokens_per_s": 10.0, "weight_bytes": 2_000_000_000, "achieved_bandwidth_gb_s": 20.0,
               "bandwidth_utilization_pct": None}
    assert verdict(metrics) == ("Verdict: decode 10.00 tok/s per stream × 2.00 GB of weights = 20.00 GB/s read; "
                                "pass --memory-bandwidth GBPS (your machine's memory bandwidth) to see how "
                                "close that is to the limit.")
    metrics["bandwidth_utilization_pct"] = 50.0
    assert verdict(metrics, 40.0).endswith("= 20.00 GB/s read, 50% of the 40 GB/s given with --memory-bandwidth.")


# ---- prompts ----------------------------------------------------------------------------
class FakeTokenizer:
    """10 tokens; 0 and 3 listed special, 1 and 2 added as special, 8 added as ordinary."""

    all_special_ids = [0, 3]
    added_tokens_decoder = {1: SimpleNamespace(special=True), 2: SimpleNamespace(special=True),
                            8: SimpleNamespace(special=False)}

    def __len__(self) -> int:
        return 10


def test_prompt_pool_leaves_out_special_and_unknown_ids():
    tokenizer = FakeTokenizer()
    # The model knows only 9 ids: id 9 is the tokenizer's alone.
    assert prompt_token_pool(tokenizer, vocab_size=9) == [4, 5, 6, 7, 8]


def test_random_prompts_have_the_exact_length_and_differ():
    rng = random.Random(0)
    prompts = random_prompts(list(range(10, 500)), 4, 33, rng) + random_prompts(list(range(10, 500)), 4, 33, rng)
    assert all(len(p) == 33 for p in prompts)
    assert len({tuple(p) for p in prompts}) == 8
    assert random_prompts([5, 6], 1, 5, random.Random(1)) == random_prompts([5, 6], 1, 5, random.Random(1))


def test_the_adapter_mix_is_round_robin_from_the_base_model():
    assert adapter_mix(["sql", "chat"], 7) == [None, "sql", "chat", None, "sql", "chat", None]
    assert adapter_mix(["sql"], 2) == [None, "sql"]
    assert adapter_mix([], 2) == [None, None]
    assert BenchSettings(adapters=("sql",)).sides == 2 and BenchSettings().sides == 1
    assert BenchSettings(warmup=1, iterations=2, gen_length=8, concurrency=3, adapters=("sql",)).total_tokens == 144


def test_prompt_and_generation_must_fit_the_context():
    check_fits(BenchSettings(prompt_length=100, gen_length=28), 128)
    with pytest.raises(UsageError, match="129 tokens; the model's context is 128"):
        check_fits(BenchSettings(prompt_length=100, gen_length=29), 128)


# ---- report shapes ----------------------------------------------------------------------
REPORT = {
    "schema_version": 1,
    "model": {"name": "tiny"},
    "config": {"prompt_length": 16, "output": None},
    "system": {"cpu_model": "CPU, with a comma"},
    "metrics": {"ttft_ms_p50": 1.5, "cuda_max_allocated_mb": None},
    "samples": [{"iteration": 1}],
}


def test_flatten_names_and_leaves_samples_out():
    assert flatten(REPORT) == {
        "schema_version": 1, "model.name": "tiny", "config.prompt_length": 16, "config.output": None,
        "system.cpu_model": "CPU, with a comma", "metrics.ttft_ms_p50": 1.5, "metrics.cuda_max_allocated_mb": None,
    }


def test_csv_is_one_header_and_one_row():
    rows = list(csv.reader(io.StringIO(to_csv(REPORT))))
    assert rows == [
        ["schema_version", "model.name", "config.prompt_length", "config.output", "system.cpu_model",
         "metrics.ttft_ms_p50", "metrics.cuda_max_allocated_mb"],
        ["1", "tiny", "16", "", "CPU, with a comma", "1.5", ""],
    ]


def test_csv_writes_a_list_as_compact_json():
    report = {**REPORT, "lora": {"adapters": [{"name": "sql", "rank": 4, "mixed_requests": 2}], "ratio": 0.5}}
    header, row = list(csv.reader(io.StringIO(to_csv(report))))
    assert dict(zip(header, row))["lora.adapters"] == '[{"name":"sql","rank":4,"mixed_requests":2}]'
    assert dict(zip(header, row))["lora.ratio"] == "0.5"


# ---- the compare gate -------------------------------------------------------------------
def test_metric_directions():
    assert cmp.direction("decode_tokens_per_s") == 1
    assert cmp.direction("achieved_bandwidth_gb_s") == 1
    assert cmp.direction("ttft_ms_p50") == -1
    assert cmp.direction("load_time_s") == -1
    assert cmp.direction("peak_rss_mb") == -1
    assert cmp.direction("weight_bytes") == 0


def test_change_and_regression_against_the_threshold():
    assert cmp.change_pct(100.0, 89.0) == pytest.approx(-11.0)
    assert cmp.change_pct(0.0, 5.0) is None
    assert cmp.is_regression("decode_tokens_per_s", -10.5, 10.0)
    assert not cmp.is_regression("decode_tokens_per_s", -9.5, 10.0)
    assert not cmp.is_regression("decode_tokens_per_s", 50.0, 10.0)
    assert cmp.is_regression("ttft_ms_p50", 10.5, 10.0)
    assert not cmp.is_regression("ttft_ms_p50", -50.0, 10.0)
    assert not cmp.is_regression("e2e_ms_p99", 500.0, 10.0)  # shown, not gated


def test_compare_reports_lists_every_metric_and_the_regressions():
    old = {"model": {"name": "a"}, "config": {"prompt_length": 16}, "system": {},
           "metrics": {"decode_tokens_per_s": 100.0, "ttft_ms_p50": 10.0, "cuda_max_allocated_mb": None}}
    new = {"model": {"name": "a"}, "config": {"prompt_length": 32}, "system": {},
           "metrics": {"decode_tokens_per_s": 80.0, "ttft_ms_p50": 10.5, "cuda_max_allocated_mb": None,
                       "requests_per_s": 3.0}}
    comparison = cmp.compare_reports(old, new, threshold_pct=10.0)
    assert [c.name for c in comparison.changes] == ["decode_tokens_per_s", "ttft_ms_p50", "requests_per_s"]
    assert [c.name for c in comparison.regressions] == ["decode_tokens_per_s"]
    assert comparison.differences == ("config.prompt_length: 16 -> 32",)
    with pytest.raises(Exception, match=r"decode_tokens_per_s 100.00 -> 80.00 \(-20.0%\)"):
        cmp.raise_on_regression(comparison)


def test_load_previous_rejects_what_is_no_report(tmp_path):
    path = tmp_path / "x.json"
    path.write_text('{"not": "a report"}')
    with pytest.raises(UsageError, match="not a benchmark report"):
        cmp.load_previous(path)
    path.write_text("{broken")
    with pytest.raises(UsageError, match="cannot read"):
        cmp.load_previous(path)


# ---- noise: spread over iterations, a busy CPU, and --compare within the noise -------------


def iteration(index: int, step_s: float, ttft_s: float = 0.1, tokens: int = 5) -> m.IterationSample:
    """One request of `tokens` tokens `step_s` apart, its first after `ttft_s`."""
    stamps = [ttft_s + i * step_s for i in range(tokens)]
    return m.IterationSample(index, (request(0.0, 0.0, stamps),))


QUIET = nz.CpuContention(cores=2, threads=2, load_average_max=1.9, other_cpu_cores=0.1)


def test_spread_of_per_iteration_values():
    spread = m.spread("decode", [10.0, 20.0, None, 30.0])
    assert spread == {"decode_min": 10.0, "decode_max": 30.0, "decode_stdev": pytest.approx(10.0),
                      "decode_cv_pct": pytest.approx(50.0)}
    assert m.spread("x", [7.0]) == {"x_min": 7.0, "x_max": 7.0, "x_stdev": None, "x_cv_pct": None}


def test_noise_section_takes_each_iterations_own_figures():
    """Issue 23, item 5: decode at 100 and 25 tok/s in two iterations is a wide spread."""
    noise = nz.noise_section([iteration(1, 0.01), iteration(2, 0.04)], QUIET)
    assert noise["iterations"] == 2
    assert (noise["decode_tokens_per_s_min"], noise["decode_tokens_per_s_max"]) == pytest.approx((25.0, 100.0))
    assert noise["decode_tokens_per_s_cv_pct"] == pytest.approx(100 * 53.033 / 62.5, rel=1e-4)
    assert (noise["ttft_ms_min"], noise["ttft_ms_max"], noise["ttft_ms_cv_pct"]) == pytest.approx((100, 100, 0))
    assert noise["high_spread"] is True and noise["busy"] is False
    assert (noise["cpu_cores"], noise["torch_threads"], noise["load_average_max"]) == (2, 2, 1.9)
    assert nz.noise_warnings(noise) == [
        "the figures varied widely over the 2 iterations: decode 25-100 tok/s (±85%), "
        "output 19.23-35.71 tok/s (±42%); compare runs only beyond that spread"]


def test_a_steady_run_on_a_quiet_machine_gets_no_warning():
    noise = nz.noise_section([iteration(1, 0.0100), iteration(2, 0.0101), iteration(3, 0.0099)], QUIET)
    assert noise["high_spread"] is False and noise["busy"] is False
    assert nz.noise_warnings(noise) == []


@pytest.mark.parametrize(("load", "other", "busy"), [
    (None, 0.5, True), (None, 0.2, False),    # other processes' use plus our 2 threads beyond them
    (1.9, 0.5, True),
    # The load average trails the minute before the run: with the run's own reading of
    # other processes' use it does not decide, without one it does.
    (2.6, 0.1, False), (2.6, None, True), (1.9, None, False),
    (None, None, False),
])
def test_a_busy_cpu(load, other, busy, monkeypatch):
    monkeypatch.setattr(nz.os, "cpu_count", lambda: 2)   # the load average is the machine's
    contention = nz.CpuContention(cores=2, threads=2, load_average_max=load, other_cpu_cores=other)
    assert contention.busy is busy


def test_busy_warning_names_what_was_seen():
    noise = nz.noise_section([iteration(1, 0.01), iteration(2, 0.01)],
                             nz.CpuContention(cores=2, threads=2, load_average_max=4.96, other_cpu_cores=1.36))
    assert nz.noise_warnings(noise) == [
        "other processes used the CPU during the run (the machine's load average up to 4.96; other processes kept "
        "1.36 cores busy): the figures are likely low and noisy; every step waits for the slowest of its 2 "
        "threads, so beside other work --threads 1 (or fewer) often runs faster"]
    alone = nz.noise_section([iteration(1, 0.01), iteration(2, 0.01)],
                             nz.CpuContention(cores=2, threads=1, load_average_max=None, other_cpu_cores=1.5))
    assert nz.noise_warnings(alone)[0].endswith("likely low and noisy")   # one thread: nothing fewer to suggest


def test_other_processes_count_only_on_the_cores_this_one_may_use(monkeypatch):
    """Under taskset the whole machine's busy time had counted: a process spinning on a
    core this run could not use made it 'kept 1.59 cores busy' of one."""
    import psutil
    from collections import namedtuple

    Times = namedtuple("Times", "user nice system idle")
    clock = {"t": 0.0}

    def per_cpu(percpu=False):
        assert percpu
        t = clock["t"]
        return [Times(0.1 * t, 0, 0, 0.9 * t), Times(t, 0, 0, 0), Times(t, 0, 0, 0)]   # cores 1 and 2 spin

    monkeypatch.setattr(psutil, "cpu_times", per_cpu)
    monkeypatch.setattr(nz.os, "sched_getaffinity", lambda pid: {0})
    monkeypatch.setattr(nz.time, "monotonic", lambda: clock["t"])
    monkeypatch.setattr(psutil.Process, "cpu_times", lambda self: Times(0, 0, 0, 0))
    monitor = nz.LoadMonitor(threads=1)
    monitor.start()
    clock["t"] = 10.0
    monitor.sample()
    seen = monitor.result()
    assert seen.cores == 1 and seen.other_cpu_cores == pytest.approx(0.1)


def test_load_monitor_measures_this_machine():
    monitor = nz.LoadMonitor(threads=1)
    monitor.start()
    sum(range(200_000))
    monitor.sample()
    seen = monitor.result()
    assert seen.cores >= 1 and seen.threads == 1
    assert seen.load_average_max is not None and seen.load_average_max >= 0
    assert seen.other_cpu_cores is not None and seen.other_cpu_cores >= 0


def report(decode: float, ttft: float, decode_cv: float | None, ttft_cv: float | None = 1.0,
           busy: bool = False) -> dict:
    noise = {"decode_tokens_per_s_cv_pct": decode_cv, "ttft_ms_cv_pct": ttft_cv, "busy": busy}
    return {"model": {"name": "a"}, "config": {}, "system": {},
            "metrics": {"decode_tokens_per_s": decode, "ttft_ms_p50": ttft}, "noise": noise}


def test_compare_does_not_count_a_change_within_the_noise():
    """Issue 23, item 5: 119 then 23 tok/s from two identical runs on a busy machine."""
    comparison = cmp.compare_reports(report(119.0, 10.0, 55.0), report(23.0, 10.0, 65.0, busy=True), 10.0)
    decode = comparison.changes[0]
    assert decode.change_pct == pytest.approx(-80.67, abs=0.01)
    two_sigma = 2 * math.hypot(0.55, 0.65)
    assert decode.noise_pct == pytest.approx(100 * (1 - math.exp(-two_sigma)))   # a fall of 81.8%
    assert decode.within_noise and not decode.regression and comparison.regressions == ()
    cmp.raise_on_regression(comparison)                       # no error
    assert cmp.comparison_warnings(comparison) == [
        "decode_tokens_per_s moved -80.7%, beyond the 10% threshold but within the runs' noise (-82%): not "
        "counted as a regression; compare runs on a quiet machine",
        "other processes used the CPU during this run: figures from a busy machine are likely low"]


def test_compare_still_gates_a_change_beyond_the_noise():
    comparison = cmp.compare_reports(report(100.0, 10.0, 2.0), report(80.0, 10.0, 3.0), 10.0)
    assert [c.name for c in comparison.regressions] == ["decode_tokens_per_s"]
    assert comparison.changes[0].noise_pct == pytest.approx(100 * (1 - math.exp(-2 * math.hypot(0.02, 0.03))))
    # A 1000-fold slowdown is beyond any spread (percent bounds would cap a fall at 100%).
    noisy = cmp.compare_reports(report(1000.0, 10.0, 80.0), report(1.0, 10_000.0, 80.0, ttft_cv=80.0), 10.0)
    assert [c.name for c in noisy.regressions] == ["decode_tokens_per_s", "ttft_ms_p50"]
    # A report written before the noise section: the new run's spread alone.
    old = report(100.0, 10.0, None)
    del old["noise"]
    alone = cmp.compare_reports(old, report(80.0, 10.0, 15.0), 10.0)
    assert alone.changes[0].noise_pct == pytest.approx(100 * (1 - math.exp(-0.3))) and alone.regressions == ()
    # TTFT's bound is a rise: e^(2σ) − 1.
    assert alone.changes[1].noise_pct == pytest.approx(100 * (math.exp(0.02) - 1))


@pytest.mark.parametrize("change, message", [
    ({"schema_version": 99}, "schema version 99; this ruvllm reads 1 to"),
    ({"schema_version": None}, "schema version None"),
    ({"model": "tiny"}, "`model` is not an object"),
    ({"noise": [1]}, "`noise` is not an object"),
    ({"model": None}, "`model` is not an object"),   # had passed, then failed after the run
    ({"metrics": {"decode_tokens_per_s": math.nan, "ttft_ms_p50": 2.0}}, "metrics.decode_tokens_per_s is nan"),
    ({"metrics": {"decode_tokens_per_s": 10.0, "ttft_ms_p50": math.inf}}, "metrics.ttft_ms_p50 is inf"),
    ({"metrics": {"decode_tokens_per_s": "fast", "ttft_ms_p50": 2.0}}, "metrics.decode_tokens_per_s is 'fast'"),
    ({"metrics": {}}, "none of the figures the gate compares"),
])
def test_a_compare_file_it_cannot_gate_on_is_refused_before_the_run(tmp_path, change, message):
    """An empty or foreign report had passed the gate silently (every cell n/a), and a
    malformed section had failed after the whole run with a raw AttributeError."""
    from ruvllm_cli.bench.compare import load_previous

    good = {"schema_version": 1, "model": {"name": "tiny"}, "config": {}, "system": {},
            "metrics": {"decode_tokens_per_s": 10.0, "ttft_ms_p50": 2.0}}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(good))
    assert load_previous(path)["metrics"]["decode_tokens_per_s"] == 10.0   # an earlier version is read
    path.write_text(json.dumps({**good, **change}))
    with pytest.raises(UsageError, match=re.escape(message)):
        load_previous(path)
