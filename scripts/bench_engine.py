#!/usr/bin/env python
"""Engine vs transformers' generate() on the same model, in one run, as ratios.

Builds (once, cached) a random-weight model with Qwen2.5-0.5B-Instruct's exact shape
and measures, for both:
  1. single-stream decode tok/s (128-token prompt, 64 new tokens);
  2. 16 requests of 256-token prompts arriving together, 128 new tokens each:
     steady decode tok/s (after every request has its first token) and wall time;
     generate() runs them as one static batch;
  3. TTFT of a 512-token prompt (median of 3).
Token timestamps come from the token stream (engine) and from a logits processor
that stamps each step (generate()). Usage:

    .venv/bin/python scripts/bench_engine.py [--model DIR] [--quantization f16] [--device cuda] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from ruvllm_cli.bench.runner import random_prompts as bench_prompts  # noqa: E402
from ruvllm_cli.engine.config import EngineConfig  # noqa: E402
from ruvllm_cli.engine.engine import LLMEngine  # noqa: E402
from ruvllm_cli.engine.sampling import SamplingParams  # noqa: E402
from ruvllm_cli.quantization import parse_quantization  # noqa: E402
from ruvllm_cli.bench.harness import script_model, script_parser  # noqa: E402


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    return bench_prompts(range(10, vocab), count, length, random.Random(seed))


class Stamps:
    """A logits processor for generate() that records when each token is chosen."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids, scores):  # noqa: ANN001
        self.times.append(time.perf_counter())
        return scores


def hf_generate(model, prompts: list[list[int]], new_tokens: int) -> tuple[list[float], float]:
    """Greedy generate() on a batch of equal-length prompts; (step stamps, start time)."""
    from transformers import GenerationConfig, LogitsProcessorList

    stamps = Stamps()
    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              pad_token_id=0, eos_token_id=None)
    ids = torch.tensor(prompts, device=model.device)
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config,
                       logits_processor=LogitsProcessorList([stamps]))
    return stamps.times, start


def engine_run(engine: LLMEngine, prompts: list[list[int]], new_tokens: int):
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    requests = [engine.add_request(p, params) for p in prompts]
    for r in requests:
        r.timings.arrival = start
    while engine.has_unfinished:
        engine.step()
    return [r.timings for r in requests], start


def steady_decode_rate(token_times: list[list[float]]) -> float:
    """Tokens produced after every request had its first token, per second."""
    t0 = max(times[0] for times in token_times)
    t1 = max(times[-1] for times in token_times)
    produced = sum(sum(1 for t in times if t > t0) for times in token_times)
    return produced / (t1 - t0)


