"""The int8-weight kernel (engine/kernels/int8_gemm.c) and its layer: exactly the
arithmetic it documents (activations in int8 blocks of 32, integer sums per block),
every tile and remainder path, on both GEMVs (AVX-512 VNNI and AVX2), and the fallback
where it does not run."""

from __future__ import annotations

import pytest
import torch

from ruvllm_cli.engine import kernels
from ruvllm_cli.engine.int8 import Int8Linear, int8_linear
from ruvllm_cli.engine.quantize import DynamicInt8Linear, WeightPlan, int8_rows
from ruvllm_cli.quantization import Quantization as Q

pytestmark = pytest.mark.skipif(not kernels.cpu_has(kernels.CPU_FLAGS), reason="needs AVX2 and FMA")


@pytest.fixture(scope="module", autouse=True)
def kernel_dir(tmp_path_factory):
    """The module's tests share one build, in a directory of their own."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RUVLLM_KERNEL_DIR", str(tmp_path_factory.mktemp("kernels")))
        kernels.int8_kernel.cache_clear()
        yield
    kernels.int8_kernel.cache_clear()


@pytest.fixture(autouse=True, params=["vnni", "avx2"])
def gemv(request, monkeypatch):
    """Every test on each GEMV: AVX-512 VNNI (where the CPU has it; oneDNN's int8 GEMM past
    32 rows) and AVX2 (every row count, as on a CPU without VNNI)."""
    kernel = kernels.int8_kernel()
    if request.param == "vnni" and not kernels.cpu_has(kernels.VNNI_CPU_FLAGS):
        pytest.skip("this CPU has no AVX-512 VNNI")
    if kernel is not None:
        vnni = request.param == "vnni"
        monkeypatch.setattr(kernel, "linear_few", kernel.linear_few_wide if vnni else kernel.linear_few_avx2)
        monkeypatch.setattr(kernel, "rows", kernel.FEW_ROWS if vnni else float("inf"))
    return request.param


def reference(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The layer's arithmetic: each activation row quantized symmetrically in float32
    (x * (127 / absmax), rounded half to even), exact integer sums, then
    float(sum) * (row scale * weight scale) (+ bias), each step rounded to float32."""
    amax = x.float().abs().amax(-1, keepdim=True)
    # (127 / amax would be amax.reciprocal() * 127 in torch: another rounding)
    inverse = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = (x.float() * inverse).round().clamp(-127, 127).long()
    sums = (q @ codes.long().t()).float()                               # exact: small integers
    out = sums * ((amax / 127) * scales[None, :])
    return out if bias is None else out + bias

