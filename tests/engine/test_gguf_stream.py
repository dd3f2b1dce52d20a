"""GGUF straight in (engine/gguf_load.py, gguf_plan.py): each tensor of the file goes
into its final layout on its own. Checked on tiny files that mix every type a Q4_K_M
file holds (F16, Q8_0, Q5_0, Q4_K, Q6_K): float32 loads equal transformers' GGUF path
exactly, Q4_K keeps its codes under q4k and is never dequantized, the other types stay
within the requantization bound, and nothing dequantizes more than a block of rows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from ruvllm_cli.engine.config import EngineConfig
from ruvllm_cli.engine.engine import LLMEngine
from ruvllm_cli.engine.int8 import Int8Linear
from ruvllm_cli.engine.loader import STREAM_ENV, half_weights_here, load_model, memory_needed
from ruvllm_cli.engine.quantize import (DynamicInt8Linear, Int4Embedding, Int4Linear, Int8Embedding,
                                        int8_weights_here)
from ruvllm_cli.engine.sampling import SamplingParams
from ruvllm_cli.quantization import Quantization as Q
from ruvllm_cli.testing.tiny_gguf import gguf_name, write_gguf

gguf = pytest.importorskip("gguf")

# K-quant rows hold whole 256-blocks: hidden and intermediate sizes are multiples of 256.
WIDE = dict(hidden_size=256, intermediate_size=512, tie_word_embeddings=False)
MIX = {"token_embd": "Q4_K", "output": "Q6_K", "attn_q": "Q4_K", "attn_k": "Q6_K", "attn_v": "Q5_0",
       "attn_output": "Q8_0", "ffn_gate": "F16", "ffn_up": "Q4_K", "ffn_down": "Q6_K"}
# llama.cpp's i-quants (IQ4_XS files hold IQ4_NL where a row is not whole 256-blocks).
IQ_MIX = {"token_embd": "IQ4_XS", "output": "IQ4_NL", "attn_q": "IQ3_S", "attn_k": "IQ3_XXS", "attn_v": "IQ2_S",
          "attn_output": "IQ2_XS", "ffn_gate": "IQ2_XXS", "ffn_up": "IQ1_M", "ffn_down": "IQ1_S"}
ROUNDING = 2.0 ** -8  # bf16 keeps 8 significant bits: a scale or zero is off by at most half of this


def mixed_type(name: str) -> str:
    return MIX[name.split(".")[-2]]


@pytest.fixture(scope="module")
def files(make_tiny_model, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf-stream")
    plain, biased = make_tiny_model(**WIDE), make_tiny_model(**WIDE, attention_bias=True)
    return {"llama": write_gguf(plain, root / "llama.gguf", types=mixed_type),
            "qwen2": write_gguf(biased, root / "qwen2.gguf", types=mixed_type, arch="qwen2"),
            "iq": write_gguf(biased, root / "iq.gguf", types=lambda name: IQ_MIX[name.split(".")[-2]], arch="qwen2"),
            "biased": biased, "root": root}


def file_values(path: Path, heads: dict[str, int]) -> dict[str, tuple[str, torch.Tensor]]:
    """GGUF name -> (ggml type, the tensor as gguf dequantizes it, its q/k rows put
    back in order the way transformers' LlamaTensorProcessor does)."""
    values = {}
    for tensor in gguf.GGUFReader(path).tensors:
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        part = next((p for p in heads if p in tensor.name), None)
        if part is not None:
            rows = array.shape[0]
            array = array.reshape(heads[part], rows // heads[part] // 2, 2, -1).swapaxes(1, 2).reshape(array.shape)
        values[tensor.name] = (tensor.tensor_type.name, torch.from_numpy(np.array(array)))
    return values


def dense(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weights as the layer computes with them, each weight's scale, its zero or low) in float32."""
    if isinstance(module, Int4Linear):
        # The kernel with scale 1 and zero 0 hands back q - 8 exactly (small integers fit
        # bf16), fast; the layer's own w = (q - 8) * scale + zero then in float32.
        params = module.scales_and_zeros
        unit = torch.stack([torch.ones_like(params[..., 0]), torch.zeros_like(params[..., 1])], -1)
        eye = torch.eye(module.in_features, dtype=torch.bfloat16)
        codes = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, module.qweight, module.group_size, unit).T.float()
        scale, zero = (params[..., i].float().T.repeat_interleave(module.group_size, 1) for i in (0, 1))
        return codes * scale + zero, scale, zero
    if isinstance(module, Int4Embedding):
        codes = torch.stack([module.packed & 0xF, module.packed >> 4], -1).flatten(1).float()
        scale, low = (t.float().repeat_interleave(module.group_size, 1) for t in (module.scales, module.lows))
        return codes * scale + low, scale, low
    if isinstance(module, Int8Linear):
        scale = module.scales[:, None].expand(module.qweight.shape)
        return module.qweight.float() * scale, scale, torch.zeros_like(scale)
    if isinstance(module, DynamicInt8Linear):
        qweight = torch.ops.quantized.linear_unpack(module.packed)[0]
        scale = qweight.q_per_channel_scales().float()[:, None].expand(qweight.shape)
        return qweight.dequantize(), scale, torch.zeros_like(scale)
    assert isinstance(module, Int8Embedding)
    scale = module.scales.float()[:, None].expand(module.qweight.shape)
    return module.qweight.float() * scale, scale, torch.zeros_like(scale)


def quantized_layers(loaded) -> list[tuple[str, torch.nn.Module]]:
    kinds = (Int4Linear, Int4Embedding, DynamicInt8Linear, Int8Linear, Int8Embedding)
    return [(name, m) for name, m in loaded.model.named_modules() if isinstance(m, kinds)]


def assert_within_requantization(loaded, path: Path, heads: dict[str, int]) -> None:
    """Every quantized layer against gguf's own dequantization of its tensor in the file."""
    values = file_values(path, heads)
    for name, module in quantized_layers(loaded):
        kind, want = values[gguf_name(f"{name}.weight")]
        got, scale, zero = dense(module)
        assert ((got - want).abs() <= requantization_bound(module, kind, scale, zero)).all(), (name, kind)


def requantization_bound(module: torch.nn.Module, kind: str, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    if isinstance(module, (Int4Linear, Int4Embedding)):
        rounding = (16 * scale.abs() + zero.abs()) * ROUNDING     # the bf16 scale and zero
        # Q4_K's codes kept; requantized: within a step of the fitted grid
        # (quantize.int4_groups gives up the extremes' half step for the bulk of each group)
        return rounding if kind == "Q4_K" else scale + rounding
    # int8: half a step of the row's scale; an embedding's own scale is stored in bf16
    # after rounding (one shared with a tied head keeps the head's float32).
    rounded = isinstance(module, Int8Embedding) and module.scales.dtype == torch.bfloat16
    return scale / 2 + (scale * 128 * ROUNDING if rounded else 1e-7)


def heads_of(loaded) -> dict[str, int]:
    config = loaded.model.config
    return {".attn_q.": config.num_attention_heads, ".attn_k.": config.num_key_value_heads}


@pytest.fixture
def dequantized(monkeypatch) -> list[tuple[str, int]]:
    """(ggml type, rows) of every array the load hands gguf's dequantizer."""
    calls, original = [], gguf.quants.dequantize

    def spy(data, qtype):
        calls.append((gguf.GGMLQuantizationType(qtype).name, data.shape[0]))
        return original(data, qtype)

    monkeypatch.setattr(gguf.quants, "dequantize", spy)
    return calls


def greedy(loaded, prompt: list[int]) -> list[int]:
    engine = LLMEngine(loaded, EngineConfig(device="cpu", quantization=loaded.quantization))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    return engine.generate([prompt], params)[0].token_ids


@pytest.mark.parametrize("arch", ["llama", "qwen2", "iq"])
def test_float32_is_transformers_gguf_path_exactly(files, monkeypatch, capfd, arch):
    monkeypatch.setenv("RUVLLM_PACK_WEIGHTS", "0")  # plain nn.Linear weights: comparable state dicts
    ours = load_model(files[arch], "cpu", Q.F32)
    monkeypatch.setenv(STREAM_ENV, "0")
    capfd.readouterr()
    theirs = load_model(files[arch], "cpu", Q.F32)
    assert "Converting" not in capfd.readouterr().err   # transformers' reader's own tqdm bar, silenced
    assert ours.streamed and not theirs.streamed
    state, reference = ours.model.state_dict(), theirs.model.state_dict()
    assert state.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(state[name], tensor), name
    prompt = [5, 6, 7, 8, 9, 10, 300, 12]
    assert greedy(ours, prompt) == greedy(theirs, prompt)


def test_q4k_repacks_q4_k_and_requantizes_the_rest(files, dequantized):
    loaded = load_model(files["llama"], "cpu", Q.Q4_K_M)
    assert "Q4_K" not in {kind for kind, _ in dequantized}       # its codes went straight in
    layers = quantized_layers(loaded)
    assert {type(m) for _, m in layers} == {Int4Linear, Int4Embedding} and len(layers) == 16
    assert_within_requantization(loaded, files["llama"], heads_of(loaded))
    assert "5 Q4_K repacked into int4" in loaded.quantization_path


@pytest.mark.parametrize("quant", [Q.Q4_K_M, Q.Q8_0])
def test_i_quants_stream_into_int4_or_int8(files, quant, dequantized):
    """llama.cpp's i-quants (IQ4_XS, IQ4_NL, IQ3_*, IQ2_*, IQ1_*) are read a block of rows
    at a time and requantized like the other types: they had gone through transformers,
    which dequantizes the whole file first. Without -q they load as q4k."""
    from ruvllm_cli.engine.gguf_check import check_gguf
    from ruvllm_cli.engine.gguf_plan import file_quantization

    assert file_quantization(check_gguf(files["iq"])) is Q.Q4_K_M
    loaded = load_model(files["iq"], "cpu", quant)
    assert loaded.streamed and loaded.quantization is quant
    assert {kind for kind, _ in dequantized} - {"F32"} == set(IQ_MIX.values())   # F32: norms, biases
    assert len(quantized_layers(loaded)) == 16
    assert_within_requantization(loaded, files["iq"], {})
    assert "requantized into int" in loaded.quantization_path and "IQ1_S" in loaded.quantization_path
    assert len(greedy(loaded, [5, 6, 7, 8, 9])) == 8


def test_q8_requantizes_every_type_per_row(files):
    loaded = load_model(files["qwen2"], "cpu", Q.Q8_0)
    layers = quantized_layers(loaded)
    int8 = Int8Linear if int8_weights_here() else DynamicInt8Linear
    assert {type(m) for _, m in layers} == {int8, Int8Embedding}
    assert_within_requantization(loaded, files["qwen2"], {})


def test_the_f16_load_line_names_the_16_bit_type_this_cpu_loads(files):
    """float16 weights where our float16 kernel runs (its F16 tensors kept exactly), bf16
    where the bfloat16 one does: the line said bf16 on every CPU."""
    line = load_model(files["llama"], "cpu", Q.F16).quantization_path
    tensors = line.split("tensor by tensor: ")[1].split(" norms and biases")[0]
    if half_weights_here():
        assert "2 F16 kept exactly in float16" in tensors and "rounded into float16" in tensors, line
        assert "bf16" not in tensors, line
    else:
        assert "rounded into bf16" in tensors and "float16" not in tensors, line


def test_no_more_than_a_block_of_rows_is_ever_dequantized(files, dequantized, monkeypatch):
    import ruvllm_cli.engine.quantize as quantize
    from transformers import modeling_gguf_pytorch_utils as legacy

    def whole_file(*args, return_tensors=False, **kwargs):
        assert not return_tensors, "transformers' path dequantizes the whole file"
        return original(*args, return_tensors=return_tensors, **kwargs)

    original = legacy.load_gguf_checkpoint
    monkeypatch.setattr(legacy, "load_gguf_checkpoint", whole_file)
    monkeypatch.setattr(quantize, "CHUNK_ROWS", 64)
    loaded = load_model(files["llama"], "cpu", Q.Q8_0)
    assert loaded.streamed
    blocks = [rows for _, rows in dequantized if rows > 1]
    assert max(blocks) == 64
    # Every matrix read once, a block of rows at a time.
    assert sum(blocks) == sum(int(t.shape[1]) for t in gguf.GGUFReader(files["llama"]).tensors if len(t.shape) == 2)


@pytest.mark.parametrize("quant", list(Q))
def test_the_memory_check_counts_the_loaded_layouts(files, quant):
    loaded = load_model(files["llama"], "cpu", quant)
    estimate = memory_needed(files["llama"], None, torch.device("cpu"), quant)
    assert 0.97 < estimate / loaded.weight_bytes < 1.03, (estimate, loaded.weight_bytes)


def test_transformers_gguf_path_is_checked_at_its_peak(files, monkeypatch):
    """Through transformers the file is dequantized whole: the check counts the mapped
    file, the model in the activations' dtype and one tensor in float32, and refuses a
    load that only the streamed figure would fit."""
    import math
    from collections import namedtuple

    import psutil

    from ruvllm_cli.engine.gguf_check import check_gguf
    from ruvllm_cli.errors import ModelLoadError

    path, cpu = files["llama"], torch.device("cpu")
    streamed = memory_needed(path, None, cpu, Q.Q8_0)
    monkeypatch.setenv(STREAM_ENV, "0")
    through = memory_needed(path, None, cpu, Q.Q8_0)
    sizes = [math.prod(t.dims) for t in check_gguf(path).tensors]
    assert through == path.stat().st_size + sum(sizes) * 4 + max(sizes) * 4   # q8: float32 activations
    assert through > 4 * streamed
    monkeypatch.setattr(psutil, "virtual_memory", lambda: namedtuple("Memory", "available")(through // 2))
    with pytest.raises(ModelLoadError, match=r"^not enough memory: the weights need about "):
        load_model(path, "cpu", Q.Q8_0)


@pytest.mark.parametrize("kind, expected", [("F16", Q.F32), ("BF16", Q.F16), ("Q8_0", Q.Q8_0), ("Q6_K", Q.Q8_0),
                                            ("Q5_0", Q.Q8_0), ("Q4_K", Q.Q4_K_M), ("Q4_0", Q.Q4_K_M)])
def test_the_file_type_picks_the_default_quantization(files, kind, expected):
    from ruvllm_cli.engine.gguf_check import check_gguf
    from ruvllm_cli.engine.gguf_plan import file_quantization

    path = write_gguf(files["biased"], files["root"] / f"{kind}.gguf", types=lambda _: kind)
    assert file_quantization(check_gguf(path)) is expected


def test_a_llama_files_biases_and_rope_factors_are_loaded(files):
    """Two fixes transformers' reader lacks: attention biases, and Llama 3's rope_freqs."""
    from safetensors.torch import load_file

    factors = np.linspace(1.0, 8.0, 32).astype(np.float32)   # head_dim 64: 32 frequencies
    path = write_gguf(files["biased"], files["root"] / "llama3.gguf", types=mixed_type,
                      extra={"rope_freqs.weight": factors})
    loaded = load_model(path, "cpu", Q.F32)
    original = load_file(files["biased"] / "model.safetensors")
    assert loaded.streamed
    for name, param in loaded.model.named_parameters():
        if name.endswith(".bias"):
            assert torch.equal(param, original[name]), name          # F32 in the file, q/k rows back in order
    rotary = loaded.model.model.rotary_emb
    theta = loaded.model.config.rope_parameters["rope_theta"]
    base = 1.0 / theta ** (torch.arange(0, 64, 2, dtype=torch.float) / 64)
    assert torch.allclose(rotary.inv_freq, base / torch.from_numpy(factors))


def test_what_is_not_mapped_goes_through_transformers_with_a_note(engine_model_dir, tmp_path):
    path = write_gguf(engine_model_dir, tmp_path / "odd.gguf", extra={"blk.0.mystery.weight": np.ones(4)})
    loaded = load_model(path, "cpu", Q.F32)
    assert not loaded.streamed
    assert loaded.quantization_path.startswith("GGUF odd.gguf through transformers (the file's tensor "
                                               "blk.0.mystery.weight has no place in the model), ")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_config_is_the_one_transformers_reads(files, arch):
    from transformers import AutoConfig

    from ruvllm_cli.engine.gguf_check import check_gguf
    from ruvllm_cli.engine.gguf_load import gguf_config

    path = files[arch]
    ours = gguf_config(check_gguf(path)).to_dict()
    theirs = AutoConfig.from_pretrained(path.parent, gguf_file=path.name).to_dict()
    theirs.pop("_name_or_path"), ours.pop("_name_or_path")    # where from_pretrained found the file
    assert ours == theirs


def _layout(file_type: int | None, *types: str):
    from gguf import GGMLQuantizationType

    from ruvllm_cli.engine.gguf_check import GGUFLayout, TensorInfo

    metadata = {"general.architecture": "llama", **({"general.file_type": file_type} if file_type else {})}
    tensors = tuple(TensorInfo(f"blk.{i}.attn_q.weight", (64, 64), GGMLQuantizationType[kind].value, 0)
                    for i, kind in enumerate(types))
    return GGUFLayout(metadata, tensors, 0)


def test_the_weights_own_types_pick_the_default_over_the_file_type():
    """llama-quantize's MXFP4_MOE (file type 38) on a dense model writes every matrix as
    Q8_0: it had loaded as q4k. Ternary files hold {-d, 0, d}, which int8 keeps exactly
    and the int4 groups did not: q8."""
    from ruvllm_cli.engine.gguf_plan import file_quantization

    assert file_quantization(_layout(38, "Q8_0", "Q8_0")) is Q.Q8_0
    assert file_quantization(_layout(15, "Q4_K", "Q4_K", "Q6_K")) is Q.Q4_K_M
    assert file_quantization(_layout(None, "TQ1_0", "TQ1_0")) is Q.Q8_0
    assert file_quantization(_layout(None, "TQ2_0")) is Q.Q8_0


def test_a_type_not_read_here_is_said_before_the_load():
    """`info` had promised a tensor-by-tensor load of IQ4_NL files, which went through transformers."""
    from ruvllm_cli.engine.gguf_plan import unstreamable

    assert unstreamable(_layout(None, "Q4_K", "MXFP4")) == "blk.1.attn_q.weight is MXFP4, a type not read here"
    assert unstreamable(_layout(None, "Q4_K", "Q6_K")) is None


def test_config_fields_transformers_reader_misses():
    """Gemma 2's attention scale (the reader left query_pre_attn_scalar at 256; llama.cpp
    takes the key length, hidden / heads for the 27B) and Qwen3's head size."""
    from ruvllm_cli.engine.gguf_check import GGUFLayout
    from ruvllm_cli.engine.gguf_load import config_overrides

    def overrides(arch, layers, hidden, heads, key):
        return config_overrides(GGUFLayout({"general.architecture": arch, f"{arch}.block_count": layers,
                                            f"{arch}.embedding_length": hidden, f"{arch}.attention.head_count": heads,
                                            f"{arch}.attention.key_length": key}, (), 0))

    assert overrides("gemma2", 2, 256, 4, 64) == {"head_dim": 64, "query_pre_attn_scalar": 64}
    assert overrides("gemma2", 46, 4608, 32, 128) == {"head_dim": 128, "query_pre_attn_scalar": 144}
    assert overrides("qwen3", 2, 256, 4, 64) == {"head_dim": 64}
    assert overrides("llama", 2, 256, 4, 64) == {}
    assert overrides("llama", 2, 256, 4, 128) == {"head_dim": 128}
