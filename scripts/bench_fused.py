#!/usr/bin/env python
"""The fused decode step (engine/fused.py) against transformers' layer code, in one
engine, and what each spends outside its linear layers.

For each batch size and context length, the same decode steps run through both paths
in alternating rounds (the machine's speed drifts between runs, not within a round),
then once more with every linear layer's work replaced by a zero tensor made ahead
(the step's "other" cost: norms, RoPE, attention, activations, Python between them).
Where the fused step runs its layers in one C call (engine/fused.py's LayerPlans), its
linear layers write zeros there instead; `--python-loop` runs them from Python.
Prints medians in ms per step and the ratio stock / fused.

    .venv/bin/python scripts/bench_fused.py --model models/bench --quantization q8
    .venv/bin/python scripts/bench_fused.py --quantization q4k --streams 1,16 --context 128,3000
    .venv/bin/python scripts/bench_fused.py --attention --streams 1,16 --context 128,3000
    .venv/bin/python scripts/bench_fused.py --loops --streams 1,4,16
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from pathlib import Path
from contextlib import nullcontext
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from ruvllm_cli.bench.harness import script_model, script_parser  # noqa: E402
from ruvllm_cli.engine import kernels  # noqa: E402
from ruvllm_cli.engine.config import EngineConfig  # noqa: E402
from ruvllm_cli.engine.engine import LLMEngine  # noqa: E402
from ruvllm_cli.engine.sampling import SamplingParams  # noqa: E402
from ruvllm_cli.quantization import parse_quantization  # noqa: E402

LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")


def decode_steps(engine: LLMEngine, streams: int, context: int, steps: int, rng: random.Random) -> list[float]:
    """Seconds of each decode step of `streams` requests with `context`-token prompts."""
    vocab = int(engine.loaded.model.config.vocab_size)
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    requests = [engine.add_request([rng.randrange(5, vocab) for _ in range(context)], params)
                for _ in range(streams)]
    while any(r.num_computed_tokens < len(r.prompt_ids) for r in requests):
        engine.step()
    spent = []
    while engine.has_unfinished:
        start = time.perf_counter()
        engine.step()
        spent.append(time.perf_counter() - start)
    return spent


class ZeroLinears:
    """Every linear module of the model answers with a zero tensor made ahead of time
    (one per module and row count), so a step costs what lies outside them."""

    def __init__(self, model: nn.Module, fused: Any = None) -> None:
        self.modules = [m for name, m in model.named_modules() if name.split(".")[-1] in LINEAR_NAMES]
        self.fused = fused   # the engine's FusedDecoder: where its C layer loop runs, it writes the zeros

    def __enter__(self) -> "ZeroLinears":
        for module in self.modules:
            module.forward = self._zeros(module)
        if self.fused is not None:
            self.fused.zero_linears = True
        return self

    def __exit__(self, *exc: object) -> None:
        for module in self.modules:
            del module.forward
        if self.fused is not None:
            self.fused.zero_linears = False

    @staticmethod
    def _zeros(module: nn.Module) -> Any:
        made: dict[tuple[int, torch.dtype], torch.Tensor] = {}

        def forward(x: torch.Tensor) -> torch.Tensor:
            rows = x.numel() // x.shape[-1]
            key = (rows, x.dtype)
            if key not in made:
                made[key] = torch.zeros(rows, int(module.out_features), dtype=x.dtype)
            return made[key].view(*x.shape[:-1], -1)

        return forward


def alternated(rounds: int, paths: tuple[str, str], run: Callable[[str], list[float]]) -> dict[str, list[float]]:
    """Each path's step times over `rounds` rounds, the order swapped every round (the
    machine's speed drifts between runs, not within a round)."""
    times: dict[str, list[float]] = {path: [] for path in paths}
    for round_ in range(rounds):
        for path in paths if round_ % 2 == 0 else paths[::-1]:
            times[path] += run(path)
    return times


def measure(engine: LLMEngine, streams: int, context: int, args: Any, rng: random.Random) -> dict[str, Any]:
    fused = engine.runner.fused

    def run(path: str, zero: bool = False) -> list[float]:
        engine.runner.fused = fused if path == "fused" else None
        with ZeroLinears(engine.loaded.model, fused) if zero else nullcontext():
            return decode_steps(engine, streams, context, args.steps, rng)

    for path in ("fused", "stock"):   # warm-up: oneDNN primitives, the kernels' first calls
        run(path)
    times = alternated(args.rounds, ("fused", "stock"), run)
    for path in ("fused", "stock"):
        times[f"{path}_other"] = run(path, zero=True)
    engine.runner.fused = fused
    ms = {key: statistics.median(values) * 1e3 for key, values in times.items()}
    return {"streams": streams, "context": context, **{f"{k}_ms": round(v, 2) for k, v in ms.items()},
            "speedup": round(ms["stock"] / ms["fused"], 3)}


LEVELS = {"avx512bf16": 2, "avx512": 1, "avx2": 0}   # DecodeKernel.wide


