"""The float16-weight kernel (engine/kernels/half_gemm.c) and its modules."""

from __future__ import annotations

import json

import pytest
import torch
from torch.nn import functional as F

from ruvllm_cli.engine import kernels
from ruvllm_cli.engine import half
from ruvllm_cli.engine.half import BLOCK, HalfEmbedding, block_rows, half_linear, to_blocks

pytestmark = pytest.mark.skipif(not kernels.cpu_has(kernels.CPU_FLAGS), reason="needs AVX2, FMA and F16C")


@pytest.fixture(scope="module", autouse=True)
def kernel_dir(tmp_path_factory):
    """The module's tests share one build, in a directory of their own."""
    with pytest.MonkeyPatch.context() as patch:
        directory = tmp_path_factory.mktemp("kernels")
        patch.setenv("RUVLLM_KERNEL_DIR", str(directory))
        kernels.half_kernel.cache_clear()
        yield directory
    kernels.half_kernel.cache_clear()


@pytest.fixture
def fresh_kernel_dir(tmp_path, monkeypatch):
    """A test that watches the build: an empty directory and no kernel loaded yet."""
    monkeypatch.setenv("RUVLLM_KERNEL_DIR", str(tmp_path / "kernels"))
    kernels.half_kernel.cache_clear()
    yield tmp_path / "kernels"
    kernels.half_kernel.cache_clear()


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 23, 24, 33])   # x holds two sequences: 2 to 66 rows
@pytest.mark.parametrize("out_features, in_features", [(64, 64), (37, 96), (6, 8), (130, 1024), (33, 12)])
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


def test_a_rows_result_is_the_same_bits_alone_in_a_batch_in_a_prompt_chunk_and_under_avx2():
    """Every output is one chain of FMAs over k in order: the row count, the tile a row
    falls in and the vector width change nothing (half_gemm.c)."""
    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(200, 96, generator=generator)   # 200: the last block padded
    bias = torch.randn(200, generator=generator)
    layer = half_linear(weight, bias)
    x = torch.randn(300, 96, generator=generator)
    batched = layer(x)
    for index in (0, 7, 8, 9, 299):
        assert torch.equal(layer(x[index:index + 1])[0], batched[index])
    assert torch.equal(layer(x[5:21]), batched[5:21])
    avx2 = torch.empty(300, 200)
    layer._kernel.linear_avx2(x.data_ptr(), 300, 96, layer.blocks16.data_ptr(), 200, layer.bias.data_ptr(),
                              avx2.data_ptr(), None, 2)
    assert torch.equal(avx2, batched)
    torch.testing.assert_close(batched, F.linear(x, weight.half().float(), bias), rtol=1e-5, atol=1e-5)


def test_blocks_hold_each_weight_row_k_major_with_the_last_block_padded(monkeypatch):
    monkeypatch.setattr(half, "CHUNK_ROWS", 64)   # several chunks, the last one short
    weight = torch.randn(150, 24)
    blocks = to_blocks(weight)
    assert blocks.shape == (5, 24, BLOCK) and blocks.dtype == torch.float16
    assert torch.equal(blocks[1, :, 3], weight[BLOCK + 3].half())
    assert torch.equal(blocks[4, :, 150 - 4 * BLOCK:], torch.zeros(24, 5 * BLOCK - 150, dtype=torch.float16))
    ids = torch.tensor([[0, 149, 33], [64, 31, 1]])
    assert torch.equal(block_rows(blocks, ids), weight[ids].half())


def test_other_activation_dtypes_are_widened_first():
    weight = torch.randn(16, 32)
    layer = half_linear(weight, None)
    x = torch.randn(3, 32).bfloat16()
    torch.testing.assert_close(layer(x), F.linear(x.float(), weight.half().float()), rtol=1e-5, atol=1e-5)


def test_values_beyond_float16_are_refused():
    assert half_linear(torch.full((8, 16), 1e6), None) is None        # float16 overflows
    assert to_blocks(torch.cat([torch.zeros(40, 4), torch.full((1, 4), 1e6)])) is None   # in the last chunk
    assert to_blocks(torch.tensor([[1.0, float("inf")]])) is not None   # an infinity that was there stays


