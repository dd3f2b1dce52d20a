#!/usr/bin/env python
"""Build a tiny random-weight model directory (or the Qwen2.5-0.5B-shaped bench model).

    .venv/bin/python scripts/make_tiny_model.py --out tiny-models/tiny
    .venv/bin/python scripts/make_tiny_model.py --out tiny-models/bench --bench
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ruvllm_cli.testing.tiny_model import build_bench_model, build_tiny_model  # noqa: E402

SHAPE_FLAGS = {
    "hidden_size": 64,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path, help="directory to write the model into")
    parser.add_argument("--bench", action="store_true", help="Qwen2.5-0.5B-Instruct's shape (494M params)")
    parser.add_argument("--dtype", default=None, help="float32 (tiny default) or bfloat16 (bench default)")
    parser.add_argument("--seed", type=int, default=0)
    for name, default in SHAPE_FLAGS.items():
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, type=int, default=default, help=f"tiny model only (default {default})")
    parser.add_argument("--untied", action="store_true", help="separate lm_head (tiny model only)")
    parser.add_argument("--attention-bias", action="store_true", help="q/k/v/o biases (tiny model only)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    if args.bench:
        path = build_bench_model(args.out, dtype=args.dtype or "bfloat16", seed=args.seed)
    else:
        shape = {name: getattr(args, name) for name in SHAPE_FLAGS}
        path = build_tiny_model(
            args.out,
            **shape,
            tie_word_embeddings=not args.untied,
            attention_bias=args.attention_bias,
            dtype=args.dtype or "float32",
            seed=args.seed,
        )
    print(f"wrote {path} in {time.perf_counter() - started:.1f}s", file=sys.stderr)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
