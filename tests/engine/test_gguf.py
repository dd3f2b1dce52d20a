"""GGUF input: a llama.cpp-style file (written from the tiny model) loads through the
engine with its own tokenizer and chat template, close to the original weights."""

from __future__ import annotations

import pytest
import torch

from ruvllm_cli.engine.config import EngineConfig
from ruvllm_cli.engine.engine import LLMEngine
from ruvllm_cli.engine.loader import load_model
from ruvllm_cli.engine.sampling import SamplingParams
from ruvllm_cli.errors import ModelLoadError
from ruvllm_cli.quantization import Quantization as Q
from ruvllm_cli.quantization import quantization_of_gguf
from ruvllm_cli.testing.tiny_gguf import write_gguf

pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory, engine_model_dir):
    return write_gguf(engine_model_dir, tmp_path_factory.mktemp("gguf") / "tiny-Q8_0.gguf")


def next_token_logprobs(engine: LLMEngine, prompt: list[int]) -> torch.Tensor:
    seen = []
    engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, logits_processors=[
        lambda _ids, row: seen.append(row.float().clone()) or row]))
    return seen[0].log_softmax(-1)


def test_gguf_loads_with_its_tokenizer_and_matches_the_original(gguf_file, loaded):
    from_gguf = load_model(gguf_file, "cpu", Q.F32)
    text = "Hello wörld, 日本語 🎉 and more"
    assert from_gguf.tokenizer.encode(text) == loaded.tokenizer.encode(text)
    assert from_gguf.tokenizer.chat_template
    assert from_gguf.streamed and from_gguf.quantization_path.startswith("GGUF Q8_0 tiny-Q8_0.gguf, ")
    original = LLMEngine(loaded, EngineConfig(device="cpu", quantization=Q.F32))
    engine = LLMEngine(from_gguf, EngineConfig(device="cpu", quantization=Q.F32))
    for prompt in ([5, 6, 7, 8, 9], list(range(40, 90))):
        ref, got = next_token_logprobs(original, prompt).cpu(), next_token_logprobs(engine, prompt)
        assert torch.sum(ref.exp() * (ref - got)).item() < 0.01   # Q8_0 rounding only


def test_gguf_quantized_at_load_really_shrinks(gguf_file):
    full = load_model(gguf_file, "cpu", Q.F16)
    small = load_model(gguf_file, "cpu", Q.Q8_0)
    # (ratios are checked on a model large enough for them in test_quantization.py;
    # on this 64-wide one, per-channel scales weigh a quarter of each int8 row)
    assert small.weight_bytes < full.weight_bytes
    out = LLMEngine(small, EngineConfig(device="cpu", quantization=Q.Q8_0)).generate(
        [[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4


def test_the_structure_check_reads_what_gguf_reads(gguf_file):
    import gguf

    from ruvllm_cli.engine.gguf_check import TensorInfo, check_gguf

    reader, layout = gguf.GGUFReader(gguf_file), check_gguf(gguf_file)
    assert layout.data_start == reader.data_offset == 14880
    assert [(t.name, t.dims, t.ggml_type, t.offset) for t in layout.tensors] == [
        (t.name, tuple(t.shape.tolist()), int(t.tensor_type), t.data_offset - reader.data_offset)
        for t in reader.tensors]
    assert layout.tensors[0] == TensorInfo("token_embd.weight", (64, 512), 8, 0)   # Q8_0
    assert layout.metadata["general.architecture"] == "llama" and layout.metadata["llama.block_count"] == 2
    tokens = len(reader.fields["tokenizer.ggml.tokens"].data)
    assert layout.metadata["tokenizer.ggml.tokens"] == (8, tokens)   # an array: (item type, count)


def test_missing_gguf_file_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="no such GGUF file"):
        load_model(tmp_path / "nope.gguf", "cpu", Q.F16)


@pytest.mark.parametrize("name, expected", [
    ("qwen2.5-0.5b-instruct-q4_k_m.gguf", Q.Q4_K_M), ("Qwen2.5-7B-Instruct-Q8_0.gguf", Q.Q8_0),
    ("Llama-3.2-3B-Instruct-f16.gguf", Q.F32), ("model-BF16.gguf", Q.F16), ("x-F32.gguf", Q.F32),
    ("model.gguf", None)])
def test_quantization_is_read_from_the_file_name(name, expected):
    assert quantization_of_gguf(name) is expected


def test_chat_pipes_through_a_gguf_file(gguf_file, ruvllm):
    result = ruvllm("chat", str(gguf_file), "--max-tokens", "4", "--device", "cpu", input="hello\n")
    assert result.returncode == 0, result.stderr
    assert "· q8: 8-bit weights" in result.stderr and "GGUF Q8_0 tiny-Q8_0.gguf, tensor by tensor" in result.stderr
    assert "Traceback" not in result.stderr


def test_metadata_that_does_not_fit_the_tensors_is_refused():
    """A block_count below the layers the file holds had loaded a shorter model, and a
    bos/eos id beyond the vocabulary had failed in transformers with an IndexError."""
    from gguf import GGMLQuantizationType

    from ruvllm_cli.engine.gguf_check import GGUFError, TensorInfo, check_model_size

    tensors = tuple(TensorInfo(f"blk.{i}.attn_q.weight", (8, 8), GGMLQuantizationType.F32.value, 0) for i in range(2))
    good = {"general.architecture": "llama", "llama.block_count": 2, "tokenizer.ggml.tokens": (8, 10),
            "tokenizer.ggml.eos_token_id": 9}
    check_model_size(good, tensors)
    for change, message in (({"llama.block_count": 1}, "block_count says 1 layers; it holds tensors for 2"),
                            ({"tokenizer.ggml.eos_token_id": 10}, "eos_token_id is 10, beyond its 10 tokens"),
                            ({"tokenizer.ggml.bos_token_id": -1}, "bos_token_id is -1, beyond its 10 tokens")):
        with pytest.raises(GGUFError, match=message):
            check_model_size({**good, **change}, tensors)