def test_a_bfloat16_weight_converts_exactly_within_float16s_normal_range():
    weight = (torch.randn(64, 64) * 0.05).bfloat16().float()
    half = block_rows(to_blocks(weight), torch.arange(64)).float()
    normal = weight.abs() >= 2.0 ** -14
    assert torch.equal(half[normal], weight[normal])
    assert (half - weight).abs().max() <= 2.0 ** -25                # below it: float16's subnormal step


def test_embedding_rows_come_out_float32():
    table = torch.randn(10, 8)
    embedding = HalfEmbedding(to_blocks(table), 10, padding_idx=None)
    out = embedding(torch.tensor([[3, 1, 3]]))
    assert out.dtype == torch.float32 and torch.equal(out[0, 0], table[3].half().float())
    with pytest.raises(IndexError):
        embedding(torch.tensor([10]))   # a padding row of the last block is no token


def test_built_once_into_the_cache_and_loaded_after(fresh_kernel_dir, capfd):
    assert kernels.half_kernel() is not None
    assert "building ruvllm's float16 kernel" in capfd.readouterr().err
    built = list(fresh_kernel_dir.glob("half_gemm-*.so"))
    assert len(built) == 1
    kernels.half_kernel.cache_clear()
    assert kernels.half_kernel() is not None
    assert capfd.readouterr().err == ""                                  # found, not rebuilt


def test_turned_off_or_without_a_compiler_torch_keeps_the_layers(fresh_kernel_dir, monkeypatch, capfd):
    monkeypatch.setenv("RUVLLM_COMPILE", "0")
    assert kernels.half_kernel() is None and half_linear(torch.randn(8, 8), None) is None
    kernels.half_kernel.cache_clear()
    monkeypatch.delenv("RUVLLM_COMPILE")
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert kernels.half_kernel() is None
    lines = capfd.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("ruvllm: the float16 kernel could not be built") or \
        lines[-1].startswith("ruvllm: the float16 kernel did not build")


def test_f16_without_bfloat16_kernels_streams_float16_weights_and_matches_float32_on_them(
        engine_model_dir, monkeypatch):
    """`-q f16` on a CPU without bfloat16 kernels: float16 weights, float32 arithmetic,
    greedy tokens identical to transformers' float32 model with the weights rounded
    to float16 (the only difference the layout makes)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from ruvllm_cli.engine import quantize
    from ruvllm_cli.engine.config import EngineConfig
    from ruvllm_cli.engine.engine import LLMEngine
    from ruvllm_cli.engine.half import HalfEmbedding, HalfLinear
    from ruvllm_cli.engine.loader import load_model
    from ruvllm_cli.engine.sampling import SamplingParams
    from ruvllm_cli.quantization import Quantization

    monkeypatch.setattr(quantize, "cpu_has_bf16_kernels", lambda: False)
    loaded = load_model(engine_model_dir, "cpu", Quantization.F16)
    assert loaded.dtype == torch.float32 and loaded.streamed
    assert loaded.quantization_path.startswith("float16 weights with float32 arithmetic")
    layers = [m for m in loaded.model.modules() if isinstance(m, HalfLinear)]
    assert len(layers) == 7 * loaded.config.num_hidden_layers + 1          # the LM head included
    assert isinstance(loaded.model.get_input_embeddings(), HalfEmbedding)
    # A tied head shares the embedding's float16 table (weight_bytes counts it once).
    tied = json.loads((engine_model_dir / "config.json").read_text()).get("tie_word_embeddings", False)
    shared = loaded.model.get_output_embeddings().blocks16 is loaded.model.get_input_embeddings().blocks16
    assert shared == tied
    engine = LLMEngine(loaded, EngineConfig(device="cpu", quantization=Quantization.F16))
    prompts = [[5, 6, 7, 8, 9], [100, 200, 300], [7] * 20]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    results = engine.generate(prompts, params)

    reference = AutoModelForCausalLM.from_pretrained(engine_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for parameter in reference.parameters():
            if parameter.dim() == 2:
                parameter.copy_(parameter.half().float())
    config = GenerationConfig(max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
    for prompt, result in zip(prompts, results):
        expected = reference.generate(torch.tensor([prompt]), generation_config=config)[0, len(prompt):]
        assert result.token_ids == expected.tolist()
