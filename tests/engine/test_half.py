"""The float16-weight kernel (engine/kernels/half_gemm.c) and its modules."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from ruvllm_cli.engine import kernels
from ruvllm_cli.engine.half import HalfEmbedding, half_linear, to_half

pytestmark = pytest.mark.skipif(not kernels.cpu_has(kernels.HALF_CPU_FLAGS), reason="needs AVX2, FMA and F16C")


@pytest.fixture(autouse=True)
def fresh_kernel(tmp_path, monkeypatch):
    """Each test builds (or finds) the kernel in a cache of its own."""
    monkeypatch.setenv("RUVLLM_CACHE_DIR", str(tmp_path / "cache"))
    kernels.half_kernel.cache_clear()
    yield
    kernels.half_kernel.cache_clear()


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 33])
@pytest.mark.parametrize("out_features, in_features", [(64, 64), (37, 96), (6, 8), (130, 1024)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_float32_arithmetic_on_the_float16_weights(rows, out_features, in_features, bias):
    generator = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.1
    b = torch.randn(out_features, generator=generator) if bias else None
    layer = half_linear(weight, b)
    assert layer is not None
    x = torch.randn(2, rows, in_features, generator=generator)
    expected = F.linear(x, weight.half().float(), b)
    got = layer(x)
    assert got.shape == (2, rows, out_features) and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_other_activation_dtypes_are_widened_first():
    weight = torch.randn(16, 32)
    layer = half_linear(weight, None)
    x = torch.randn(3, 32).bfloat16()
    torch.testing.assert_close(layer(x), F.linear(x.float(), weight.half().float()), rtol=1e-5, atol=1e-5)


def test_widths_the_kernel_cannot_take_and_values_beyond_float16_are_refused():
    assert half_linear(torch.randn(8, 12), None) is None             # in_features % 8
    assert half_linear(torch.full((8, 16), 1e6), None) is None        # float16 overflows
    assert to_half(torch.tensor([1.0, float("inf")])) is not None     # an infinity that was there stays


def test_a_bfloat16_weight_converts_exactly_within_float16s_normal_range():
    weight = (torch.randn(64, 64) * 0.05).bfloat16().float()
    half = to_half(weight).float()
    normal = weight.abs() >= 2.0 ** -14
    assert torch.equal(half[normal], weight[normal])
    assert (half - weight).abs().max() <= 2.0 ** -25                # below it: float16's subnormal step


def test_embedding_rows_come_out_float32():
    table = torch.randn(10, 8).half()
    embedding = HalfEmbedding(table, padding_idx=None)
    out = embedding(torch.tensor([[3, 1, 3]]))
    assert out.dtype == torch.float32 and torch.equal(out[0, 0], table[3].float())


def test_built_once_into_the_cache_and_loaded_after(tmp_path, capfd):
    assert kernels.half_kernel() is not None
    assert "building ruvllm's float16 kernel" in capfd.readouterr().err
    built = list((tmp_path / "cache" / "kernels").glob("half_gemm-*.so"))
    assert len(built) == 1
    kernels.half_kernel.cache_clear()
    assert kernels.half_kernel() is not None
    assert capfd.readouterr().err == ""                                  # found, not rebuilt


def test_turned_off_or_without_a_compiler_torch_keeps_the_layers(monkeypatch, capfd):
    monkeypatch.setenv("RUVLLM_COMPILE", "0")
    assert kernels.half_kernel() is None and half_linear(torch.randn(8, 8), None) is None
    kernels.half_kernel.cache_clear()
    monkeypatch.delenv("RUVLLM_COMPILE")
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert kernels.half_kernel() is None
    lines = capfd.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("ruvllm: the float16 kernel could not be built") or \
        lines[-1].startswith("ruvllm: the float16 kernel did not build")
