"""`ruvllm benchmark` end to end on the tiny float32 model, in subprocesses.

Each run costs a few seconds (mostly importing torch), so the JSON run is shared by
the tests that only read it.
"""

from __future__ import annotations

import copy
import csv
import io
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.bench.run import bench

PROMPT, GEN = 16, 8
SMALL = ["-q", "none", "--prompt-length", str(PROMPT), "--gen-length", str(GEN), "--warmup", "1", "-i", "3"]

# The documented schema (docs/benchmark.md): renaming any field must fail here.
TOP_LEVEL = ["schema_version", "model", "config", "system", "metrics", "noise", "samples"]
MODEL_FIELDS = ["name", "argument", "repo_id", "revision", "path", "architecture"]
CONFIG_FIELDS = [
    "warmup", "iterations", "prompt_length", "gen_length", "concurrency", "quantization", "device", "seed",
    "format", "output", "compare", "threshold_pct", "memory_bandwidth_gb_s", "sampling", "prefix_caching",
    "max_num_seqs", "max_model_len", "kv_cache_blocks", "block_size", "threads",
]
SYSTEM_FIELDS = [
    "cpu_model", "cpu_cores_physical", "cpu_cores_logical", "torch_threads", "ram_total_gb", "os",
    "python_version", "torch_version", "transformers_version", "device", "device_name", "dtype",
    "quantization", "quantization_path", "ruvllm_version", "git_commit",
]
METRIC_FIELDS = [
    "load_time_s", "ttft_ms_mean", "ttft_ms_p50", "ttft_ms_p95", "ttft_ms_p99", "ttft_ms_stdev", "prefill_ms_mean",
    "prefill_ms_p50", "prefill_ms_p95", "prefill_ms_p99", "prefill_ms_stdev",
    "prefill_tokens_per_s", "decode_tokens_per_s", "itl_ms_mean", "itl_ms_p50", "itl_ms_p95", "itl_ms_p99",
    "itl_ms_stdev",
    "e2e_ms_mean", "e2e_ms_p50", "e2e_ms_p95", "e2e_ms_p99", "e2e_ms_stdev", "output_tokens_per_s",
    "requests_per_s", "generated_tokens_per_request", "prompt_tokens_per_request", "cached_prompt_tokens",
    "measured_requests", "preemptions", "peak_rss_mb", "cuda_max_allocated_mb", "weight_bytes",
    "decode_weight_bytes",
    "achieved_bandwidth_gb_s", "bandwidth_utilization_pct",
]
NOISE_FIELDS = ["iterations"] + [f"{figure}_{stat}" for figure in ("decode_tokens_per_s", "prefill_tokens_per_s",
                                                                   "ttft_ms", "output_tokens_per_s")
                                  for stat in ("min", "max", "stdev", "cv_pct")] + [
    "cpu_cores", "torch_threads", "load_average_max", "other_cpu_cores", "high_spread", "busy"]
ITERATION_FIELDS = ["iteration", "wall_ms", "output_tokens_per_s", "requests"]
REQUEST_FIELDS = ["prompt_tokens", "cached_prompt_tokens", "generated_tokens", "finish_reason", "ttft_ms",
                  "prefill_ms", "decode_ms", "e2e_ms", "decode_tokens_per_s", "itl_ms"]
SECTIONS = {"model": MODEL_FIELDS, "config": CONFIG_FIELDS, "system": SYSTEM_FIELDS, "metrics": METRIC_FIELDS,
            "noise": NOISE_FIELDS}


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("bench")


@pytest.fixture(scope="module")
def json_run(tiny_model_dir: Path, home: Path) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    done = bench(tiny_model_dir, *SMALL, "--threads", "1", "--format", "json", "--output", str(home / "run.json"),
                 home=home)
    assert done.returncode == 0, done.stderr
    return done, json.loads(done.stdout)


def test_json_carries_every_documented_field(json_run):
    _, report = json_run
    assert list(report) == TOP_LEVEL
    for section, fields in SECTIONS.items():
        assert set(fields) <= set(report[section]), f"{section}: missing {set(fields) - set(report[section])}"
    assert len(report["samples"]) == 3
    assert report["config"]["threads"] == 1 and report["system"]["torch_threads"] == 1   # --threads 1
    for iteration in report["samples"]:
        assert list(iteration) == ITERATION_FIELDS
        for request in iteration["requests"]:
            assert list(request) == REQUEST_FIELDS


