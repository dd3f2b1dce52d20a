"""q4k prompt chunks through float32 GEMM on weights unpacked from torch's packed int4
layout (engine/int4_dense.py): the layout read off torch, the unpacking in C and in
torch, and Int4Linear's two paths against each other."""

from __future__ import annotations

import pytest
import torch

from ruvllm_cli.engine import int4_dense
from ruvllm_cli.engine.dense_gemm import GEMM_ROWS
from ruvllm_cli.engine.int4_dense import dense_weight, packed_layout
from ruvllm_cli.engine.quantize import INT4_INNER_K_TILES, Int4Linear, int4_kernel_params

pytestmark = pytest.mark.skipif(packed_layout(INT4_INNER_K_TILES) is None,
                                reason="torch's packed int4 layout here is not one int4_dense reads")


def packed_matrix(n: int, k: int, group: int, seed: int = 0):
    """Random codes, scales and zeros; packed as Int4Linear packs them, and the float32
    weight they stand for."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=generator)
    scales = torch.rand(n, k // group, generator=generator) * 0.1
    lows = torch.rand(n, k // group, generator=generator) - 0.5
    sz = int4_kernel_params(scales, lows)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, INT4_INNER_K_TILES)
    s, z = sz[..., 0].float().t().repeat_interleave(group, 1), sz[..., 1].float().t().repeat_interleave(group, 1)
    return packed, sz, (codes.float() - 8) * s + z


@pytest.mark.parametrize("with_c", [True, False])
def test_unpacked_rows_are_the_weights_the_codes_stand_for(with_c, monkeypatch):
    if not with_c:
        monkeypatch.setattr(int4_dense, "int4_unpack_kernel", lambda: None)
    layout = packed_layout(INT4_INNER_K_TILES)
    n, k, group = 4 * layout.block, 256, 64
    packed, sz, expected = packed_matrix(n, k, group)
    start, rows = layout.block, 2 * layout.block
    out = dense_weight(packed, sz, group, start, rows, layout, torch.empty(rows, k))
    assert torch.allclose(out, expected[start:start + rows], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rows", [GEMM_ROWS, 130])
def test_a_prompt_chunk_gives_what_torchs_int4_kernel_gives(rows, monkeypatch):
    torch.manual_seed(rows)
    linear = torch.nn.Linear(512, 320, bias=True)
    layer = Int4Linear(linear, group_size=128)
    x = torch.randn(rows, 512).bfloat16()
    kernel = layer(x).float()                  # outside inference mode: torch's kernel
    calls = []
    dense_linear = int4_dense.dense_linear
    monkeypatch.setattr(int4_dense, "dense_linear", lambda *args: calls.append(1) or dense_linear(*args))
    with torch.inference_mode():
        dense = layer(x).float()               # inside (the engine's steps): the dense path
        layer(x[:GEMM_ROWS - 1])              # fewer rows: torch's kernel
    assert len(calls) == 1
    assert (dense - kernel).abs().max().item() <= 0.02 * kernel.abs().max().item()
