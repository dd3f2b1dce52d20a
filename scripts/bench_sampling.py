#!/usr/bin/env python
"""What sampling costs beside the forward: sample_row per row of a vocabulary-sized
logits row, and the engine's decode rate with sampled requests against greedy ones,
in one process (rounds alternate: the machine's speed drifts between runs).

Settings: greedy; plain (temperature 1: OpenAI's default); recommended (temperature
0.7, top_k 20, top_p 0.8, repetition_penalty 1.05: Qwen2.5-Instruct's
generation_config.json, what `serve` now gives a request that sets none).

    .venv/bin/python scripts/bench_sampling.py --model models/bench --quantization q8 --streams 1,16
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from ruvllm_cli.bench.harness import script_model, script_parser  # noqa: E402
from ruvllm_cli.engine.config import EngineConfig  # noqa: E402
from ruvllm_cli.engine.engine import LLMEngine  # noqa: E402
from ruvllm_cli.engine.loader import load_model  # noqa: E402
from ruvllm_cli.engine.sampler import apply_penalties, distinct_ids, sample_row  # noqa: E402
from ruvllm_cli.engine.sampling import SamplingParams  # noqa: E402
from ruvllm_cli.quantization import parse_quantization  # noqa: E402

SETTINGS = {"greedy": {"temperature": 0.0},
            "plain": {"temperature": 1.0},
            "recommended": {"temperature": 0.7, "top_k": 20, "top_p": 0.8, "repetition_penalty": 1.05}}


def row_costs(vocab: int, prompt_length: int, repeats: int = 50) -> dict[str, float]:
    """Median ms of one sample_row (and the penalty, where one is set) per setting."""
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(0)) * 3
    rng = random.Random(0)
    prompt = [rng.randrange(vocab) for _ in range(prompt_length)]
    output = [rng.randrange(vocab) for _ in range(64)]
    seen = distinct_ids(prompt, row.device)
    generator = torch.Generator().manual_seed(1)
    costs = {}
    for name, knobs in SETTINGS.items():
        params = SamplingParams(**knobs)
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            logits = row.clone()
            if params.needs_history:
                logits = apply_penalties(logits, prompt, output, params, seen)
            sample_row(logits, params, generator)
            times.append(time.perf_counter() - started)
        costs[name] = statistics.median(times) * 1e3
    return costs


def main() -> None:
    parser = script_parser(__doc__, ["f16", "q8", "q4k", "none"])
    parser.add_argument("--streams", default="1,16", help="concurrent requests (default: %(default)s)")
    parser.add_argument("--prompt-length", type=int, default=128)
    parser.add_argument("--gen-length", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    model = script_model(args)
    quantization = parse_quantization(args.quantization)
    streams = [int(s) for s in args.streams.split(",")]
    loaded = load_model(model, "cpu", quantization)
    vocab = int(loaded.model.config.vocab_size)
    for name, ms in row_costs(vocab, args.prompt_length).items():
        print(f"sample_row, {vocab:,} tokens, {name}: {ms:.3f} ms")
    engine = LLMEngine(loaded, EngineConfig(device="cpu", quantization=quantization, max_num_seqs=max(streams),
                                            max_model_len=args.prompt_length + args.gen_length))
    rng = random.Random(0)
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(args.prompt_length)] for _ in range(max(streams))]
    rates: dict[tuple[int, str], list[float]] = {}
    for _ in range(args.rounds):
        for count in streams:
            for name, knobs in SETTINGS.items():
                params = [SamplingParams(max_tokens=args.gen_length, ignore_eos=True, seed=i, **knobs)
                          for i in range(count)]
                started = time.perf_counter()
                outputs = engine.generate(prompts[:count], params)
                elapsed = time.perf_counter() - started
                rates.setdefault((count, name), []).append(sum(len(o.token_ids) for o in outputs) / elapsed)
    for count in streams:
        greedy = max(rates[(count, "greedy")])
        for name in SETTINGS:
            best = max(rates[(count, name)])
            print(f"{count} streams, {name}: {best:.1f} tok/s (generated, over the whole run), {best / greedy:.2f}x greedy")


if __name__ == "__main__":
    main()
