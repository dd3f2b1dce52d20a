#!/usr/bin/env python
"""Write random peft LoRA adapters for a model directory (benchmarks, trying --lora).

    .venv/bin/python scripts/make_lora.py MODEL_DIR --out loras --count 3 --rank 16

Each adapter targets every projection (q/k/v/o, gate/up/down) unless --targets says
otherwise; A and B are random (peft's init_lora_weights=False), so each adapter
really changes the model's output. Seeds 0..count-1 give the adapters loras/lora0, ...
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ruvllm_cli.testing.tiny_lora import ATTENTION, MLP, build_lora_adapter  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path, help="the base model's directory")
    parser.add_argument("--out", type=Path, required=True, help="directory that receives lora0, lora1, ...")
    parser.add_argument("--count", type=int, default=1)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--alpha", type=float, default=32.0)
    parser.add_argument("--targets", default=",".join(ATTENTION + MLP), help="comma-separated module names")
    args = parser.parse_args(argv)
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    for index in range(args.count):
        started = time.perf_counter()
        path = build_lora_adapter(args.model, args.out / f"lora{index}", rank=args.rank, alpha=args.alpha,
                                  targets=targets, seed=index)
        print(f"{path} (rank {args.rank}, {', '.join(targets)}) in {time.perf_counter() - started:.1f} s",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