def test_json_values_are_measured_and_exact(json_run, tiny_model_dir):
    _, report = json_run
    metrics, config, system = report["metrics"], report["config"], report["system"]
    assert metrics["generated_tokens_per_request"] == GEN
    assert metrics["prompt_tokens_per_request"] == PROMPT
    assert metrics["measured_requests"] == 3
    assert metrics["cached_prompt_tokens"] == 0            # fresh random prompts every time
    assert 0 < metrics["ttft_ms_p50"] < metrics["e2e_ms_p50"]
    assert 0 < metrics["ttft_ms_mean"] < metrics["e2e_ms_mean"]
    assert metrics["prefill_ms_mean"] <= metrics["ttft_ms_mean"]
    assert metrics["load_time_s"] > 0
    assert metrics["decode_tokens_per_s"] > 0
    assert metrics["itl_ms_mean"] == pytest.approx(1000 / metrics["decode_tokens_per_s"])
    assert metrics["peak_rss_mb"] > 50
    assert metrics["cuda_max_allocated_mb"] is None      # the tests run on a CPU
    assert metrics["weight_bytes"] > 0
    # float32 ties the head as a packed copy: a step reads it, not the embedding table beside it
    assert metrics["decode_weight_bytes"] == metrics["weight_bytes"] - 512 * 64 * 4
    assert metrics["achieved_bandwidth_gb_s"] == pytest.approx(
        metrics["decode_weight_bytes"] * metrics["decode_tokens_per_s"] / 1e9)
    assert metrics["bandwidth_utilization_pct"] is None  # no --memory-bandwidth given
    for iteration in report["samples"]:
        for request in iteration["requests"]:
            assert request["generated_tokens"] == GEN
            assert request["prompt_tokens"] == PROMPT
            assert request["finish_reason"] == "length"
            assert len(request["itl_ms"]) == GEN - 1
            assert 0 < request["ttft_ms"] < request["e2e_ms"]
    assert config["prompt_length"] == PROMPT and config["gen_length"] == GEN
    assert config["warmup"] == 1 and config["iterations"] == 3 and config["concurrency"] == 1
    assert config["quantization"] == "none" and config["format"] == "json"
    assert system["dtype"] == "float32" and system["quantization"] == "F32" and system["device"] == "cpu"
    assert system["cpu_cores_logical"] >= 1 and system["torch_threads"] == report["noise"]["torch_threads"] == 1
    import torch
    import transformers

    # Read from the packages' metadata (importing transformers for it cost 0.4 s and 30 MiB).
    assert (system["torch_version"], system["transformers_version"]) == (torch.__version__,
                                                                         transformers.__version__)
    assert report["model"]["path"] == str(tiny_model_dir)


def test_noise_is_each_iterations_own_figures_and_progress_a_line_each(json_run):
    """Issue 23, item 5: the spread beside every figure, and without a terminal one
    progress line per iteration on stderr (not 28 s of nothing)."""
    done, report = json_run
    noise = report["noise"]
    assert list(noise) == NOISE_FIELDS and noise["iterations"] == 3
    decode = [it["requests"][0]["decode_tokens_per_s"] for it in report["samples"]]
    assert (noise["decode_tokens_per_s_min"], noise["decode_tokens_per_s_max"]) == pytest.approx(
        (min(decode), max(decode)))
    ttft = [it["requests"][0]["ttft_ms"] for it in report["samples"]]
    assert (noise["ttft_ms_min"], noise["ttft_ms_max"]) == pytest.approx((min(ttft), max(ttft)))
    assert noise["decode_tokens_per_s_stdev"] >= 0 and noise["cpu_cores"] >= 1
    assert noise["load_average_max"] >= 0 and noise["other_cpu_cores"] >= 0
    lines = [line for line in done.stderr.splitlines() if line.startswith(("warm-up ", "iteration "))]
    assert [line.split(":")[0] for line in lines] == ["warm-up 1/1", "iteration 1/3", "iteration 2/3",
                                                      "iteration 3/3"]
    for line, rate in zip(lines[1:], decode):
        assert line.startswith(f"iteration ") and f": decode {rate:.2f} tok/s, TTFT " in line
    warned = [line for line in done.stderr.splitlines() if line.startswith("Warning:")]
    assert any("varied widely" in line for line in warned) == noise["high_spread"]
    assert any("other processes used the CPU" in line for line in warned) == noise["busy"]


def test_stdout_holds_only_the_data_and_output_file_the_same(json_run, home):
    done, report = json_run
    assert done.stdout.lstrip().startswith("{") and done.stdout.rstrip().endswith("}")
    assert "Loaded" in done.stderr
    assert json.loads((home / "run.json").read_text()) == report


