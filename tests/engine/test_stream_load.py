"""The streamed loader (engine/stream_load.py) builds the very same model as
transformers' path followed by `quantize_model`, for every quantization: equal
tensors, equal int8 codes, bit-identical logits; checkpoints it cannot stream go
the old way."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from ruvllm_cli.engine.loader import STREAM_ENV, load_model
from ruvllm_cli.engine.int8 import Int8Linear
from ruvllm_cli.engine.quantize import DynamicInt8Linear, PackedLinear
from ruvllm_cli.quantization import Quantization as Q
from ruvllm_cli.testing.forward import prefill_logits

PROMPT = torch.tensor([[5, 6, 7, 8, 9, 10, 300, 12, 77, 401]])
VARIANTS = {
    "tied-float32": dict(hidden_size=128, num_layers=2, intermediate_size=256),
    "untied-bias-bf16": dict(hidden_size=128, num_layers=2, intermediate_size=256,
                             tie_word_embeddings=False, attention_bias=True, dtype="bfloat16"),
    # transformers' path builds q8 in bfloat16 here and widens as it quantizes (loader._build_dtype)
    "tied-bf16": dict(hidden_size=128, num_layers=2, intermediate_size=256, dtype="bfloat16"),
}


def _load(path, quant, monkeypatch, stream: bool):
    monkeypatch.setenv(STREAM_ENV, "1" if stream else "0")
    return load_model(path, "cpu", quant)


def _logits(model) -> torch.Tensor:
    return prefill_logits(model, PROMPT[0].tolist())


def _layers(model) -> dict[str, str]:
    """The class of each module that holds a weight matrix, by name."""
    return {name: type(m).__name__ for name, m in model.named_modules()
            if name.endswith(("proj", "embed_tokens", "lm_head"))}


def _weight_bytes(loaded) -> int:
    """weight_bytes without the RoPE tables (transformers' classes keep a second copy)."""
    return loaded.weight_bytes - sum(b.nbytes for n, b in loaded.model.named_buffers() if "rotary" in n)


def _int8_codes(model) -> list[torch.Tensor]:
    """Every int8 layer's codes: our kernel's buffer, or unpacked from fbgemm's copy."""
    return [m.qweight if isinstance(m, Int8Linear) else torch.ops.quantized.linear_unpack(m.packed)[0].int_repr()
            for m in model.modules() if isinstance(m, (DynamicInt8Linear, Int8Linear))]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("quant", list(Q))
def test_streamed_model_is_identical(make_tiny_model, monkeypatch, variant, quant):
    path = make_tiny_model(**VARIANTS[variant])
    old = _load(path, quant, monkeypatch, stream=False)
    new = _load(path, quant, monkeypatch, stream=True)
    assert not old.streamed and new.streamed
    assert new.quantization_path == old.quantization_path
    # The old way builds transformers' classes, the streamed one ours (engine/native.py).
    assert _weight_bytes(new) == _weight_bytes(old)
    assert _layers(new.model) == _layers(old.model)
    old_state, new_state = old.model.state_dict(), new.model.state_dict()
    assert old_state.keys() == new_state.keys()
    for name, tensor in old_state.items():
        assert new_state[name].dtype == tensor.dtype, name
        assert torch.equal(new_state[name], tensor), name
    for a, b in zip(_int8_codes(old.model), _int8_codes(new.model), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(_logits(new.model), _logits(old.model))
    assert new.model.config.tie_word_embeddings == old.model.config.tie_word_embeddings
    assert new.eos_token_ids == old.eos_token_ids


def test_streamed_weights_are_not_file_mappings(make_tiny_model, monkeypatch):
    """Every tensor is a copy in process memory: nothing maps the checkpoint."""
    loaded = _load(make_tiny_model(), Q.F32, monkeypatch, stream=True)
    assert loaded.streamed
    if any(isinstance(m, PackedLinear) for m in loaded.model.modules()):
        assert loaded.model.lm_head is not loaded.model.get_input_embeddings()
    state = loaded.model.state_dict()
    file_tensors = load_file(next(make_tiny_model().glob("*.safetensors")))
    for name, tensor in file_tensors.items():
        if name in state:
            assert state[name].untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr()


def test_a_checkpoint_with_other_names_loads_the_old_way(make_tiny_model, tmp_path, monkeypatch):
    path = tmp_path / "renamed"
    shutil.copytree(make_tiny_model(), path)
    weights_file = path / "model.safetensors"
    tensors = load_file(weights_file)
    tensors["model.unused_extra.weight"] = torch.zeros(3)
    save_file(tensors, weights_file, metadata={"format": "pt"})
    loaded = _load(path, Q.Q8_0, monkeypatch, stream=True)
    assert not loaded.streamed
    reference = _load(make_tiny_model(), Q.Q8_0, monkeypatch, stream=True)
    assert torch.equal(_logits(loaded.model), _logits(reference.model))


def test_a_sharded_checkpoint_streams(make_tiny_model, tmp_path, monkeypatch):
    source = make_tiny_model()
    path = tmp_path / "sharded"
    shutil.copytree(source, path)
    tensors = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, path / file, metadata={"format": "pt"})
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: f for f, ns in shards.items() for n in ns}}))
    loaded = _load(path, Q.Q4_K_M, monkeypatch, stream=True)
    assert loaded.streamed
    reference = _load(source, Q.Q4_K_M, monkeypatch, stream=False)
    assert torch.equal(_logits(loaded.model), _logits(reference.model))


@pytest.mark.parametrize("quant", [Q.Q8_0, Q.Q4_K_M])
def test_row_blocks_read_from_the_file_give_the_same_model(make_tiny_model, monkeypatch, quant):
    """Matrices larger than a block are quantized block by block, each block read
    through its own mapping; with blocks of 8,192 values (64 rows of 128, the int4
    packer's least) every matrix of the tiny model is."""
    from ruvllm_cli.engine import quantize, stream_load

    path = make_tiny_model(**VARIANTS["untied-bias-bf16"])
    old = _load(path, quant, monkeypatch, stream=False)
    monkeypatch.setattr(quantize, "CHUNK_VALUES", 64 * 128)
    monkeypatch.setattr(stream_load, "CHUNK_VALUES", 64 * 128)
    blocks = []
    real_blocks = stream_load.FileRows.blocks

    def counting(self, rows):
        for block in real_blocks(self, rows):
            blocks.append(block.shape[0])
            yield block

    monkeypatch.setattr(stream_load.FileRows, "blocks", counting)
    new = _load(path, quant, monkeypatch, stream=True)
    assert new.streamed and blocks and max(blocks) == 64
    for name, tensor in old.model.state_dict().items():
        assert torch.equal(new.model.state_dict()[name], tensor), name
    for a, b in zip(_int8_codes(old.model), _int8_codes(new.model), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(_logits(new.model), _logits(old.model))
