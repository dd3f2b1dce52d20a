"""`ruvllm benchmark MODEL --lora NAME=PATH ...`: the same workload on the base model
alone and mixed over the base model and two adapters in one run, on the tiny float32
model with two random peft adapters."""

from __future__ import annotations

import csv
import io
import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.bench.run import bench

PROMPT, GEN, ITERATIONS, CONCURRENCY = 16, 8, 2, 3
# The documented fields (docs/benchmark.md): renaming any must fail here.
LORA_FIELDS = [
    "adapters", "aggregate_decode_tok_s_base", "aggregate_decode_tok_s_mixed", "ratio", "ttft_ms_p50_base",
    "ttft_ms_p50_mixed", "mixed_requests", "mixed_base_requests", "slot_loads_warmup", "slot_loads_measured",
]


@pytest.fixture(scope="module")
def home(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ruvllm_cli.testing.tiny_lora import ATTENTION, build_lora_adapter

    home = tmp_path_factory.mktemp("bench-lora")
    build_lora_adapter(tiny_model_dir, home / "sql", rank=4, seed=1)
    build_lora_adapter(tiny_model_dir, home / "chat", rank=8, targets=ATTENTION, seed=2)
    return home


LORAS = ["--lora", "sql=sql", "--lora", "chat=chat"]


@pytest.fixture(scope="module")
def report(tiny_model_dir: Path, home: Path) -> dict[str, Any]:
    done = bench(tiny_model_dir, "-q", "none", "--prompt-length", str(PROMPT), "--gen-length", str(GEN),
                 "--warmup", "1", "-i", str(ITERATIONS), "--concurrency", str(CONCURRENCY), *LORAS,
                 "--format", "json", home=home)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_json_has_the_lora_section(report: dict[str, Any]) -> None:
    assert list(report) == ["schema_version", "model", "config", "system", "metrics", "lora", "noise", "samples"]
    lora = report["lora"]
    assert list(lora) == LORA_FIELDS
    assert lora["adapters"] == [{"name": "sql", "rank": 4, "mixed_requests": ITERATIONS},
                                {"name": "chat", "rank": 8, "mixed_requests": ITERATIONS}]
    assert lora["mixed_requests"] == ITERATIONS * CONCURRENCY and lora["mixed_base_requests"] == ITERATIONS
    config = report["config"]
    assert config["lora"] == ["sql=sql", "chat=chat"]
    assert config["max_loras"] == 4 and config["max_lora_rank"] == 16 and config["json_schema"] is None


def test_ratio_is_mixed_over_base(report: dict[str, Any]) -> None:
    lora, metrics = report["lora"], report["metrics"]
    assert lora["aggregate_decode_tok_s_base"] > 0 and lora["aggregate_decode_tok_s_mixed"] > 0
    assert lora["ratio"] == pytest.approx(lora["aggregate_decode_tok_s_mixed"] / lora["aggregate_decode_tok_s_base"],
                                          rel=1e-9)
    # The base side is the ordinary benchmark: `metrics` and `samples` describe it.
    assert lora["ttft_ms_p50_base"] == metrics["ttft_ms_p50"]
    assert lora["ttft_ms_p50_mixed"] > 0
    assert metrics["measured_requests"] == ITERATIONS * CONCURRENCY and len(report["samples"]) == ITERATIONS


def test_the_mixed_side_loaded_the_adapters(report: dict[str, Any]) -> None:
    # Four slots: the first mixed iteration (in the warm-up) copies both adapters in, and
    # they stay there for the measured ones.
    assert (report["lora"]["slot_loads_warmup"], report["lora"]["slot_loads_measured"]) == (2, 0)


def test_table_and_csv_show_both_sides(report: dict[str, Any]) -> None:
    from ruvllm_cli.bench.formatters import to_csv, to_text

    text = to_text(report)
    lora = report["lora"]
    assert "LoRA adapters (--lora: base model alone vs mixed over the adapters)" in text
    rows = {
        "Adapters": "sql (rank 4), chat (rank 8)",
        r"Base decode \(aggregate\)": f"{lora['aggregate_decode_tok_s_base']:,.2f} tok/s",
        r"Mixed decode \(aggregate\)": f"{lora['aggregate_decode_tok_s_mixed']:,.2f} tok/s",
        r"Ratio \(mixed ÷ base\)": f"{lora['ratio']:,.3f}",
        "Mixed requests": "6 (2 base, 2 sql, 2 chat)",
        "Adapter slot loads": "2 in warm-up, 0 measured",
    }
    for label, value in rows.items():
        assert re.search(rf"│ {label} +│ +{re.escape(value)} │", text), label
    [row] = csv.DictReader(io.StringIO(to_csv(report)))
    assert float(row["lora.ratio"]) == lora["ratio"]
    assert json.loads(row["lora.adapters"]) == lora["adapters"]
    assert json.loads(row["config.lora"]) == ["sql=sql", "chat=chat"]


@pytest.mark.parametrize(("args", "error"), [
    (["--json-schema", "schema.json", "--concurrency", "3"],
     "Error: --json-schema and --lora cannot be used together: run one benchmark for each"),
    ([], "Error: --lora: the base model and 2 adapter(s) need --concurrency 3 or more, one request each in "
         "every mixed iteration"),
])
def test_a_refused_combination_is_one_line_before_the_model_loads(tiny_model_dir: Path, home: Path,
                                                                  args: list[str], error: str) -> None:
    (home / "schema.json").write_text('{"type": "object"}', encoding="utf-8")
    done = bench(tiny_model_dir, "-q", "none", *LORAS, *args, "--format", "json", home=home)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.splitlines() == [error]


def test_one_slot_swaps_the_adapters_and_the_sides_alternate(tiny_model_dir: Path, home: Path) -> None:
    from ruvllm_cli.bench.runner import BenchmarkRunner, BenchSettings
    from ruvllm_cli.engine.config import EngineConfig
    from ruvllm_cli.engine.engine import LLMEngine
    from ruvllm_cli.quantization import Quantization

    engine = LLMEngine.from_path(str(tiny_model_dir), EngineConfig(
        device="cpu", quantization=Quantization.F32, max_num_seqs=CONCURRENCY, max_model_len=PROMPT + GEN,
        max_loras=1))
    for name in ("sql", "chat"):
        engine.add_lora(name, home / name)
    settings = BenchSettings(0, 2, PROMPT, GEN, CONCURRENCY, 0, adapters=("sql", "chat"))
    run = BenchmarkRunner(engine, settings).run()

    assert run.mixed is not None and run.constrained is None
    base, mixed = run.iterations, run.mixed.iterations
    assert base[0].end < mixed[0].start and mixed[1].end < base[1].start  # A B, then B A
    assert all(r.generated_tokens == GEN for it in mixed for r in it.requests)
    # One slot for two adapters in every mixed iteration: each is copied in once per iteration.
    assert (run.mixed.slot_loads_warmup, run.mixed.slot_loads_measured) == (0, 4)
    engine.check_integrity()


def test_max_loras_defaults_to_room_for_every_adapter() -> None:
    from ruvllm_cli.cli.benchmark import _slots_for

    assert _slots_for(2, None) is None       # the engine's 4 slots hold them
    assert _slots_for(6, None) == 6
    assert _slots_for(6, 2) == 2             # as given: the swaps are then part of the measurement