def flat_names(report: dict[str, Any]) -> list[str]:
    names = ["schema_version"]
    for section in SECTIONS:
        names += [f"{section}.{key}" for key in report[section]]
    return names


def test_csv_is_one_header_and_one_row_named_like_the_json(tiny_model_dir, home, json_run):
    done = bench(tiny_model_dir, *SMALL, "--format", "csv", home=home)
    assert done.returncode == 0, done.stderr
    rows = list(csv.reader(io.StringIO(done.stdout)))
    assert len(rows) == 2
    header, values = rows
    assert header == flat_names(json_run[1])
    assert len(values) == len(header)
    row = dict(zip(header, values))
    assert row["metrics.generated_tokens_per_request"] == str(GEN)
    assert row["metrics.cuda_max_allocated_mb"] == ""
    assert float(row["metrics.ttft_ms_p50"]) > 0


def test_concurrency_reports_aggregate_throughput(tiny_model_dir, home):
    done = bench(tiny_model_dir, "-q", "none", "--prompt-length", str(PROMPT), "--gen-length", str(GEN),
                 "--warmup", "1", "-i", "2", "--concurrency", "4", "--format", "json", home=home)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    metrics = report["metrics"]
    assert metrics["measured_requests"] == 8
    assert [len(it["requests"]) for it in report["samples"]] == [4, 4]
    assert report["config"]["max_num_seqs"] == 4
    wall_s = sum(it["wall_ms"] for it in report["samples"]) / 1000
    assert metrics["output_tokens_per_s"] == pytest.approx(8 * GEN / wall_s)
    assert metrics["requests_per_s"] == pytest.approx(8 / wall_s)
    assert metrics["generated_tokens_per_request"] == GEN


# Timings of a tiny model on a shared 2-core machine swing by 10-50x when other work
# runs, so the injected change is far beyond any noise.
MUCH = 1000.0


def scaled(report: dict[str, Any], factor: float) -> dict[str, Any]:
    """The report as if its run had been `factor` times faster."""
    faster = copy.deepcopy(report)
    faster["metrics"]["decode_tokens_per_s"] *= factor
    faster["metrics"]["ttft_ms_p50"] /= factor
    return faster


def test_compare_exits_1_on_a_regression(tiny_model_dir, home, json_run):
    old = home / "faster.json"
    old.write_text(json.dumps(scaled(json_run[1], MUCH)))
    done = bench(tiny_model_dir, *SMALL, "--format", "json", "--compare", str(old), home=home)
    assert done.returncode == 1, done.stderr
    json.loads(done.stdout)  # the data still comes, alone
    assert "Compared with faster.json" in done.stderr
    error = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert len(error) == 1 and "performance regression beyond 10%" in error[0]
    assert "decode_tokens_per_s" in error[0] and "ttft_ms_p50" in error[0]


def test_compare_exits_0_without_a_regression_and_shows_the_tables(tiny_model_dir, home, json_run):
    old = home / "slower.json"
    slower = scaled(json_run[1], 1 / MUCH)
    slower["system"]["torch_threads"] = 99   # --threads differs: said, as every setting that moves the figures
    old.write_text(json.dumps(slower))
    done = bench(tiny_model_dir, *SMALL, "--compare", str(old), "--memory-bandwidth", "40", home=home)
    assert done.returncode == 0, done.stderr
    titles = ("Latency (ms, per request)", "Throughput", "Memory and load", "System", "Compared with slower.json")
    for title in titles:
        assert title in done.stdout
    # every latency cell measured (prefill's percentiles and three stdevs had been blank), the
    # precision in the load line's words (it said "float32 (F32)"), warnings on stderr alone
    cells = [line.replace("│", " ").split() for line in done.stdout.splitlines()]
    rows: dict[str, list[str]] = {}
    for row in cells:   # the latency table's rows come first ("Prefill (per request)" is throughput's)
        if row[:1] in (["TTFT"], ["Prefill"], ["Inter-token"], ["End-to-end"]):
            rows.setdefault(row[0], row[1:])
    assert len(rows) == 4 and all(len(cells) == 5 for cells in rows.values()), rows
    assert all(float(cell) >= 0 for cells in rows.values() for cell in cells)
    assert " · cpu · float32 · prompt 16 + 8 tokens" in done.stdout
    assert "Warning" not in done.stdout and "the runs differ in system.torch_threads: 99 -> " in done.stderr
    verdict = [line for line in done.stdout.splitlines() if line.startswith("Verdict: decode ")]
    assert len(verdict) == 1 and "GB/s given with --memory-bandwidth" in verdict[0]
    assert "Error" not in done.stderr


