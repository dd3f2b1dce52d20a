"""Pure functions of the benchmark: metrics, prompts, flattening, formats, the compare gate."""

from __future__ import annotations

import csv
import io
import random
from types import SimpleNamespace

import pytest

from ruvllm_cli.bench import compare as cmp
from ruvllm_cli.bench import metrics as m
from ruvllm_cli.bench.formatters import to_csv, verdict
from ruvllm_cli.bench.report import flatten
from ruvllm_cli.bench.runner import BenchSettings, check_fits, prompt_token_pool, random_prompts
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