# VNNI: GEMV to 4, groups of 8 to 32, oneDNN beyond; AVX2: groups of 4, 32 rows a pass
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 8, 9, 16, 17, 32, 33, 64, 70])
@pytest.mark.parametrize("out_features, in_features", [(64, 96), (37, 32), (130, 1024), (9, 160)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_its_documented_arithmetic(rows, out_features, in_features, bias):
    generator = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.1
    b = torch.randn(out_features, generator=generator) if bias else None
    codes, scales = int8_rows(weight)
    layer = int8_linear(codes, scales, b)
    assert isinstance(layer, Int8Linear)
    x = torch.randn(rows, in_features, generator=generator)
    x[-1] = 0.0                                                        # an all-zero row: scale 0
    got = layer(x)
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    assert torch.equal(got, reference(x, codes, scales, b))            # bit for bit
    # and close to the dense layer: int8 weights and 8-bit activations
    dense = torch.nn.functional.linear(x, weight, b)
    assert (got - dense).abs().max() <= 0.02 * dense.abs().max()


def test_other_activation_dtypes_come_back_in_their_dtype():
    codes, scales = int8_rows(torch.randn(16, 64))
    layer = int8_linear(codes, scales, None)
    x = torch.randn(2, 3, 64).bfloat16()
    out = layer(x)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 3, 16)
    expected = reference(x.float().reshape(6, 64), codes, scales, None).reshape(2, 3, 16)
    assert torch.equal(out, expected.bfloat16())


def test_a_code_of_minus_128_is_held_at_minus_127():
    """The GEMV negates weight codes by the activation's sign: -128 has no int8 negation."""
    codes = torch.full((4, 32), -128, dtype=torch.int8)
    layer = int8_linear(codes, torch.ones(4), None)
    assert int(layer.qweight.min()) == -127
    x = -torch.ones(1, 32)
    assert torch.equal(layer(x), torch.full((1, 4), 32 * 127.0))     # (-1) * (-127) * 32


def test_widths_the_kernel_cannot_take_go_to_fbgemm():
    codes, scales = int8_rows(torch.randn(8, 48))
    assert int8_linear(codes, scales, None) is None                   # in_features % 32
    plan = WeightPlan(Q.Q8_0, torch.float32, 48)
    assert isinstance(plan.linear(torch.randn(8, 48), None), DynamicInt8Linear)
    assert isinstance(plan.linear(torch.randn(8, 64), None), Int8Linear)


def test_without_the_kernel_q8_is_fbgemm_with_bfloat16_activations(monkeypatch):
    from ruvllm_cli.engine.loader import dtype_for

    monkeypatch.setenv(kernels.COMPILE_ENV, "0")
    kernels.int8_kernel.cache_clear()
    try:
        assert dtype_for(Q.Q8_0, torch.device("cpu")) == torch.bfloat16
        plan = WeightPlan(Q.Q8_0, torch.bfloat16, 64)
        assert not plan.own_int8 and plan.head_copy(8, 64)
        assert isinstance(plan.linear(torch.randn(8, 64), None), DynamicInt8Linear)
    finally:
        monkeypatch.delenv(kernels.COMPILE_ENV)
        kernels.int8_kernel.cache_clear()
    assert dtype_for(Q.Q8_0, torch.device("cpu")) == torch.float32


def test_a_rows_result_does_not_depend_on_its_batch():
    """Activations are quantized per row and summed exactly, so a row gives the same bits
    alone (our GEMV), in a batch of up to 32 (VNNI's GEMM) or in any batch (torch's int8
    GEMM); fbgemm's per-batch quantization did not."""
    generator = torch.Generator().manual_seed(7)
    codes, scales = int8_rows(torch.randn(75, 320, generator=generator))
    layer = int8_linear(codes, scales, None)
    x = torch.randn(70, 320, generator=generator)
    together = layer(x)
    for index in (0, 3, 4, 63, 64, 69):
        assert torch.equal(layer(x[index:index + 1])[0], together[index])
    assert torch.equal(layer(x[5:14]), together[5:14])
    assert torch.equal(layer(x[5:30]), together[5:30])   # VNNI: groups of eight, against oneDNN's sums


def test_without_vnni_every_row_count_stays_in_our_kernel(gemv, monkeypatch):
    """Without VNNI oneDNN's signed int8 GEMM is some 25x slower than a float32 GEMM (a
    128-token q8 prompt took 23 s on an AVX2 EPYC): a prompt's rows go through the AVX2
    GEMV a pass of 32 at a time, never through torch._int_mm."""
    if gemv == "vnni":
        pytest.skip("the VNNI form hands more than 32 rows to oneDNN")

    def refuse(*args):
        raise AssertionError("torch._int_mm called")
    monkeypatch.setattr(torch, "_int_mm", refuse)
    generator = torch.Generator().manual_seed(11)
    weight = torch.randn(96, 256, generator=generator)
    codes, scales = int8_rows(weight)
    layer = int8_linear(codes, scales, None)
    x = torch.randn(200, 256, generator=generator)   # six passes, the last of eight rows
    assert torch.equal(layer(x), reference(x, codes, scales, None))


def test_oneDNN_takes_many_rows_only_where_the_cpu_has_vnni():
    kernels.int8_kernel.cache_clear()   # a fresh instance, not the one the fixture patched
    try:
        kernel = kernels.int8_kernel()
        vnni = kernels.cpu_has(kernels.VNNI_CPU_FLAGS)
        assert kernel.wide == vnni and kernel.rows == (32 if vnni else float("inf"))
    finally:
        kernels.int8_kernel.cache_clear()


def test_no_rows_give_no_rows():
    codes, scales = int8_rows(torch.randn(64, 96))
    assert int8_linear(codes, scales, torch.randn(64))(torch.zeros(0, 96)).shape == (0, 64)
