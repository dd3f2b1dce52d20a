#!/usr/bin/env python
"""What transformers' own continuous batching does here, beside our engine (docs/design.md).

1. Token identity: generate_batch() vs generate(), greedy, float32, on the tiny model.
2. Speed: 16 prompts of 256 tokens, 128 new tokens each, on the Qwen2.5-0.5B-shaped
   model in bf16: generate_batch() wall time and tok/s, beside ruvllm's engine.

    .venv/bin/python scripts/measure_hf_cb.py [--skip-speed]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, GenerationConfig  # noqa: E402

from ruvllm_cli.bench.runner import random_prompts  # noqa: E402
from ruvllm_cli.engine.config import EngineConfig  # noqa: E402
from ruvllm_cli.engine.engine import LLMEngine  # noqa: E402
from ruvllm_cli.engine.sampling import SamplingParams  # noqa: E402
from ruvllm_cli.quantization import Quantization  # noqa: E402
from ruvllm_cli.testing.tiny_model import cached_tiny_model  # noqa: E402


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    return random_prompts(range(10, vocab), n, length, random.Random(seed))


def greedy_config(new_tokens: int) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)


def identity(tmp: Path) -> None:
    model_dir = cached_tiny_model(tmp)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    batch = [p[: 5 + 9 * i] for i, p in enumerate(prompts(8, 80, 500, 0))]
    config = greedy_config(24)
    # No inference_mode here: generate_batch() runs its own thread and updates tensors
    # created outside it in place.
    with torch.no_grad():
        reference = [model.generate(torch.tensor([p]), generation_config=config)[0, len(p):].tolist()
                     for p in batch]
        outputs = model.generate_batch(batch, generation_config=config)
    got = sorted(outputs.values(), key=lambda o: batch.index(list(o.prompt_ids)))
    same = sum(o.generated_tokens == r for o, r in zip(got, reference))
    print(f"identity: generate_batch() equals generate() on {same}/{len(batch)} prompts (float32, greedy)")


def speed(cache: Path) -> None:
    torch.set_num_threads(2)
    model_dir = cached_tiny_model(cache, bench=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    batch = prompts(16, 256, model.config.vocab_size, 3)
    with torch.no_grad():
        model.generate_batch(prompts(2, 16, 1000, 1), generation_config=greedy_config(4))  # warm-up
        start = time.perf_counter()
        model.generate_batch(batch, generation_config=greedy_config(128))
        hf_wall = time.perf_counter() - start
    del model
    engine = LLMEngine.from_path(str(model_dir), EngineConfig(device="cpu", quantization=Quantization.F16))
    engine.generate(prompts(2, 16, 1000, 1), SamplingParams(max_tokens=4, temperature=0.0))
    start = time.perf_counter()
    engine.generate(batch, SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True))
    ours = time.perf_counter() - start
    total = 16 * 128
    print(f"speed, 16 x 256-token prompts, 128 new tokens, bf16, 2 threads: "
          f"generate_batch() {hf_wall:.1f} s ({total / hf_wall:.1f} tok/s), "
          f"ruvllm engine {ours:.1f} s ({total / ours:.1f} tok/s), ratio {hf_wall / ours:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--cache", default=str(Path.home() / ".cache" / "ruvllm-bench-models"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        identity(Path(tmp))
    if not args.skip_speed:
        speed(Path(args.cache))


if __name__ == "__main__":
    main()
