#!/usr/bin/env python
"""Single-request decode attention: SDPA (the engine's path) against the batched
matmuls that serve several requests, inside real engine steps.

One engine, one request at a time decoding after prompts of several lengths; the
path alternates every step, so both sides see the same machine state (this machine
drifts between runs). Prints the mean time of one layer's decode attention and the
median step time for each path.

    .venv/bin/python scripts/bench_decode_attention.py [--quantization f16] [--tokens 80]
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from ruvllm_cli.bench.runner import random_prompts  # noqa: E402
from ruvllm_cli.engine import attention  # noqa: E402
from ruvllm_cli.engine.config import EngineConfig  # noqa: E402
from ruvllm_cli.engine.engine import LLMEngine  # noqa: E402
from ruvllm_cli.engine.sampling import SamplingParams  # noqa: E402
from ruvllm_cli.quantization import parse_quantization  # noqa: E402
from ruvllm_cli.bench.harness import script_model, script_parser  # noqa: E402

LABELS = {True: "SDPA (one request)", False: "batched matmuls"}


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--tokens", type=int, default=80, help="new tokens per prompt")
    args = parser.parse_args()
    model_dir = script_model(args)
    # The stock forward's attention is what this measures: decode steps off the fused path.
    engine = LLMEngine.from_path(str(model_dir), EngineConfig(
        device="cpu", quantization=parse_quantization(args.quantization), fused_decode=False))
    vocab = engine.loaded.model.config.vocab_size
    rng = random.Random(0)
    layer_calls = attention._decode_attention
    spent: dict[bool, list[float]] = {True: [], False: []}

    def timed(*call_args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        start = time.perf_counter()
        result = layer_calls(*call_args, **kwargs)
        spent[attention.SINGLE_DECODE_SDPA].append(time.perf_counter() - start)
        return result

    attention._decode_attention = timed
    steps: dict[bool, list[float]] = {True: [], False: []}
    engine.generate(random_prompts(range(10, vocab), 1, 16, rng), SamplingParams(max_tokens=4))  # warm-up
    for length in (128, 512, 1500):
        for flag in spent:
            spent[flag].clear()
        params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
        engine.add_request(random_prompts(range(10, vocab), 1, length, rng)[0], params)
        index = 0
        while engine.has_unfinished:
            attention.SINGLE_DECODE_SDPA = bool(index % 2)
            index += 1
            start = time.perf_counter()
            engine.step()
            if index > 2:  # the prompt's step is no decode step
                steps[attention.SINGLE_DECODE_SDPA].append(time.perf_counter() - start)
        line = ", ".join(f"{LABELS[flag]} {statistics.mean(spent[flag]) * 1e6:.0f} us"
                         for flag in (False, True))
        print(f"prompt {length:4d}, one layer's decode attention: {line}")
    attention.SINGLE_DECODE_SDPA = True
    old, new = statistics.median(steps[False]), statistics.median(steps[True])
    print(f"median decode step: batched matmuls {old * 1000:.2f} ms, SDPA {new * 1000:.2f} ms "
          f"({old / new:.2f}x)")


if __name__ == "__main__":
    main()
