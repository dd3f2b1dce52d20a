"""The engine benchmark scripts start, and share their common options (they take
minutes on the benchmark model, so CI runs them only this far; docs/design.md has
their figures)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
ENGINE_SCRIPTS = ["bench_engine", "bench_prefix_cache", "bench_packed_linear", "bench_decode_attention",
                  "bench_serve", "bench_fused", "bench_sampling"]


@pytest.mark.parametrize("name", ENGINE_SCRIPTS)
def test_script_help_lists_the_common_options(name):
    result = subprocess.run([sys.executable, str(SCRIPTS / f"{name}.py"), "--help"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    for option in ("--model", "--cache", "--quantization", "--threads"):
        assert option in result.stdout


def test_decode_attention_script_runs_on_a_small_model(engine_model_dir):
    result = subprocess.run([sys.executable, str(SCRIPTS / "bench_decode_attention.py"), "--model",
                             str(engine_model_dir), "--quantization", "none", "--tokens", "6"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split(",")[0] for line in lines[:3]] == ["prompt  128", "prompt  512", "prompt 1500"]
    assert lines[3].startswith("median decode step: batched matmuls ")


def test_sampling_benchmark_runs_on_a_small_model(engine_model_dir):
    result = subprocess.run([sys.executable, str(SCRIPTS / "bench_sampling.py"), "--model", str(engine_model_dir),
                             "--quantization", "none", "--streams", "1,2", "--prompt-length", "8",
                             "--gen-length", "4", "--rounds", "1"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split(":")[0] for line in lines[:3]] == [
        f"sample_row, {lines[0].split(',')[1].strip()}, {name}" for name in ("greedy", "plain", "recommended")]
    assert [line.split(":")[0] for line in lines[3:]] == [
        f"{count} streams, {name}" for count in (1, 2) for name in ("greedy", "plain", "recommended")]
    assert lines[3].endswith("1.00x greedy")


def test_engine_benchmark_runs_on_a_small_model_and_prints_its_ratios_as_json(engine_model_dir):
    import json

    result = subprocess.run([sys.executable, str(SCRIPTS / "bench_engine.py"), "--model", str(engine_model_dir),
                             "--quantization", "none", "--json"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    for key in ("single_stream_decode_tok_s", "batch_decode_tok_s", "ttft_512_s"):
        assert report[key]["engine"] > 0 and report[key]["ratio"] > 0
    assert report["batch_decode_tok_s"]["streams"] == 16


def test_grammar_benchmark_script_starts():
    result = subprocess.run([sys.executable, str(SCRIPTS / "bench_grammar.py"), "--help"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "--libraries" in result.stdout


@pytest.mark.slow
def test_load_benchmark_gguf_rows_load_each_file_both_ways(engine_model_dir, tmp_path):
    import json

    from ruvllm_cli.testing.tiny_gguf import write_gguf

    write_gguf(engine_model_dir, tmp_path / "Q8_0.gguf")   # llamacpp.sh's name; no llama-bench here
    result = subprocess.run([sys.executable, str(SCRIPTS / "bench_load.py"), "--llamacpp", str(tmp_path),
                             "--gguf-only", "--gguf", "Q8_0", "--format", "json"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    row, = json.loads(result.stdout)["gguf_rows"]
    assert (row["gguf"], row["quantization"], row["llamacpp"]) == ("Q8_0.gguf", "q8", None)
    assert row["streamed"]["streamed"] and not row["transformers"]["streamed"]
    assert row["streamed"]["peak_mib"] >= row["streamed"]["import_mib"] > 0


@pytest.mark.parametrize("mode", ["fused-vs-stock", "attention", "loops"])
def test_fused_script_runs_on_a_small_model_and_prints_json(engine_model_dir, mode):
    import json

    from ruvllm_cli.engine import kernels

    if mode == "attention" and not kernels.cpu_has(kernels.AVX512_CPU_FLAGS):
        pytest.skip("no AVX-512 here: the fused step's attention has one path")
    # q8's int8 GEMV takes the two rows: every layer of the C loop is one of our kernels
    options = {"attention": ["--attention"], "loops": ["--loops", "--quantization", "q8"]}.get(mode, [])
    result = subprocess.run([sys.executable, str(SCRIPTS / "bench_fused.py"), "--model", str(engine_model_dir),
                             "--quantization", "none", "--streams", "2", "--context", "20", "--steps", "2",
                             "--rounds", "2", "--format", "json", *options],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    (row,) = json.loads(result.stdout)["rows"]
    assert (row["streams"], row["context"]) == (2, 20)
    keys = {"attention": [f"{level}_{kind}_ms" for level in ("avx512", "avx2") for kind in ("other", "step")]
            + ([f"avx512bf16_{kind}_ms" for kind in ("other", "step")]
               if kernels.cpu_has(kernels.AVX512_CPU_FLAGS + ("avx512_bf16",)) else []),
            "loops": ["c_ms", "python_ms"]}.get(mode, ["fused_ms", "stock_ms", "fused_other_ms", "stock_other_ms"])
    assert all(row[key] > 0 for key in keys)
    if mode == "loops":
        assert row["c_steps"] == row["steps"] > 0


@pytest.mark.parametrize("kind", ["f16", "int4"])
def test_kernel_ab_script_builds_both_revisions_and_compares_their_bits(kind):
    import json

    from ruvllm_cli.engine import int4_dense, kernels

    if not (SCRIPTS.parent / ".git").exists():
        pytest.skip("not a git checkout: the script reads the other revision's source from git")
    if (kernels.half_kernel() if kind == "f16" else int4_dense.own_kernel()) is None:
        pytest.skip(f"no {kind} kernel of ours runs here")
    command = [sys.executable, str(SCRIPTS / "bench_kernel_ab.py"), "--kernel", kind, "--shapes", "64x128",
               "--rows", "1,3", "--rounds", "2", "--format", "json"]
    result = subprocess.run([*command, "--against", "HEAD"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["kernel"].startswith("half_gemm" if kind == "f16" else "int4_gemm") and not report["warm"]
    assert [(row["shape"], row["rows"]) for row in report["rows"]] == [("64x128", 1), ("64x128", 3)]
    assert all(row["same_bits"] and row["old_ms"] > 0 and row["new_ms"] > 0 for row in report["rows"])
    missing = subprocess.run([*command, "--against", "no-such-revision"], capture_output=True, text=True, timeout=300)
    assert missing.returncode == 1 and "Traceback" not in missing.stderr
    assert "bench_kernel_ab: no ruvllm_cli/engine/kernels/" in missing.stderr
