"""The bfloat16-weight kernel (engine/kernels/bf16_gemm.c), its module, and the f16
load that uses it on CPUs with AVX-512 BF16 (the tied head sharing one table)."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from ruvllm_cli.engine import kernels
from ruvllm_cli.engine.bf16 import GEMM_ROWS, Bf16Linear, bf16_linear
from ruvllm_cli.engine.config import EngineConfig
from ruvllm_cli.engine.engine import LLMEngine
from ruvllm_cli.engine.loader import load_model
from ruvllm_cli.engine.sampling import SamplingParams
from ruvllm_cli.quantization import Quantization

pytestmark = pytest.mark.skipif(kernels.bf16_kernel() is None, reason="needs AVX-512 BF16 and a C compiler")


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """float32 sums of the bfloat16 values, rounded to bfloat16 once."""
    return F.linear(x.float(), weight.float(), bias).to(torch.bfloat16)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 16, 32, 33, GEMM_ROWS - 1, GEMM_ROWS, 130])
@pytest.mark.parametrize("out_features, in_features", [(64, 64), (37, 96), (37, 160), (129, 1024)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_float32_sums_rounded_once(rows, out_features, in_features, bias):
    torch.manual_seed(rows * 7 + out_features)
    weight = (torch.randn(out_features, in_features) * 0.05).bfloat16()
    b = torch.randn(out_features) if bias else None
    x = torch.randn(rows, in_features).bfloat16()
    layer = bf16_linear(weight, b)
    assert isinstance(layer, Bf16Linear)
    out, expected = layer(x), reference(x, weight, b)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
    # The same float32 sum in another order, rounded once: at most one bfloat16 step apart.
    step = expected.float().abs().clamp(min=1e-3) * 2.0 ** -7
    assert bool(((out.float() - expected.float()).abs() <= step).all())


@pytest.mark.parametrize("in_features", [96, 160, 1024])
def test_a_row_gets_the_same_bits_alone_or_in_any_batch_the_kernel_takes(in_features):
    """Alone, in fours, in blocks along K (5 to 32 rows: K of 96, 160 and 1,024 values
    is less than, not a multiple of, and eight blocks of 128) and beyond."""
    torch.manual_seed(in_features)
    weight = (torch.randn(37, in_features) * 0.05).bfloat16()
    layer = bf16_linear(weight, torch.randn(37))
    x = torch.randn(GEMM_ROWS - 1, in_features).bfloat16()
    alone = torch.cat([layer(row[None]) for row in x])
    for rows in (2, 3, 5, 9, 16, 32, 33, GEMM_ROWS - 1):
        assert torch.equal(layer(x[:rows]), alone[:rows])


def test_a_width_the_kernel_cannot_take_is_refused():
    assert bf16_linear(torch.zeros(8, 40, dtype=torch.bfloat16), None) is None


def test_the_layer_holds_the_weight_it_is_given_without_a_copy():
    weight = torch.randn(16, 64).bfloat16()
    assert bf16_linear(weight, None).weight.data_ptr() == weight.data_ptr()


@pytest.mark.parametrize("tied", [True, False])
def test_f16_loads_into_the_kernel_and_a_tied_head_shares_the_embedding_table(make_tiny_model, tied):
    loaded = load_model(make_tiny_model(tie_word_embeddings=tied), "cpu", Quantization.F16)
    model = loaded.model
    assert loaded.dtype == torch.bfloat16 and isinstance(model.lm_head, Bf16Linear)
    assert "AVX-512 BF16 kernel" in loaded.quantization_path
    shares = model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert shares == tied and ("shares the embedding's table" in loaded.quantization_path) == tied
    engine = LLMEngine(loaded, EngineConfig(device="cpu", quantization=Quantization.F16))
    result = engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    assert len(result.token_ids) == 8
