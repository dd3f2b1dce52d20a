"""q4k layers beside torch's int4 kernel (engine/int4_dense.py): the layout read off
torch; prompt chunks through float32 GEMM on weights unpacked in C and in torch (where
no kernel of ours reads torch's layout); every call through our own kernel where it
runs: kernels/int4_gemm.c on torch's AVX-512 layout (bfloat16 activations, float32
sums), int4_gemm_avx2.c on its AVX2 one (activations quantized to int8 per weight
group, exact integer sums)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from ruvllm_cli.engine import int4_dense, kernels
from ruvllm_cli.engine.dense_gemm import GEMM_ROWS
from ruvllm_cli.engine.int4_dense import dense_weight, packed_layout
from ruvllm_cli.engine.quantize import INT4_INNER_K_TILES, Int4Linear, int4_kernel_params

pytestmark = pytest.mark.skipif(packed_layout(INT4_INNER_K_TILES) is None,
                                reason="torch's packed int4 layout here is not one int4_dense reads")


def packed_matrix(n: int, k: int, group: int, seed: int = 0, codes_too: bool = False):
    """Random codes, scales and zeros; packed as Int4Linear packs them, and the float32
    weight they stand for (and the codes, with `codes_too`)."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=generator)
    scales = torch.rand(n, k // group, generator=generator) * 0.1
    lows = torch.rand(n, k // group, generator=generator) - 0.5
    sz = int4_kernel_params(scales, lows)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, INT4_INNER_K_TILES)
    s, z = sz[..., 0].float().t().repeat_interleave(group, 1), sz[..., 1].float().t().repeat_interleave(group, 1)
    return (packed, sz, (codes.float() - 8) * s + z) + ((codes,) if codes_too else ())


def avx2_packed(codes: torch.Tensor) -> torch.Tensor:
    """Codes [N, K] as torch packs them under AVX2 (the layout int4_gemm_avx2.c reads):
    [N / 32, K, 16] bytes, byte j of a k holding row j of the block in its low nibble and
    row 16 + j in its high one."""
    n, k = codes.shape
    blocks = codes.to(torch.uint8).view(n // 32, 32, k).transpose(1, 2)
    return (blocks[..., :16] | (blocks[..., 16:] << 4)).contiguous().view(n, k // 2)


def int8_rows(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] bfloat16 as int4_gemm_avx2.c quantizes it: codes [M, K] (-127..127, as
    float32) and one scale a row and group [M, K / group], absmax / 127, in float32 as C
    computes them (round half to even)."""
    m, k = x.shape
    groups = x.float().view(m, k // group, group)
    amax = groups.abs().amax(-1)
    # C's float32 divisions, correctly rounded (through float64: exact here); torch's own
    # float32 `127 / amax` is a last bit off now and then, which moves a code at x * inverse
    # = n + 0.5 by one.
    inverse = torch.where(amax > 0, (127 / amax.double()).float(), torch.zeros_like(amax))
    return (groups * inverse.unsqueeze(-1)).round().view(m, k), (amax.double() / 127).float()


def int8_reference(x: torch.Tensor, codes: torch.Tensor, sz: torch.Tensor, group: int) -> torch.Tensor:
    """What int4_gemm_avx2.c computes, in float64: each group's integer sum of the weight
    codes times the activation codes, times scale * dx, plus (zero - 8 * scale) times the
    group's sum of x."""
    q, dx = int8_rows(x, group)
    (m, k), n = x.shape, codes.shape[0]
    scale, zero = sz[..., 0].double().t(), sz[..., 1].double().t()           # [N, groups]
    sums = torch.einsum("mgk,ngk->mng", q.double().view(m, k // group, group),
                        codes.double().view(n, k // group, group))
    totals = x.double().view(m, k // group, group).sum(-1)                    # [M, groups]
    return (sums * (scale * dx.double().unsqueeze(1)) + (zero - 8 * scale) * totals.unsqueeze(1)).sum(-1)


def kernel_linear(kernel, x, packed, sz, group, bias):
    """One call of an int4 kernel (int4_dense.own_linear's, with the kernel named)."""
    rows, k = x.shape
    out = torch.empty(rows, packed.shape[0], dtype=torch.bfloat16)
    room = torch.empty(int4_dense.scratch_floats(rows, k, group))
    kernel.linear(x.data_ptr(), rows, k, packed.data_ptr(), packed.shape[0], sz.data_ptr(), group,
                  None if bias is None else bias.data_ptr(), out.data_ptr(), room.data_ptr(), torch.get_num_threads())
    return out


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
    """Where no int4 kernel of ours reads torch's layout, the dense path."""
    monkeypatch.setattr(int4_dense, "own_kernel", lambda: None)
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



own = pytest.mark.skipif(int4_dense.own_linear(torch.zeros(1, 64, dtype=torch.bfloat16), *packed_matrix(64, 64, 32)[:2],
                                               32, None) is None,
                         reason="no int4 kernel of ours here (AVX2 or AVX-512, torch's layout, a C compiler)")


@own
@pytest.mark.parametrize(("n", "k", "group", "bias"), [(320, 512, 128, True), (64, 896, 32, False),
                                                         (128, 256, 64, True), (192, 4864 // 2, 32, False)])
def test_our_int4_kernel_gives_torchs_sums_and_each_row_the_same_bits_in_any_batch(n, k, group, bias):
    """Our int4 kernel for torch's layout here (int4_gemm.c or int4_gemm_avx2.c) against
    the float64 sum of the weights the codes stand for (within a
    bfloat16 step of torch's kernel), and each row's result the same bits alone as in a
    batch of any size: up to six rows straight from the codes, seven and more through the tile,
    strips of 64 rows and a cut one, groups of 32, 64 and 128."""
    torch.manual_seed(n + k)
    packed, sz, weight = packed_matrix(n, k, group, seed=n)
    b = torch.randn(n).bfloat16() if bias else None
    x = torch.randn(150, k).bfloat16() * 3
    x[1, :7] = 0
    alone = [int4_dense.own_linear(x[i:i + 1], packed, sz, group, b) for i in range(len(x))]
    exact = x.double() @ weight.double().t()
    if bias:
        exact = exact.bfloat16().double() + b.double()
    # int4_gemm_avx2.c's int8 activations move a sum by up to about 0.6% of the largest
    # (measured: 0.37-0.58%); float32 ones by float32 rounding alone.
    int8 = int4_dense.own_kernel().block == 32
    for rows in (1, 2, 3, 4, 5, 6, 7, 16, 33, 63, 64, 150):
        ours = int4_dense.own_linear(x[:rows], packed, sz, group, b)
        assert ours.dtype == torch.bfloat16 and ours.shape == (rows, n)
        for i in range(rows):
            assert torch.equal(ours[i].view(torch.int16), alone[i][0].view(torch.int16)), (rows, i)
        reference = torch.ops.aten._weight_int4pack_mm_for_cpu(x[:rows], packed, group, sz)
        if bias:
            reference = reference + b
        scale = exact[:rows].abs().max().item()
        assert (ours.double() - exact[:rows]).abs().max().item() <= 2.0 ** (-6 if int8 else -8) * scale
        assert (ours.float() - reference.float()).abs().max().item() <= 2.0 ** (-6 if int8 else -7) * scale


@pytest.mark.skipif(kernels.int4_avx2_kernel() is None, reason="no AVX2 kernel here (AVX2, FMA and a C compiler)")
@pytest.mark.parametrize(("n", "k", "group", "bias"), [(320, 512, 128, True), (64, 896, 32, False),
                                                         (96, 256, 64, True), (192, 4864 // 2, 32, False)])
def test_the_avx2_kernel_sums_each_groups_int8_codes_and_gives_each_row_the_same_bits_in_any_batch(n, k, group,
                                                                                                     bias):
    """int4_gemm_avx2.c on torch's AVX2 layout (packed here as torch packs it there):
    what its arithmetic says, in float64 (`int8_reference`: a scale per row and group,
    so a group of outliers leaves the others' codes fine), within the bfloat16 rounding
    of its output; the float64 sum of the weights within int8's rounding; each row the
    same bits alone as in a batch of any size (one row's whole block, both halves of a
    block straight from the codes, the tile, strips)."""
    torch.manual_seed(n + k)
    packed, sz, weight, codes = packed_matrix(n, k, group, seed=n, codes_too=True)
    ours = avx2_packed(codes)
    b = torch.randn(n).bfloat16() if bias else None
    x = torch.randn(150, k).bfloat16() * 3
    x[1, :7] = 0
    x[2, group:2 * group] *= 1000                 # one group of outliers
    kernel = kernels.int4_avx2_kernel()
    alone = [kernel_linear(kernel, x[i:i + 1], ours, sz, group, b) for i in range(len(x))]
    expected = int8_reference(x, codes, sz, group)     # without the bias: one rounding
    exact = x.double() @ weight.double().t()
    if bias:
        exact = exact.bfloat16().double() + b.double()
    scale = exact.abs().amax(-1, keepdim=True)           # each row's own
    for rows in (1, 2, 3, 4, 5, 6, 7, 12, 16, 33, 63, 64, 150):
        out = kernel_linear(kernel, x[:rows], ours, sz, group, b)
        for i in range(rows):
            assert torch.equal(out[i].view(torch.int16), alone[i][0].view(torch.int16)), (rows, i)
        assert ((out.double() - exact[:rows]).abs() <= 2.0 ** -6 * scale[:rows]).all(), rows
        plain = kernel_linear(kernel, x[:rows], ours, sz, group, None).double()
        # half a bfloat16 step of each output, and float32 sums' rounding
        bound = 2.0 ** -8 * expected[:rows].abs() + 2.0 ** -14 * scale[:rows]
        assert ((plain - expected[:rows]).abs() <= bound).all(), rows


AVX2_PROCESS = r"""
import json, sys, torch
from ruvllm_cli.engine import int4_dense, kernels
from ruvllm_cli.engine.loader import load_model
from ruvllm_cli.quantization import Quantization
from tests.engine.test_int4_dense import avx2_packed
from tests.engine.test_stream_load import _logits
codes = torch.randint(0, 16, (64, 128), dtype=torch.int32)
layout = torch.equal(torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2), avx2_packed(codes))
loaded = load_model(sys.argv[1], "cpu", Quantization.Q4_K_M, use_cache=False)
with torch.inference_mode():
    exact = _logits(load_model(sys.argv[1], "cpu", Quantization.F32, use_cache=False).model)
    ours = _logits(loaded.model)
    int4_dense.own_kernel = lambda: None     # torch's int4pack kernel for every call
    theirs = _logits(loaded.model)
rms = lambda t: t.pow(2).mean().sqrt().item()
print(json.dumps({"layout": layout, "path": loaded.quantization_path, "wide": kernels.decode_kernel().wide,
                  "ours": rms(ours - exact) / rms(exact), "theirs": rms(theirs - exact) / rms(exact),
                  "apart": rms(ours - theirs) / rms(theirs)}))
"""


@pytest.mark.skipif(kernels.int4_avx2_kernel() is None, reason="no AVX2 kernel here (AVX2, FMA and a C compiler)")
def test_a_process_where_torch_packs_for_avx2_runs_the_avx2_kernel(make_tiny_model):
    """Under torch's AVX2 dispatch (an AVX2-only laptop's, or ATEN_CPU_CAPABILITY=avx2),
    torch packs as `avx2_packed` does, the load line names the AVX2 kernel, and a q4k
    model's logits through it are about as far from the float32 model's as torch's own
    int4 kernel's (its int8 activations add to q4k's error: 0.313 against 0.309 of the
    logits' RMS, measured); our other kernels
    take their AVX2 forms under RUVLLM_MAX_CPU_ISA=avx2."""
    from tests.engine.test_stream_load import VARIANTS

    path = make_tiny_model(**VARIANTS["untied-bias-bf16"])
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2", **{kernels.ISA_ENV: "avx2"})
    done = subprocess.run([sys.executable, "-c", AVX2_PROCESS, str(path)], env=env, capture_output=True, text=True,
                          timeout=300, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["layout"] is True and result["wide"] == 0
    assert result["path"].endswith("; int4 layers in ruvllm's AVX2 kernel (int8 activations)")
    assert result["ours"] <= 1.1 * result["theirs"] and result["apart"] <= 0.2, result


@own
def test_int4_linear_takes_our_kernel_for_every_row_count(monkeypatch):
    layer = Int4Linear(torch.nn.Linear(128, 64, bias=True), group_size=32)
    calls = []
    ours = int4_dense.own_linear
    monkeypatch.setattr("ruvllm_cli.engine.quantize.own_linear", lambda *a: calls.append(len(a[0])) or ours(*a))
    x = torch.randn(2, 8, 128).bfloat16()
    assert layer(x).shape == (2, 8, 64)          # 16 rows, batch dimensions kept
    assert torch.equal(layer(x[0, :1]), ours(x[0, :1], layer.qweight, layer.scales_and_zeros, 32, layer.bias.data))
    assert calls == [16, 1]


@own
def test_shapes_our_kernel_does_not_take_stay_with_torchs():
    """Output widths that are not whole blocks of torch's rows fall back to its kernel."""
    torch.manual_seed(3)
    layer = Int4Linear(torch.nn.Linear(128, 80, bias=True), group_size=32)   # 80 % 64, 80 % 32 != 0
    x = torch.randn(8, 128).bfloat16()
    assert int4_dense.own_linear(x, layer.qweight, layer.scales_and_zeros, 32, None) is None
    reference = torch.ops.aten._weight_int4pack_mm_for_cpu(x, layer.qweight, 32, layer.scales_and_zeros) + layer.bias
    assert torch.equal(layer(x), reference)


def test_the_load_line_names_the_kernels_this_machine_runs_not_the_cached_ones(make_tiny_model, tmp_path,
                                                                              monkeypatch):
    """Which kernel q4k's (and q8's) layers take is this machine's choice, said at each
    load; the weight cache keeps the layout alone (a description cached before named a
    kernel)."""
    from ruvllm_cli.engine import weight_cache
    from ruvllm_cli.engine.loader import load_model
    from ruvllm_cli.quantization import Quantization
    from tests.engine.test_stream_load import VARIANTS

    monkeypatch.setenv(weight_cache.ENV, "1")
    path = tmp_path / "model"
    shutil.copytree(make_tiny_model(**VARIANTS["untied-bias-bf16"]), path)
    ours = int4_dense.own_runs()
    first = load_model(path, "cpu", Quantization.Q4_K_M)
    kernel = (("ruvllm's AVX-512 kernel" if int4_dense.own_kernel().block == 64
               else "ruvllm's AVX2 kernel (int8 activations)") if ours else "torch's int4pack kernel")
    assert first.quantization_path.endswith(f"; int4 layers in {kernel}")
    assert "(torch's int4pack layout)" in first.quantization_path
    cached = weight_cache.cache_file(path, Quantization.Q4_K_M)
    assert b"int4 layers in" not in cached.read_bytes()[:100_000]
    monkeypatch.setattr(int4_dense, "own_kernel", lambda: None)     # a machine without ours
    read = weight_cache.load

    def written_before(new: str, old: str) -> None:   # its cache written before the note
        monkeypatch.setattr(weight_cache, "load", lambda *args: (
            None if (found := read(*args)) is None else (found[0], found[1].replace(new, old))))

    written_before("(torch's int4pack layout)", "(torch int4pack kernel)")
    second = load_model(path, "cpu", Quantization.Q4_K_M)
    assert second.from_weight_cache
    assert second.quantization_path == (first.quantization_path.replace(kernel, "torch's int4pack kernel")
                                        + "; read from the quantized-weight cache")
    # q8's GEMV the same way (AVX-512 VNNI or AVX2: the same codes and bits).
    from ruvllm_cli.engine.kernels import VNNI_CPU_FLAGS, cpu_has, int8_kernel

    if int8_kernel() is not None:
        q8 = load_model(path, "cpu", Quantization.Q8_0)
        gemv = ("up to 32 rows in its AVX-512 VNNI GEMV and GEMM" if cpu_has(VNNI_CPU_FLAGS)
                else "every row count in its AVX2 GEMV, 32 rows a pass")
        assert q8.quantization_path.startswith("int8 per-channel weights in ruvllm's kernel, ")
        assert q8.quantization_path.endswith(f"; {gemv}")
        written_before("in ruvllm's kernel, ", "in ruvllm's AVX2 kernel, ")
        again = load_model(path, "cpu", Quantization.Q8_0)
        assert again.quantization_path == q8.quantization_path + "; read from the quantized-weight cache"


@own
def test_no_rows_give_no_rows():
    packed, sz, _ = packed_matrix(64, 128, 32)
    out = int4_dense.own_linear(torch.zeros(0, 128, dtype=torch.bfloat16), packed, sz, 32, None)
    assert out.shape == (0, 64)
