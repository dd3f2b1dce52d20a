#!/usr/bin/env python
"""oneDNN-packed linear weights (PackedLinear) against plain nn.Linear, in one run.

Loads the Qwen2.5-0.5B-shaped model once with plain nn.Linear layers, builds a packed
twin of every one, and swaps the two sets in and out of the same engine in ABBA
rounds, so both sides share the process, the KV pool and the machine's state. Each
round measures decode ms/step for one stream (128-token prompt) and for 16 streams
(256-token prompts); medians are printed with their ratios.

    .venv/bin/python scripts/bench_packed_linear.py [--quantization f16|none] [--rounds 4]
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from ruvllm_cli.bench.runner import random_prompts  # noqa: E402
from ruvllm_cli.engine.config import EngineConfig  # noqa: E402
from ruvllm_cli.engine.engine import LLMEngine  # noqa: E402
from ruvllm_cli.engine.quantize import PACK_ENV, PackedLinear  # noqa: E402
from ruvllm_cli.engine.sampling import SamplingParams  # noqa: E402
from ruvllm_cli.quantization import parse_quantization  # noqa: E402
from ruvllm_cli.bench.harness import script_model, script_parser  # noqa: E402


def twins(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear, PackedLinear]]:
    """(parent, attribute, plain layer, packed layer) for every nn.Linear."""
    found = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                found.append((parent, name, child, PackedLinear(child)))
    return found


def use(pairs: list, packed: bool) -> None:
    for parent, name, plain, twin in pairs:
        setattr(parent, name, twin if packed else plain)


def decode_ms(engine: LLMEngine, prompts: list[list[int]], steps: int) -> float:
    """Mean ms per decode step once every request has its first token."""
    params = SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)
    requests = [engine.add_request(p, params) for p in prompts]
    while any(not r.output_ids for r in requests):
        engine.step()
    engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = (time.perf_counter() - start) / steps
    while engine.has_unfinished:
        engine.step()
    return elapsed * 1000


def main() -> None:
    parser = script_parser(__doc__, quantizations=["f16", "none"])
    parser.add_argument("--rounds", type=int, default=4, help="ABBA rounds (default 4)")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    os.environ[PACK_ENV] = "0"  # load plain layers; the packed twins are built below
    model_dir = script_model(args)
    engine = LLMEngine.from_path(str(model_dir), EngineConfig(
        device="cpu", quantization=parse_quantization(args.quantization), max_num_seqs=16))
    model = engine.loaded.model
    if model.get_output_embeddings().weight is model.get_input_embeddings().weight:
        model.config.tie_word_embeddings = False
    pairs = twins(model)
    vocab = model.config.vocab_size
    rng = random.Random(0)
    print(f"{len(pairs)} linear layers, {engine.loaded.dtype}, {torch.get_num_threads()} threads",
          file=sys.stderr)
    decode_ms(engine, random_prompts(range(10, vocab), 2, 32, rng), 4)  # warm-up
    results: dict[bool, tuple[list[float], list[float]]] = {False: ([], []), True: ([], [])}
    for index in range(args.rounds):
        order = (False, True) if index % 4 in (0, 3) else (True, False)
        for packed in order:
            use(pairs, packed)
            one = decode_ms(engine, random_prompts(range(10, vocab), 1, 128, rng), args.steps)
            many = decode_ms(engine, random_prompts(range(10, vocab), 16, 256, rng), args.steps)
            results[packed][0].append(one)
            results[packed][1].append(many)
            print(f"round {index + 1} {'packed' if packed else 'nn.Linear'}: {one:.1f} / {many:.1f} ms per step",
                  file=sys.stderr)
    single = {k: statistics.median(v[0]) for k, v in results.items()}
    batch = {k: statistics.median(v[1]) for k, v in results.items()}
    for packed, label in ((False, "nn.Linear"), (True, "packed   ")):
        print(f"{label}  1 stream {single[packed]:6.1f} ms/step ({1000 / single[packed]:6.1f} tok/s)   "
              f"16 streams {batch[packed]:6.1f} ms/step ({16000 / batch[packed]:6.1f} tok/s)")
    print(f"speed-up   1 stream {single[False] / single[True]:.2f}x   16 streams {batch[False] / batch[True]:.2f}x")


if __name__ == "__main__":
    main()
