"""Config reading, parameter counts (against real models' published numbers) and memory estimates."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ruvllm_cli.errors import ModelLoadError
from ruvllm_cli.quantization import Quantization
from ruvllm_cli.registry.memory import (LAYOUT_BYTES, OVERHEAD_BASE_BYTES, OVERHEAD_FRACTION, estimate_kv_bytes_per_token,
                                        estimate_memory, estimate_weight_bytes, format_bytes)
from ruvllm_cli.registry.model_config import (ModelShape, count_parameters, count_parameters_from_safetensors,
                                              read_model_config, read_safetensors_header, shape_from_dict)
from ruvllm_cli.registry.registry import builtin_entries

# The shape-relevant keys of each built-in model's config.json, as published on the hub.
REAL_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen-0.5b": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896,
                  "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
                  "intermediate_size": 4864, "vocab_size": 151936, "max_position_embeddings": 32768,
                  "tie_word_embeddings": True, "torch_dtype": "bfloat16"},
    "qwen-1.5b": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 1536,
                  "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
                  "intermediate_size": 8960, "vocab_size": 151936, "max_position_embeddings": 32768,
                  "tie_word_embeddings": True},
    "qwen": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
             "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
             "intermediate_size": 18944, "vocab_size": 152064, "max_position_embeddings": 32768,
             "tie_word_embeddings": False},
    "qwen-large": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 5120,
                   "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8,
                   "intermediate_size": 13824, "vocab_size": 152064, "max_position_embeddings": 32768,
                   "tie_word_embeddings": False},
    "mistral": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096,
                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                "intermediate_size": 14336, "vocab_size": 32768, "max_position_embeddings": 32768,
                "tie_word_embeddings": False},
    "phi": {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": 3072,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
            "intermediate_size": 8192, "vocab_size": 32064, "max_position_embeddings": 131072,
            "tie_word_embeddings": False},
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 3072,
              "num_hidden_layers": 28, "num_attention_heads": 24, "num_key_value_heads": 8, "head_dim": 128,
              "intermediate_size": 8192, "vocab_size": 128256, "max_position_embeddings": 131072,
              "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False},
    "llama-1b": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
                 "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
                 "intermediate_size": 8192, "vocab_size": 128256, "max_position_embeddings": 131072,
                 "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False},
    "smollm": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 960,
               "num_hidden_layers": 32, "num_attention_heads": 15, "num_key_value_heads": 5, "head_dim": 64,
               "intermediate_size": 2560, "vocab_size": 49152, "max_position_embeddings": 8192,
               "tie_word_embeddings": True},
}
REAL_CONFIGS["qwen-coder"] = REAL_CONFIGS["qwen"]


# --- config reading ------------------------------------------------------------------------------

def test_read_qwen_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(REAL_CONFIGS["qwen-0.5b"]))
    shape = read_model_config(tmp_path)
    assert shape == read_model_config(tmp_path / "config.json")
    assert shape.to_dict() == {
        "architecture": "Qwen2ForCausalLM", "model_type": "qwen2", "hidden_size": 896, "num_layers": 24,
        "num_heads": 14, "num_kv_heads": 2, "head_dim": 64, "intermediate_size": 4864, "vocab_size": 151936,
        "context_length": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    }
    assert shape.qkv_bias and not shape.o_bias and not shape.mlp_bias


def test_config_key_variants() -> None:
    shape = shape_from_dict({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 100,
                             "n_positions": 512, "dtype": "float16"})
    assert (shape.hidden_size, shape.num_layers, shape.num_heads, shape.num_kv_heads) == (64, 2, 4, 4)
    assert (shape.head_dim, shape.intermediate_size, shape.context_length) == (16, 256, 512)
    assert shape.torch_dtype == "float16"
    assert shape.tie_word_embeddings  # PretrainedConfig's default
    assert not shape_from_dict({**REAL_CONFIGS["mistral"], "tie_word_embeddings": None}).tie_word_embeddings


def test_text_config_nesting() -> None:
    nested = {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
              "text_config": {**REAL_CONFIGS["llama-1b"], "architectures": None}}
    shape = shape_from_dict(nested)
    assert shape.architecture == "LlavaForConditionalGeneration"
    assert (shape.hidden_size, shape.num_layers, shape.model_type) == (2048, 16, "llama")


def test_null_head_dim_falls_back() -> None:
    assert shape_from_dict({**REAL_CONFIGS["mistral"], "head_dim": None}).head_dim == 128


def test_bad_configs(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no config.json"):
        read_model_config(tmp_path)
    (tmp_path / "config.json").write_text("{oops")
    with pytest.raises(ModelLoadError, match="cannot read"):
        read_model_config(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ModelLoadError, match="lacks hidden_size, num_hidden_layers, num_attention_heads, vocab_size"):
        read_model_config(tmp_path)


# --- parameter counts ----------------------------------------------------------------------------

def test_qwen25_05b_formula_matches_the_real_count() -> None:
    assert count_parameters(shape_from_dict(REAL_CONFIGS["qwen-0.5b"])) == 494_032_768


@pytest.mark.parametrize("alias,published", [
    ("qwen", 7_615_616_512), ("qwen-large", 14_770_033_664), ("mistral", 7_248_023_552),
    ("phi", 3_821_079_552), ("llama", 3_212_749_824), ("llama-1b", 1_235_814_400),
    ("qwen-1.5b", 1_543_714_304), ("smollm", 361_821_120),
])
def test_formula_matches_published_counts(alias: str, published: int) -> None:
    assert count_parameters(shape_from_dict(REAL_CONFIGS[alias])) == published


@pytest.mark.parametrize("alias", list(REAL_CONFIGS))
def test_registry_numbers_come_from_the_config(alias: str) -> None:
    entry = builtin_entries()[alias]
    shape = shape_from_dict(REAL_CONFIGS[alias])
    assert entry.params == count_parameters(shape)
    assert (entry.hidden_size, entry.vocab_size, entry.tie_word_embeddings) == (
        shape.hidden_size, shape.vocab_size, shape.tie_word_embeddings)
    assert (entry.architecture, entry.context_length) == (shape.architecture, shape.context_length)
    assert (entry.num_layers, entry.num_kv_heads, entry.head_dim) == (shape.num_layers, shape.num_kv_heads,
                                                                     shape.head_dim)


def _write_safetensors(path: Path, tensors: dict[str, list[int]], metadata: bool = True) -> None:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}} if metadata else {}
    offset = 0
    for name, shape in tensors.items():
        size = 4
        for dim in shape:
            size *= dim
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * offset)


def test_safetensors_headers_are_summed_across_shards(tmp_path: Path) -> None:
    _write_safetensors(tmp_path / "model-00001-of-00002.safetensors", {"a": [3, 4], "b": [5]})
    _write_safetensors(tmp_path / "model-00002-of-00002.safetensors", {"c": [2, 2, 2]}, metadata=False)
    assert read_safetensors_header(tmp_path / "model-00002-of-00002.safetensors")["c"]["shape"] == [2, 2, 2]
    assert count_parameters_from_safetensors(tmp_path) == 12 + 5 + 8


def test_tied_lm_head_stored_twice_is_counted_once(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**REAL_CONFIGS["smollm"], "tie_word_embeddings": True}))
    _write_safetensors(tmp_path / "model.safetensors", {"model.embed_tokens.weight": [10, 4],
                                                         "lm_head.weight": [10, 4]})
    assert count_parameters_from_safetensors(tmp_path) == 40


def test_no_or_corrupt_safetensors(tmp_path: Path) -> None:
    assert count_parameters_from_safetensors(tmp_path) is None
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 5) + b"{nope")
    with pytest.raises(ModelLoadError, match="corrupt safetensors header"):
        count_parameters_from_safetensors(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"abc")
    with pytest.raises(ModelLoadError, match="too short"):
        count_parameters_from_safetensors(tmp_path)


@pytest.mark.parametrize("entry", [[1, 2], "F32", None, {"dtype": "F32", "shape": "12"},
                                   {"dtype": "F32", "shape": [2, "x"]}, {"dtype": "F32", "shape": [-1]}])
def test_a_header_entry_that_is_no_tensor_is_a_corrupt_header_naming_the_file(tmp_path: Path, entry: Any) -> None:
    """A header entry that was no JSON object raised AttributeError ('list' has no 'get')."""
    raw = json.dumps({"weight": entry}).encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(ModelLoadError) as error:
        count_parameters_from_safetensors(tmp_path)
    assert error.value.message == f"{path} has a corrupt safetensors header (tensor 'weight' has no valid shape)"


@pytest.mark.parametrize("options", [{}, {"tie_word_embeddings": False, "attention_bias": True}])
def test_tiny_model_counts_equal_torch(make_tiny_model: Callable[..., Path], options: dict[str, Any]) -> None:
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(**options)
    with torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(path)
    real = sum(p.numel() for p in model.parameters())
    assert count_parameters(read_model_config(path)) == real
    assert count_parameters_from_safetensors(path) == real


# --- memory --------------------------------------------------------------------------------------

QWEN_05B = shape_from_dict(REAL_CONFIGS["qwen-0.5b"])


def test_weight_bytes_follow_ruvllm_layouts() -> None:
    params = 1_000_000_000
    # Without a shape every parameter counts as a linear layer's.
    q4, q8 = estimate_weight_bytes(params, "q4k"), estimate_weight_bytes(params, Quantization.Q8_0)
    f16, f32 = estimate_weight_bytes(params, "f16"), estimate_weight_bytes(params, "none")
    assert (q4, q8, f16, f32) == (562_500_000, 1_000_000_000, 2_000_000_000, 4_000_000_000)
    # The embedding table apart: q4k's groups of 32 there; under none a tied head's packed copy.
    params = count_parameters(QWEN_05B)
    table = 151_936 * 896
    assert estimate_weight_bytes(params, "q8", QWEN_05B) == params
    assert estimate_weight_bytes(params, "q4k", QWEN_05B) == round((params - table) * 0.5625 + table * 0.625)
    assert estimate_weight_bytes(params, "q4k", QWEN_05B, gguf=True) == round(params * 0.625)
    assert estimate_weight_bytes(params, "f16", QWEN_05B) == 2 * params
    assert estimate_weight_bytes(params, "none", QWEN_05B) == 4 * (params + table)
    qwen = builtin_entries()["qwen"]   # untied: the head is a linear layer
    assert estimate_weight_bytes(qwen.params, "none", qwen) == 4 * qwen.params
    # q4k: 4-bit codes and a bf16 scale and zero per group of 64 (untied: the head too),
    # the embedding table's per group of 32.
    table = qwen.hidden_size * qwen.vocab_size
    assert estimate_weight_bytes(qwen.params, "q4k", qwen) == round((qwen.params - table) * 0.5625 + table * 0.625)


def test_the_estimate_is_the_loader_memory_check_figure(make_tiny_model: Callable[..., Path]) -> None:
    """`info`'s weights and the loader's streamed figure (which the loader tests hold to
    the loaded model's bytes) agree, but for what `info` leaves out: the norms (kept in
    the activations' dtype), q8's scales (4 bytes an output row in our kernel, 16 in
    fbgemm's) and the file's header (the loader counts weights by the file's size)."""
    torch = pytest.importorskip("torch")
    from ruvllm_cli.engine.loader import _shape_counts, dtype_for, memory_needed

    path = make_tiny_model(hidden_size=128, intermediate_size=256, num_layers=2)
    config = json.loads((path / "config.json").read_text())
    shape = read_model_config(path)
    params = count_parameters(shape)
    header = (path / "model.safetensors").stat().st_size - 4 * params
    _, _, rows, norms, _ = _shape_counts(config)
    cpu = torch.device("cpu")
    for quantization, scales in ((Quantization.Q8_0, (4 * rows, 16 * rows)), (Quantization.Q4_K_M, (0, 0))):
        ours = estimate_weight_bytes(params, quantization, shape)
        left_out = memory_needed(path, config, cpu, quantization, streamed=True) - ours
        linear = LAYOUT_BYTES[quantization][0]
        norm_bytes = norms * (dtype_for(quantization, cpu).itemsize - linear)
        assert norm_bytes + scales[0] <= left_out <= norm_bytes + scales[1] + header, quantization


def test_kv_bytes_per_token() -> None:
    # 2 (K and V) x 24 layers x 2 KV heads x 64 dims x 2 bytes
    assert estimate_kv_bytes_per_token(QWEN_05B) == 12_288
    assert estimate_kv_bytes_per_token(QWEN_05B, dtype_bytes=4) == 24_576
    assert estimate_kv_bytes_per_token(builtin_entries()["qwen"]) == 2 * 28 * 4 * 128 * 2


def test_estimate_memory_parts_add_up() -> None:
    params = count_parameters(QWEN_05B)
    memory = estimate_memory(params, "q8", QWEN_05B, context=2048)
    assert memory["quantization"] == "q8" and memory["label"] == "Q8_0" and memory["context"] == 2048
    assert memory["weights_bytes"] == estimate_weight_bytes(params, "q8", QWEN_05B)
    assert memory["kv_cache_bytes"] == 12_288 * 2048
    assert memory["overhead_bytes"] == int(memory["weights_bytes"] * OVERHEAD_FRACTION) + OVERHEAD_BASE_BYTES
    assert memory["total_bytes"] == memory["weights_bytes"] + memory["kv_cache_bytes"] + memory["overhead_bytes"]


def test_estimate_memory_ratios_and_kv_dtype() -> None:
    params = count_parameters(QWEN_05B)
    by_quant = {q: estimate_memory(params, q, QWEN_05B) for q in Quantization}
    weights = [by_quant[q]["weights_bytes"] for q in Quantization]
    totals = [by_quant[q]["total_bytes"] for q in Quantization]
    assert weights == sorted(weights) and totals == sorted(totals)
    assert by_quant[Quantization.F32]["kv_cache_bytes"] == 2 * by_quant[Quantization.F16]["kv_cache_bytes"]
    assert by_quant[Quantization.Q4_K_M]["kv_cache_bytes"] == by_quant[Quantization.F16]["kv_cache_bytes"]
    assert by_quant[Quantization.F16]["kv_cache_bytes"] == 12_288 * 4096
    doubled = estimate_memory(params, "f16", QWEN_05B, context=8192)
    assert doubled["kv_cache_bytes"] == 2 * by_quant[Quantization.F16]["kv_cache_bytes"]


def test_estimate_memory_without_shape_leaves_kv_unknown() -> None:
    memory = estimate_memory(7e9, "q4k")
    assert memory["kv_cache_bytes"] is None
    assert memory["total_bytes"] == memory["weights_bytes"] + memory["overhead_bytes"]


@pytest.mark.parametrize("count,text", [
    (None, "-"), (0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (1536, "1.5 KiB"),
    (5 * 1024**2, "5.0 MiB"), (int(4.7 * 1024**3), "4.7 GiB"), (3 * 1024**4, "3.0 TiB"),
])
def test_format_bytes(count: int | None, text: str) -> None:
    assert format_bytes(count) == text


def test_model_shape_is_frozen() -> None:
    with pytest.raises(AttributeError):
        QWEN_05B.hidden_size = 1  # type: ignore[misc]
    assert isinstance(QWEN_05B, ModelShape)