def test_compare_with_a_file_that_is_no_report_is_a_usage_error(tiny_model_dir, home):
    bad = home / "bad.json"
    bad.write_text("[1, 2]")
    done = bench(tiny_model_dir, *SMALL, "--compare", str(bad), home=home)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.startswith("Error: --compare:") and "is not a benchmark report" in done.stderr


def test_a_failed_output_write_keeps_the_last_report_and_a_new_file_gets_the_umask(tmp_path, monkeypatch):
    """--output was written in place: a full disk left half a report where the last
    one had been."""
    import errno
    import os

    from ruvllm_cli.cli.benchmark import write_output
    from ruvllm_cli import fsutil

    last = tmp_path / "run.json"
    last.write_text('{"last": 1}')
    last.chmod(0o640)
    write_output(last, '{"new": 1}')
    assert last.read_text() == '{"new": 1}' and last.stat().st_mode & 0o777 == 0o640

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fsutil.os, "fsync", full)
    with pytest.raises(OSError):
        write_output(last, '{"newer": 1}' * 1000)
    assert last.read_text() == '{"new": 1}' and os.listdir(tmp_path) == ["run.json"]
    monkeypatch.undo()
    umask = os.umask(0o022)
    try:
        write_output(tmp_path / "fresh.json", "{}")
    finally:
        os.umask(umask)
    assert (tmp_path / "fresh.json").stat().st_mode & 0o777 == 0o644


@pytest.mark.parametrize("args, message", [
    (["--threshold", "nan"], "'nan' is not a finite number"),
    (["--memory-bandwidth", "inf"], "'inf' is not a finite number"),
    (["--concurrency", "100000000"], "100000000 is not in the range 1<=x<=1024"),
    (["--output", "/proc/self/report.json"], "--output: cannot write in"),
])
def test_values_that_would_spoil_the_run_are_refused_before_it(tiny_model_dir, home, args, message):
    """NaN had reached the JSON (invalid for strict parsers) and turned the gate off; a
    huge concurrency had filled 20 GB with requests; an unwritable --output was found
    only after the whole run."""
    done = bench(tiny_model_dir, *SMALL, *args, home=home)
    assert done.returncode == 2 and done.stdout == ""
    assert message in done.stderr and "Traceback" not in done.stderr


def test_sigterm_mid_run_ends_with_one_line_and_143(tiny_model_dir, home):
    """The default action had ended the run without a word (rc -15 / 143 from the shell)."""
    import os
    import signal
    import sys
    import time

    from tests.bench.run import REPO_ROOT

    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "NO_COLOR": "1", "RUVLLM_CACHE_DIR": str(home / "cache"),
           "RUVLLM_CONFIG_DIR": str(home / "config")}
    output = home / "sigterm.json"
    child = subprocess.Popen([sys.executable, "-m", "ruvllm_cli", "benchmark", str(tiny_model_dir), "-q", "none",
                              "--prompt-length", "16", "--gen-length", "64", "--warmup", "0", "-i", "1000",
                              "--format", "json", "--output", str(output)],
                             env=env, cwd=home, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        seen = ""
        deadline = time.monotonic() + 90
        while "iteration" not in seen and time.monotonic() < deadline:
            seen += child.stderr.readline()
        assert "iteration" in seen
        child.send_signal(signal.SIGTERM)
        out, err = child.communicate(timeout=60)
    finally:
        child.kill()
    assert child.returncode == 143 and out == "" and not output.exists()
    assert err.splitlines()[-1] == "Terminated." and "Traceback" not in err


def test_a_narrow_terminal_folds_figures_rather_than_cutting_them(json_run):
    """Rich's default cut cells with an ellipsis: '2,720.…' at 60 columns."""
    import re

    from rich.console import Console

    from ruvllm_cli.bench.compare import compare_reports, print_comparison
    from ruvllm_cli.bench.formatters import print_tables

    _, report = json_run
    wide, narrow = io.StringIO(), io.StringIO()
    print_tables(report, Console(file=wide, width=200, no_color=True))
    print_tables(report, Console(file=narrow, width=40, no_color=True))
    print_comparison(compare_reports(report, report, 5.0), Console(file=narrow, width=40, no_color=True), "run.json")
    assert "…" not in narrow.getvalue() and "…" not in wide.getvalue()
    digits = sorted(re.sub(r"\D", "", wide.getvalue()))   # every digit is still there, folded
    assert digits and sorted(re.sub(r"\D", "", narrow.getvalue().split("Compared with")[0])) == digits
