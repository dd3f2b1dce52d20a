"""`ruvllm benchmark MODEL --json-schema FILE`: the same workload unconstrained and
constrained in one run, on the tiny float32 model."""

from __future__ import annotations

import csv
import io
import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.bench.run import bench

PROMPT, GEN, ITERATIONS = 16, 24, 3
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
# The documented fields (docs/benchmark.md): renaming any must fail here.
STRUCTURED_FIELDS = [
    "schema_file", "decode_tok_s_unconstrained", "decode_tok_s_constrained", "ratio",
    "constrained_tokens_per_request", "constrained_requests", "constrained_completed_requests",
    "mask_ms_per_token", "grammar_compile_ms",
]


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("bench-schema")
    (home / "person.json").write_text(json.dumps(SCHEMA), encoding="utf-8")
    return home


@pytest.fixture(scope="module")
def report(tiny_model_dir: Path, home: Path) -> dict[str, Any]:
    done = bench(tiny_model_dir, "-q", "none", "--prompt-length", str(PROMPT), "--gen-length", str(GEN),
                 "--warmup", "1", "-i", str(ITERATIONS), "--json-schema", "person.json", "--format", "json",
                 home=home)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_json_has_the_structured_section(report: dict[str, Any]) -> None:
    assert list(report) == ["schema_version", "model", "config", "system", "metrics", "structured", "noise",
                            "samples"]
    structured = report["structured"]
    assert list(structured) == STRUCTURED_FIELDS
    assert structured["schema_file"] == report["config"]["json_schema"] == "person.json"
    assert structured["constrained_requests"] == ITERATIONS
    assert 0 <= structured["constrained_completed_requests"] <= ITERATIONS
    assert 1 <= structured["constrained_tokens_per_request"] <= GEN
    assert structured["mask_ms_per_token"] > 0 and structured["grammar_compile_ms"] > 0


def test_ratio_is_constrained_over_unconstrained(report: dict[str, Any]) -> None:
    structured = report["structured"]
    # The unconstrained side is the ordinary benchmark: `metrics` describe it.
    assert structured["decode_tok_s_unconstrained"] == report["metrics"]["decode_tokens_per_s"]
    assert report["metrics"]["generated_tokens_per_request"] == GEN
    assert structured["ratio"] == pytest.approx(
        structured["decode_tok_s_constrained"] / structured["decode_tok_s_unconstrained"], rel=1e-9)
    assert len(report["samples"]) == ITERATIONS


def test_table_and_csv_show_both_sides(report: dict[str, Any]) -> None:
    from ruvllm_cli.bench.formatters import to_csv, to_text

    text = to_text(report)
    structured = report["structured"]
    assert "Structured output (--json-schema person.json)" in text
    rows = {
        r"Unconstrained decode \(per stream\)": f"{structured['decode_tok_s_unconstrained']:,.2f} tok/s",
        r"Constrained decode \(per stream\)": f"{structured['decode_tok_s_constrained']:,.2f} tok/s",
        r"Ratio \(constrained ÷ unconstrained\)": f"{structured['ratio']:,.3f}",
    }
    for label, value in rows.items():
        assert re.search(rf"│ {label} +│ +{re.escape(value)} │", text), label
    [row] = csv.DictReader(io.StringIO(to_csv(report)))
    assert float(row["structured.ratio"]) == structured["ratio"]
    assert row["structured.schema_file"] == row["config.json_schema"] == "person.json"


def test_an_unsupported_schema_fails_in_one_line(tiny_model_dir: Path, home: Path) -> None:
    (home / "bad.json").write_text('{"type": "object", "not": {}}', encoding="utf-8")
    done = bench(tiny_model_dir, "-q", "none", "--json-schema", "bad.json", "--format", "json", home=home)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.splitlines()[0] == "Error: --json-schema bad.json: unsupported JSON schema keyword 'not'"


def test_a_schema_file_that_is_not_json_fails_in_one_line(tiny_model_dir: Path, home: Path) -> None:
    (home / "broken.json").write_text("{", encoding="utf-8")
    done = bench(tiny_model_dir, "-q", "none", "--json-schema", "broken.json", home=home)
    assert done.returncode == 2
    assert done.stderr.splitlines()[0].startswith("Error: --json-schema: broken.json is not JSON: ")


def test_runner_alternates_sides_and_times_every_masked_token(tiny_model_dir: Path) -> None:
    from ruvllm_cli.bench.runner import BenchmarkRunner, BenchSettings
    from ruvllm_cli.engine import sampler
    from ruvllm_cli.engine.config import EngineConfig
    from ruvllm_cli.engine.engine import LLMEngine
    from ruvllm_cli.engine.grammar import GrammarSpec
    from ruvllm_cli.quantization import Quantization

    engine = LLMEngine.from_path(str(tiny_model_dir), EngineConfig(
        device="cpu", quantization=Quantization.F32, max_num_seqs=2, max_model_len=PROMPT + GEN))
    original = sampler.apply_grammar_masks
    settings = BenchSettings(0, 2, PROMPT, GEN, 2, 0, GrammarSpec.json_schema(SCHEMA))
    run = BenchmarkRunner(engine, settings).run()

    assert sampler.apply_grammar_masks is original
    assert run.constrained is not None
    plain, shaped = run.iterations, run.constrained.iterations
    assert [len(it.requests) for it in shaped] == [2, 2]
    assert plain[0].end < shaped[0].start and shaped[1].end < plain[1].start  # A B, then B A
    produced = [r.generated_tokens for it in shaped for r in it.requests]
    assert run.constrained.mask.rows == sum(produced)  # one masked row per constrained token
    for request in (r for it in shaped for r in it.requests):
        assert request.finish_reason in ("stop", "length")
        assert request.finish_reason == "stop" or request.generated_tokens == GEN
    engine.check_integrity()
