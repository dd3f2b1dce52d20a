#!/usr/bin/env python
"""The linear layers of one decode step, alone: Qwen2.5-0.5B's 169 weight shapes
(24 x q/k/v/o/gate/up/down + the LM head), random bf16 weights, run in model order
so that every weight streams from memory as in a real step.

Prints ms per step at 1 and 16 rows for nn.Linear and the oneDNN-packed layer (and,
with --quantized, the q8 layers (fbgemm's and ruvllm's own int8 kernel, engine/int8.py)
and q4k's; with --half, float16 weights in ruvllm's own
kernel, engine/half.py), the 16-row / 1-row cost ratio (which bounds the
aggregate/single-stream decode ratio), and one layer's GFLOP/s with its weight
resident in cache, for the compute ceiling. --dtype float32 runs the plain and packed
layers in float32 (the only packed path on a CPU without oneDNN bfloat16 kernels).

    .venv/bin/python scripts/bench_linear_shapes.py [--threads 2] [--quantized] [--half] [--dtype float32]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from ruvllm_cli.engine.half import half_linear  # noqa: E402
from ruvllm_cli.engine.int8 import int8_linear  # noqa: E402
from ruvllm_cli.engine.quantize import DynamicInt8Linear, Int4Linear, PackedLinear, int8_rows  # noqa: E402
from ruvllm_cli.testing.tiny_model import QWEN25_05B_SHAPE as SHAPE  # noqa: E402

HIDDEN, INTERMEDIATE, VOCAB, LAYERS = (SHAPE[k] for k in ("hidden_size", "intermediate_size", "vocab_size",
                                                          "num_layers"))
KV = SHAPE["num_kv_heads"] * HIDDEN // SHAPE["num_heads"]  # key/value projection width


def shapes() -> list[tuple[int, int]]:
    layer = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN),
             (INTERMEDIATE, HIDDEN), (INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]
    return layer * LAYERS + [(VOCAB, HIDDEN)]


def step_ms(layers: list[nn.Module], rows: int, repeats: int, dtype: torch.dtype) -> tuple[float, float]:
    """(ms for the layers without the head, ms for the head) per step."""
    inputs = {k: torch.randn(rows, k, dtype=dtype) for k in (HIDDEN, INTERMEDIATE)}
    body, head = 0.0, 0.0
    for attempt in range(repeats + 1):
        start = time.perf_counter()
        for layer in layers[:-1]:
            layer(inputs[layer.in_features])
        middle = time.perf_counter()
        layers[-1](inputs[HIDDEN])
        end = time.perf_counter()
        if attempt:  # the first pass warms up
            body += middle - start
            head += end - middle
    return body / repeats * 1000, head / repeats * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--quantized", action="store_true", help="also q8 (fbgemm int8) and q4k (int4pack)")
    parser.add_argument("--half", action="store_true", help="also float16 weights in ruvllm's kernel")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--rows", default="1,16", help="row counts to time, comma-separated (first and last "
                        "give the cost ratio)")
    args = parser.parse_args()
    row_counts = [int(r) for r in args.rows.split(",")]
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with torch.inference_mode():
        plain = [nn.Linear(k, n, bias=False, dtype=dtype) for n, k in shapes()]
        packed = [PackedLinear(layer) for layer in plain]
        flops = 2 * sum(n * k for n, k in shapes()[:-1])
        results = {}
        kinds = [("nn.Linear", lambda: plain), ("packed", lambda: packed)]
        if args.quantized:
            kinds += [("q8 int8", lambda: [DynamicInt8Linear(layer) for layer in plain]),
                      ("q8 ours", lambda: [int8_linear(*int8_rows(layer.weight), None) for layer in plain]),
                      ("q4k int4", lambda: [Int4Linear(layer) for layer in plain])]
        if args.half:
            kinds += [("f16 ours", lambda: [half_linear(layer.weight, None) for layer in plain])]
        for name, build in kinds:
            layers = build()
            for rows in row_counts:
                body, head = step_ms(layers, rows, args.repeats, dtype)
                results[name, rows] = body + head
                print(f"{name:9s} {rows:3d} rows: layers {body:7.1f} ms + LM head {head:6.1f} ms"
                      f"  ({rows * flops / body / 1e6:5.0f} GFLOP/s in the layers)")
            del layers
            low, high = row_counts[0], row_counts[-1]
            print(f"{name:9s} {high} rows cost {results[name, high] / results[name, low]:.2f}x {low}: "
                  f"aggregate/single-stream decode bounded near "
                  f"{high / low * results[name, low] / results[name, high]:.1f}x")
        layer = packed[4]  # 4864 x 896, 8.7 MB: fits the L3 cache
        x = torch.randn(16, HIDDEN, dtype=dtype)
        for _ in range(20):
            layer(x)
        start = time.perf_counter()
        for _ in range(200):
            layer(x)
        seconds = (time.perf_counter() - start) / 200
        print(f"packed 4864x896, 16 rows, weight in cache: {seconds * 1e3:.3f} ms = "
              f"{16 * 2 * INTERMEDIATE * HIDDEN / seconds / 1e9:.0f} GFLOP/s")


if __name__ == "__main__":
    main()