def measure(args: argparse.Namespace) -> dict:
    from transformers import AutoModelForCausalLM

    model_dir = script_model(args)
    quant = parse_quantization(args.quantization)
    log(f"model: {model_dir}  device: {args.device}  threads: {torch.get_num_threads()}  "
        f"quantization: {quant.value}")
    engine = LLMEngine.from_path(str(model_dir), EngineConfig(device=args.device, quantization=quant,
                                                             max_num_seqs=16))
    # On CUDA q8/q4k are bitsandbytes layers; generate() gets the same model class and dtype, unquantized.
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=engine.loaded.dtype)
    hf = hf.to(engine.loaded.device).eval()
    vocab = hf.config.vocab_size
    log("warming up")
    # One stream long enough for every decode shape's kernels: on CUDA the first
    # single-stream run loads them lazily and reads at a quarter of the warm rate.
    engine_run(engine, random_prompts(1, 32, vocab, 1), 32)
    engine_run(engine, random_prompts(2, 32, vocab, 1), 4)
    hf_generate(hf, random_prompts(1, 32, vocab, 1), 32)

    log("1/3 single stream: 128-token prompt, 64 new tokens")
    prompt = random_prompts(1, 128, vocab, 2)
    hf_times, _ = hf_generate(hf, prompt, 64)
    hf_single = (len(hf_times) - 1) / (hf_times[-1] - hf_times[0])
    timings, _ = engine_run(engine, prompt, 64)
    t = timings[0].token_times
    eng_single = (len(t) - 1) / (t[-1] - t[0])

    log(f"2/3 {args.streams} requests x 256-token prompts, 128 new tokens each")
    prompts = random_prompts(args.streams, 256, vocab, 3)
    hf_times, hf_start = hf_generate(hf, prompts, 128)
    hf_batch = args.streams * (len(hf_times) - 1) / (hf_times[-1] - hf_times[0])
    hf_wall = hf_times[-1] - hf_start
    timings, eng_start = engine_run(engine, prompts, 128)
    eng_batch = steady_decode_rate([tm.token_times for tm in timings])
    eng_wall = max(tm.token_times[-1] for tm in timings) - eng_start
    steps = engine.stats.steps

    log("3/3 TTFT, 512-token prompt (median of 3)")
    hf_ttft, eng_ttft = [], []
    for seed in range(3):
        p = random_prompts(1, 512, vocab - 1, 10 + seed)  # ids + 1 stay in the vocabulary
        times, start = hf_generate(hf, p, 1)
        hf_ttft.append(times[0] - start)
        timings, start = engine_run(engine, [[x + 1 for x in p[0]]], 1)  # no prefix-cache hit
        eng_ttft.append(timings[0].first_token - start)
    result = {
        "model_dir": str(model_dir), "device": args.device, "threads": torch.get_num_threads(),
        "dtype": str(engine.loaded.dtype),
        "quantization": quant.value, "weight_bytes": engine.loaded.weight_bytes,
        "single_stream_decode_tok_s": {"engine": eng_single, "generate": hf_single,
                                       "ratio": eng_single / hf_single},
        "batch_decode_tok_s": {"streams": args.streams, "engine": eng_batch, "generate_static": hf_batch,
                               "ratio": eng_batch / hf_batch,
                               "engine_vs_single_stream": eng_batch / eng_single},
        "batch_wall_s": {"engine": eng_wall, "generate_static": hf_wall},
        "ttft_512_s": {"engine": statistics.median(eng_ttft), "generate": statistics.median(hf_ttft),
                       "ratio": statistics.median(eng_ttft) / statistics.median(hf_ttft)},
        "engine_steps_total": steps,
    }
    return result


# llama.cpp on this machine (SPEC.md section 6, measured 2026-11-22 with 2 threads on
# the same model shape): quoted for comparison, not measured by this script.
LLAMA_CPP_REFERENCE = {"f16": ("F16", 34), "q8": ("Q8_0", 51), "q4k": ("Q4_K_M", 58)}
LLAMA_CPP_16_STREAMS = "160-166 tok/s (F16, 16 sequences)"


def report(r: dict) -> None:
    s, b, t = r["single_stream_decode_tok_s"], r["batch_decode_tok_s"], r["ttft_512_s"]
    print(f"single-stream decode  engine {s['engine']:7.2f} tok/s   generate() {s['generate']:7.2f} tok/s"
          f"   ratio {s['ratio']:.2f}x  (target >= 1.0x)")
    print(f"{b['streams']} streams, decode     engine {b['engine']:7.2f} tok/s   static generate() "
          f"{b['generate_static']:7.2f} tok/s   ratio {b['ratio']:.2f}x  (target >= 1.0x)")
    print(f"{b['streams']} streams vs single  engine {b['engine_vs_single_stream']:.1f}x  (target >= 12x)")
    w = r["batch_wall_s"]
    print(f"{b['streams']} streams wall time  engine {w['engine']:6.1f} s      static generate() "
          f"{w['generate_static']:6.1f} s")
    print(f"TTFT, 512-token prompt  engine {t['engine'] * 1000:7.1f} ms   generate() "
          f"{t['generate'] * 1000:7.1f} ms   ratio {t['ratio']:.2f}x  (target <= 1.1x)")
    if r["quantization"] in LLAMA_CPP_REFERENCE and r["device"] == "cpu":
        name, rate = LLAMA_CPP_REFERENCE[r["quantization"]]
        print(f"llama.cpp reference (SPEC.md section 6, not measured here): {name} batch-1 decode {rate} tok/s "
              f"-> engine at {s['engine'] / rate:.2f}x; 16 streams {LLAMA_CPP_16_STREAMS}")


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args()
    result = measure(args)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        report(result)


if __name__ == "__main__":
    main()
