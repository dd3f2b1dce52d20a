#!/usr/bin/env python
"""The CUDA paths beside their references, on a tiny random model: a check to run
where a GPU is lent (CI has none). For each of f16, q8 and q4k (bitsandbytes 8-bit
and 4-bit NF4 on CUDA), greedy tokens of the engine (all prompts in one batch) against
transformers' generate() on the same weights and quantization config (each prompt
alone); then a LoRA adapter on each, against peft's generate(). Prints one line per
check with the share of identical tokens; exits 1 if a check fails outright.

    .venv/bin/python scripts/gpu_check.py [--tokens 24] [--cold-decode]

--cold-decode also times single-stream decode on the Qwen2.5-0.5B-shaped model at
prompt lengths the process has not seen, with SDPA's cuDNN backend allowed and left
out (model_runner.sdpa_backends), alternating (docs/design.md, section 18).

Token identity is expected for f16 and the LoRA rows; with bitsandbytes the batched
and single kernels may round differently, so a near-tie can flip a token and the
rest of that sequence follows another path: the share, not an assertion, is printed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from ruvllm_cli.engine.config import EngineConfig  # noqa: E402
from ruvllm_cli.engine.engine import LLMEngine  # noqa: E402
from ruvllm_cli.engine.loader import _bitsandbytes_options, load_model, select_device  # noqa: E402
from ruvllm_cli.engine.sampling import SamplingParams  # noqa: E402
from ruvllm_cli.engine.request import RequestOptions  # noqa: E402
from ruvllm_cli.quantization import Quantization  # noqa: E402
from ruvllm_cli.testing.tiny_lora import build_lora_adapter  # noqa: E402
from ruvllm_cli.testing.tiny_model import build_tiny_model  # noqa: E402

PROMPTS = [[5, 17, 29, 41, 53, 65, 77, 89], [11, 12, 13], [200, 150, 100, 50, 25, 12], [7] * 20]


def engine_tokens(engine: LLMEngine, tokens: int, adapter: str | None = None) -> list[list[int]]:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    options = RequestOptions(adapter=adapter)
    requests = [engine.add_request(p, params, options=options) for p in PROMPTS]
    while engine.has_unfinished:
        engine.step()
    return [r.output_ids for r in requests]


def reference_model(model_dir: Path, quantization: Quantization, dtype: torch.dtype, adapter: Path | None):
    from transformers import AutoModelForCausalLM

    device = select_device("cuda")
    extra = _bitsandbytes_options(quantization, device)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **extra)
    if not extra:
        model.to(device)
    if adapter is not None:
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, adapter)
    return model.eval()


def reference_tokens(model, tokens: int) -> list[list[int]]:
    out = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt], device="cuda")
        with torch.inference_mode():
            gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=tokens, min_new_tokens=tokens, eos_token_id=None,
                                 pad_token_id=0)
        out.append(gen[0, len(prompt):].tolist())
    return out


def same_share(a: list[list[int]], b: list[list[int]]) -> tuple[int, int, int]:
    """(identical tokens before each sequence's first difference, total, sequences identical)."""
    prefix = 0
    for x, y in zip(a, b):
        n = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        prefix += n
    return prefix, sum(len(x) for x in a), sum(x == y for x, y in zip(a, b))


def check(model_dir: Path, adapter_dir: Path, quantization: Quantization, tokens: int) -> bool:
    loaded = load_model(model_dir, "cuda", quantization, use_cache=False)
    engine = LLMEngine(loaded, EngineConfig(device="cuda", quantization=quantization))
    engine.add_lora("a", adapter_dir)
    ok = True
    for adapter in (None, "a"):
        ours = engine_tokens(engine, tokens, adapter)
        ref = reference_model(model_dir, quantization, loaded.dtype, adapter_dir if adapter else None)
        theirs = reference_tokens(ref, tokens)
        prefix, total, whole = same_share(ours, theirs)
        label = f"{quantization.value:5s} {'lora' if adapter else 'base':4s} {loaded.quantization_path}"
        print(f"{label:60s} identical prefix {prefix}/{total} tokens, {whole}/{len(PROMPTS)} sequences whole")
        ok = ok and all(len(x) == tokens for x in ours)
        del ref
    del engine, loaded
    torch.cuda.empty_cache()
    return ok


def cold_decode() -> None:
    """Single-stream tok/s at new prompt lengths: cuDNN builds a plan per key length."""
    import contextlib

    from ruvllm_cli.bench.harness import BENCH_MODEL_CACHE
    from ruvllm_cli.engine import model_runner
    from ruvllm_cli.testing.tiny_model import cached_tiny_model

    model = cached_tiny_model(BENCH_MODEL_CACHE, bench=True)
    engine = LLMEngine.from_path(str(model), EngineConfig(device="cuda", quantization=Quantization.F16))
    without_cudnn = model_runner.sdpa_backends
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for index, length in enumerate((130, 400, 600, 900, 1200, 1500)):
        cudnn = index % 2 == 0
        model_runner.sdpa_backends = (lambda device: contextlib.nullcontext()) if cudnn else without_cudnn
        request = engine.add_request(list(range(1000 * index + 100, 1000 * index + 100 + length)), params)
        while engine.has_unfinished:
            engine.step()
        t = request.timings.token_times
        print(f"cold single stream, {length:5d}-token prompt, cuDNN {'allowed' if cudnn else 'left out':8s}: "
              f"{(len(t) - 1) / (t[-1] - t[0]):6.1f} tok/s")
    model_runner.sdpa_backends = without_cudnn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--cold-decode", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device here")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    root = Path(tempfile.mkdtemp(prefix="ruvllm-gpu-check-"))
    model_dir = build_tiny_model(root / "model", hidden_size=128, num_heads=4, num_kv_heads=2)
    adapter_dir = build_lora_adapter(model_dir, root / "lora", rank=8, alpha=16, seed=1)
    ok = all([check(model_dir, adapter_dir, q, args.tokens)
              for q in (Quantization.F16, Quantization.Q8_0, Quantization.Q4_K_M)])
    if args.cold_decode:
        cold_decode()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