def measure_attention(engine: LLMEngine, streams: int, context: int, args: Any, rng: random.Random) -> dict[str, Any]:
    """The fused step with the decode kernel's functions at each level this CPU has
    (`DecodeKernel.wide`: AVX-512 BF16, AVX-512, AVX2), alternated in one process:
    whole steps and 'other'."""
    kernel = engine.runner.fused.kernel
    chosen = kernel.wide
    paths = tuple(name for name, level in LEVELS.items() if level <= chosen)

    def run(path: str, steps: int = args.steps) -> list[float]:
        kernel.wide = LEVELS[path]
        return decode_steps(engine, streams, context, steps, rng)

    times: dict[str, list[float]] = {}
    for zero in (True, False):
        with ZeroLinears(engine.loaded.model, engine.runner.fused) if zero else nullcontext():
            for path in paths:   # warm-up
                run(path, 4)
            suffix = "other" if zero else "step"
            times.update({f"{path}_{suffix}": values for path, values in alternated(args.rounds, paths, run).items()})
    kernel.wide = chosen
    return {"streams": streams, "context": context,
            **{f"{key}_ms": round(statistics.median(values) * 1e3, 2) for key, values in times.items()}}


def measure_loops(engine: LLMEngine, streams: int, context: int, args: Any, rng: random.Random) -> dict[str, Any]:
    """The fused step with its layers in one C call and from Python (`layers_in_c`),
    alternated in one process: whole steps, and how many ran the C loop."""
    fused = engine.runner.fused

    def run(path: str, steps: int = args.steps) -> list[float]:
        fused.layers_in_c = path == "c"
        return decode_steps(engine, streams, context, steps, rng)

    for path in ("c", "python"):   # warm-up
        run(path, 4)
    before = fused.c_steps
    times = alternated(args.rounds, ("c", "python"), run)
    fused.layers_in_c = True
    ms = {path: statistics.median(values) * 1e3 for path, values in times.items()}
    return {"streams": streams, "context": context, "c_ms": round(ms["c"], 2), "python_ms": round(ms["python"], 2),
            "speedup": round(ms["python"] / ms["c"], 3), "c_steps": fused.c_steps - before,
            "steps": len(times["c"])}


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--streams", default="1,16", help="decode batch sizes (default: %(default)s)")
    parser.add_argument("--context", default="128", help="prompt lengths (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=16, help="timed decode steps a round (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=4, help="alternating rounds (default: %(default)s)")
    parser.add_argument("--python-loop", action="store_true",
                        help="run the fused step's layers from Python, not in its one C call (to compare)")
    parser.add_argument("--loops", action="store_true",
                        help="compare the fused step's layers in one C call with the same from Python instead")
    parser.add_argument("--attention", action="store_true",
                        help="compare the fused step's kernels at each level this CPU has instead "
                             "(AVX-512 with BF16, AVX-512, AVX2)")
    parser.add_argument("--format", choices=["table", "json"], default="table")
    args = parser.parse_args()
    model_dir = script_model(args)
    engine = LLMEngine.from_path(str(model_dir), EngineConfig(
        device="cpu", quantization=parse_quantization(args.quantization), max_model_len=4096))
    if engine.runner.fused is None:
        raise SystemExit("this model or machine has no fused decode step (another family, or no C compiler)")
    engine.runner.fused.layers_in_c = not args.python_loop
    rng = random.Random(0)
    if args.attention and not kernels.cpu_has(kernels.AVX512_CPU_FLAGS):
        raise SystemExit("this CPU has no AVX-512: the fused step's attention is AVX2 only")
    mode = "loops" if args.loops else "attention" if args.attention else "paths"
    measured = {"loops": measure_loops, "attention": measure_attention, "paths": measure}[mode]
    rows = [measured(engine, int(s), int(c), args, rng) for s in args.streams.split(",") for c in args.context.split(",")]
    if args.format == "json":
        extra = {"path": engine.loaded.quantization_path} if mode == "paths" else {}
        print(json.dumps({"quantization": args.quantization, "threads": args.threads, **extra, "rows": rows}, indent=2))
        return
    levels = [name for name, level in LEVELS.items() if level <= engine.runner.fused.kernel.wide]
    title, header, line = {
        "loops": ("the fused step's layers in one C call / from Python (ms)",
                  "streams  context  C loop  Python loop  Python/C  C-loop steps",
                  "{streams:7d}  {context:7d}  {c_ms:6.2f}  {python_ms:11.2f}  {speedup:7.3f}x  {c_steps:5d} of {steps}"),
        "attention": ("the fused step's kernels at each level of this CPU (ms)",
                      "streams  context" + "".join(f"  {kind + ' ' + path:>16}" for kind in ("other", "step")
                                                   for path in levels),
                      "{streams:7d}  {context:7d}" + "".join(f"  {{{path}_{kind}_ms:16.2f}}"
                                                             for kind in ("other", "step") for path in levels)),
        "paths": (engine.loaded.quantization_path,
                  "streams  context  fused ms  stock ms  stock/fused  other fused  other stock",
                  "{streams:7d}  {context:7d}  {fused_ms:8.2f}  {stock_ms:8.2f}  {speedup:10.2f}x  "
                  "{fused_other_ms:11.2f}  {stock_other_ms:11.2f}"),
    }[mode]
    print(f"{args.quantization}, {args.threads} threads: {title}")
    print(header)
    for r in rows:
        print(line.format(**r))
    print(f"(medians of {args.rounds} alternating rounds of {args.steps} decode steps"
          + ("; 'other': the same steps with every linear layer answering zeros made ahead)" if mode != "loops" else ")"))

if __name__ == "__main__":
    main()
