#!/usr/bin/env python
"""Prefix caching, measured as ratios in one run on the Qwen2.5-0.5B-shaped model.

1. TTFT of a request whose 1024-token prefix is cached (16-token new suffix), against
   the same request on an engine with the prefix cache off (median of --repeats).
2. Throughput with 0% hits (every prompt distinct): 8 requests of 256-token prompts,
   64 new tokens each, prefix caching switched on and off on one engine in
   alternating rounds (the hashing and bookkeeping must cost ~nothing).

    .venv/bin/python scripts/bench_prefix_cache.py [--model DIR] [--quantization f16]
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from ruvllm_cli.bench.runner import random_prompts  # noqa: E402
from ruvllm_cli.engine.config import EngineConfig  # noqa: E402
from ruvllm_cli.engine.engine import LLMEngine  # noqa: E402
from ruvllm_cli.engine.loader import load_model  # noqa: E402
from ruvllm_cli.engine.sampling import SamplingParams  # noqa: E402
from ruvllm_cli.quantization import parse_quantization  # noqa: E402
from ruvllm_cli.bench.harness import script_model, script_parser  # noqa: E402


def ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return random_prompts(range(10, vocab), 1, n, rng)[0]


def ttft(engine: LLMEngine, prompt: list[int]) -> tuple[float, int]:
    request = engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished:
        engine.step()
    return request.timings.first_token - request.timings.arrival, request.num_cached_tokens


def throughput(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    engine.generate(prompts, params)
    return len(prompts) * new_tokens / (time.perf_counter() - start)


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--prefix", type=int, default=1024)
    parser.add_argument("--suffix", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    model_dir = script_model(args)
    quant = parse_quantization(args.quantization)
    loaded = load_model(model_dir, "cpu", quant)
    on = LLMEngine(loaded, EngineConfig(device="cpu", quantization=quant))
    off = LLMEngine(loaded, EngineConfig(device="cpu", quantization=quant, enable_prefix_caching=False))
    vocab = loaded.model.config.vocab_size
    rng = random.Random(0)
    print(f"model {model_dir}, {quant.value}, {torch.get_num_threads()} threads", file=sys.stderr)
    ttft(on, ids(rng, 64, vocab))
    ttft(off, ids(rng, 64, vocab))  # warm-up

    prefix = ids(rng, args.prefix, vocab)
    ttft(on, prefix + ids(rng, args.suffix, vocab))          # fills the cache
    hit_times, miss_times, cached = [], [], []
    for _ in range(args.repeats):
        prompt = prefix + ids(rng, args.suffix, vocab)
        t, n = ttft(on, prompt)
        hit_times.append(t)
        cached.append(n)
        miss_times.append(ttft(off, prompt)[0])
    hit, miss = statistics.median(hit_times), statistics.median(miss_times)
    print(f"TTFT, {args.prefix}-token cached prefix + {args.suffix} new tokens: "
          f"cache on {hit * 1000:.1f} ms (cached tokens {cached[0]}), cache off {miss * 1000:.1f} ms, "
          f"speed-up {miss / hit:.1f}x  (target >= 8x)")

    # One engine, prefix caching switched on and off between alternating rounds with
    # fresh prompts (0% hits): same KV pool, same memory, only the caching differs.
    # (Two engines in one process measured their pools' placement, not the cache.)
    rates: dict[bool, list[float]] = {False: [], True: []}
    for round_index in range(args.rounds):
        # ABBA order, so drift in the machine's speed falls on both sides alike.
        for enabled in ((False, True) if round_index % 2 == 0 else (True, False)):
            on.block_manager.enable_prefix_caching = enabled
            hits_before = on.block_manager.stats.hits
            rates[enabled].append(throughput(on, [ids(rng, 256, vocab) for _ in range(8)], 64))
            assert on.block_manager.stats.hits == hits_before, "the 0% hit run found hits"
    t_on, t_off = statistics.median(rates[True]), statistics.median(rates[False])
    print(f"throughput, 0% hits, 8 x 256-token prompts, 64 new tokens (median of {args.rounds} alternating "
          f"rounds, one engine): cache on {t_on:.1f} tok/s, cache off {t_off:.1f} tok/s, "
          f"ratio {t_on / t_off:.3f}  (target within 3%)")


if __name__ == "__main__":
    main()
