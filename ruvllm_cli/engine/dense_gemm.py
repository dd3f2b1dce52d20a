"""Many activation rows through torch's float32 GEMM (MKL) on weights widened to
float32 a block of output rows at a time: what `Bf16Linear` (bfloat16 weights) and
`Int4Linear` (packed int4 codes) do with prompt chunks, where MKL's float32 GEMM ran
at 283-294 GFLOP/s here against 150-170 for oneDNN's bfloat16 one (docs/design.md,
section 22). Only a block's worth of widened weights exists at a time."""

from __future__ import annotations

from typing import Callable

import torch

from ruvllm_cli.engine.half import scratch_buffer

GEMM_ROWS = 64          # activation rows from which a layer takes this path
WIDEN_VALUES = 1 << 23  # weights widened at a time (32 MiB of float32 scratch)

# fill(first output row, rows, room [rows, K] float32) -> those weight rows in float32
Fill = Callable[[int, int, torch.Tensor], torch.Tensor]


def blockwise_gemm(rows: torch.Tensor, out_features: int, fill: Fill, block: int = 1) -> torch.Tensor:
    """rows [M, K] times the [out_features, K] weight that `fill` widens, float32 [M, N];
    blocks of output rows a multiple of `block` (the weights' own row blocking)."""
    k = rows.shape[1]
    step = max(block, WIDEN_VALUES // k // block * block)
    size = min(step, out_features) * k
    # The shared scratch is made under inference mode (the engine's steps); a call
    # outside it gets a buffer of its own.
    room = scratch_buffer(size) if torch.is_inference_mode_enabled() else torch.empty(size)
    wide = rows.float()
    out = torch.empty(rows.shape[0], out_features, dtype=torch.float32)
    for start in range(0, out_features, step):
        count = min(step, out_features - start)
        out[:, start:start + count] = wide @ fill(start, count, room[:count * k].view(count, k)).t()
    return out
