"""The quantized-weight cache (engine/weight_cache.py): a q8/q4k load writes it, the
next load reads it and builds the very same model; a changed checkpoint or layout,
or q4k weights torch packed for another CPU, is never read; a killed write never
leaves a file a load would use."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from ruvllm_cli.engine import weight_cache
from ruvllm_cli.engine.loader import load_model
from ruvllm_cli.quantization import Quantization as Q
from tests.engine.test_stream_load import VARIANTS, _int8_codes, _logits


@pytest.fixture
def model_copy(make_tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv(weight_cache.ENV, "1")
    path = tmp_path / "model"
    shutil.copytree(make_tiny_model(**VARIANTS["untied-bias-bf16"]), path)
    return path


def _cache_files(path):
    """The weight cache's files (the checked tokenizer's record beside them aside:
    tests/engine/test_own_tokenizer.py)."""
    return sorted(p.name for p in (path / weight_cache.CACHE_DIR).glob("*") if not p.name.startswith("vocab"))


@pytest.mark.parametrize("quant", [Q.Q8_0, Q.Q4_K_M])
def test_the_second_load_reads_the_cache_and_builds_the_same_model(model_copy, quant):
    first = load_model(model_copy, "cpu", quant)
    assert not first.from_weight_cache
    assert _cache_files(model_copy) == [weight_cache.cache_file(model_copy, quant).name]
    second = load_model(model_copy, "cpu", quant)
    assert second.from_weight_cache
    assert second.quantization_path == first.quantization_path + "; read from the quantized-weight cache"
    assert second.weight_bytes == first.weight_bytes
    first_state, second_state = first.model.state_dict(), second.model.state_dict()
    assert first_state.keys() == second_state.keys()
    for name, tensor in first_state.items():
        assert second_state[name].dtype == tensor.dtype and torch.equal(second_state[name], tensor), name
    for a, b in zip(_int8_codes(first.model), _int8_codes(second.model), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(_logits(second.model), _logits(first.model))
    # Nothing maps the cache file: overwritten under a running model, it changes nothing.
    cached = weight_cache.cache_file(model_copy, quant)
    cached.write_bytes(b"\0" * cached.stat().st_size)
    assert torch.equal(_logits(second.model), _logits(first.model))


def test_a_changed_checkpoint_or_layout_is_not_read(model_copy, monkeypatch):
    load_model(model_copy, "cpu", Q.Q8_0)
    old_name = weight_cache.cache_file(model_copy, Q.Q8_0).name
    weights = next(model_copy.glob("*.safetensors"))
    os.utime(weights, ns=(time.time_ns(), time.time_ns() + 10**9))      # a new download of the file
    assert not load_model(model_copy, "cpu", Q.Q8_0).from_weight_cache
    assert _cache_files(model_copy) == [weight_cache.cache_file(model_copy, Q.Q8_0).name] != [old_name]
    monkeypatch.setattr(weight_cache, "LAYOUT", weight_cache.LAYOUT + 1)  # ruvllm changed its layout
    assert not load_model(model_copy, "cpu", Q.Q8_0).from_weight_cache
    assert load_model(model_copy, "cpu", Q.Q8_0).from_weight_cache


FOREIGN_PACKING = r"""
import sys
from ruvllm_cli.engine.loader import load_model
from ruvllm_cli.quantization import Quantization
load_model(sys.argv[1], "cpu", Quantization.Q4_K_M)
"""


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() == "DEFAULT", reason="torch packs as the other process")
def test_q4k_weights_packed_under_another_cpu_capability_are_not_read(model_copy, monkeypatch):
    """torch's packed int4 bytes follow the CPU capability it dispatched to (AVX-512's
    blocks of 64 rows, AVX2's of 32): a model directory shared with another machine, here
    a process under ATEN_CPU_CAPABILITY=default, must not hand its q4k file to this one."""
    env = dict(os.environ, RUVLLM_WEIGHT_CACHE="1", ATEN_CPU_CAPABILITY="default")
    subprocess.run([sys.executable, "-c", FOREIGN_PACKING, str(model_copy)], env=env, capture_output=True,
                   timeout=300, check=True)
    (foreign,) = _cache_files(model_copy)
    assert foreign != weight_cache.cache_file(model_copy, Q.Q4_K_M).name
    loaded = load_model(model_copy, "cpu", Q.Q4_K_M)
    assert not loaded.from_weight_cache
    assert load_model(model_copy, "cpu", Q.Q4_K_M).from_weight_cache   # its own file, written anew
    assert _cache_files(model_copy) == [weight_cache.cache_file(model_copy, Q.Q4_K_M).name]
    monkeypatch.setenv(weight_cache.ENV, "0")
    assert torch.equal(_logits(loaded.model), _logits(load_model(model_copy, "cpu", Q.Q4_K_M).model))


def test_the_cache_can_be_turned_off(model_copy, monkeypatch):
    monkeypatch.setenv(weight_cache.ENV, "0")
    load_model(model_copy, "cpu", Q.Q4_K_M)
    assert not (model_copy / weight_cache.CACHE_DIR).exists()


def test_a_damaged_cache_file_is_quantized_again(model_copy):
    load_model(model_copy, "cpu", Q.Q4_K_M)
    cached = weight_cache.cache_file(model_copy, Q.Q4_K_M)
    cached.write_bytes(cached.read_bytes()[: cached.stat().st_size // 2])
    reloaded = load_model(model_copy, "cpu", Q.Q4_K_M)
    assert not reloaded.from_weight_cache
    assert load_model(model_copy, "cpu", Q.Q4_K_M).from_weight_cache   # and written anew


def test_a_cache_that_cannot_be_written_costs_only_speed(model_copy):
    (model_copy / weight_cache.CACHE_DIR).write_text("a file where the cache directory goes")
    first = load_model(model_copy, "cpu", Q.Q8_0)
    assert not first.from_weight_cache and not load_model(model_copy, "cpu", Q.Q8_0).from_weight_cache
    assert [p.name for p in model_copy.iterdir() if p.name.endswith(".tmp")] == []


KILLER = r"""
import os, signal, sys
from pathlib import Path
import safetensors.torch as st
from ruvllm_cli.engine.loader import load_model
from ruvllm_cli.quantization import Quantization
real = st.save_file
def save_then_die(tensors, filename, metadata=None):
    real(tensors, filename, metadata=metadata)
    if sys.argv[2] == "after-write":
        os.kill(os.getpid(), signal.SIGKILL)   # written under its temporary name, not yet renamed
    raise SystemExit("unreachable")
def die_midway(tensors, filename, metadata=None):
    Path(filename).write_bytes(b"partial")
    os.kill(os.getpid(), signal.SIGKILL)
st.save_file = save_then_die if sys.argv[2] == "after-write" else die_midway
load_model(sys.argv[1], "cpu", Quantization.Q8_0)
"""


@pytest.mark.parametrize("moment", ["midway", "after-write"])
def test_a_killed_write_never_leaves_a_cache_file_a_load_would_use(model_copy, moment):
    env = dict(os.environ, RUVLLM_WEIGHT_CACHE="1")
    done = subprocess.run([sys.executable, "-c", KILLER, str(model_copy), moment], env=env,
                          capture_output=True, timeout=300, check=False)
    assert done.returncode == -signal.SIGKILL
    assert not weight_cache.cache_file(model_copy, Q.Q8_0).exists()
    loaded = load_model(model_copy, "cpu", Q.Q8_0)
    assert not loaded.from_weight_cache
    assert load_model(model_copy, "cpu", Q.Q8_0).from_weight_cache


@pytest.mark.parametrize("quant", [Q.Q8_0, Q.Q4_K_M])
def test_a_tied_heads_shared_table_is_cached_once_and_shared_again(make_tiny_model, tmp_path, monkeypatch, quant):
    from safetensors import safe_open

    from ruvllm_cli.engine.int4_dense import packed_layout
    from ruvllm_cli.engine.quantize import INT4_INNER_K_TILES, int8_weights_here

    if quant is Q.Q8_0 and not int8_weights_here():
        pytest.skip("ruvllm's int8 kernel does not run here: fbgemm's layers keep a table each")
    if quant is Q.Q4_K_M and packed_layout(INT4_INNER_K_TILES) is None:
        pytest.skip("torch's packed int4 layout is not one ruvllm reads here: the embedding keeps a table")
    monkeypatch.setenv(weight_cache.ENV, "1")
    path = tmp_path / "model"
    shutil.copytree(make_tiny_model(**VARIANTS["tied-float32"]), path)
    first, second = load_model(path, "cpu", quant), load_model(path, "cpu", quant)
    assert not first.from_weight_cache and second.from_weight_cache
    for loaded in (first, second):
        model = loaded.model
        assert model.get_input_embeddings().qweight.data_ptr() == model.lm_head.qweight.data_ptr()
    assert second.weight_bytes == first.weight_bytes
    assert torch.equal(_logits(second.model), _logits(first.model))
    with safe_open(weight_cache.cache_file(path, quant), framework="pt") as handle:
        names = set(handle.keys())
    assert "lm_head.qweight" in names and not any(n.startswith("model.embed_tokens.") for n in names)


def test_a_cache_built_for_other_activations_is_not_read(model_copy, monkeypatch):
    """Our int8 kernel (float32 activations) on one machine, fbgemm's (bfloat16) where
    it cannot build: a file written by one is quantized again by the other."""
    from ruvllm_cli.engine import kernels
    from ruvllm_cli.engine.quantize import int8_weights_here
    from ruvllm_cli.engine.quantize import DynamicInt8Linear

    if not int8_weights_here():
        pytest.skip("ruvllm's int8 kernel does not run here")
    load_model(model_copy, "cpu", Q.Q8_0)
    monkeypatch.setenv(kernels.COMPILE_ENV, "0")
    kernels.int8_kernel.cache_clear()
    try:
        other = load_model(model_copy, "cpu", Q.Q8_0)
        assert not other.from_weight_cache and isinstance(other.model.lm_head, DynamicInt8Linear)
        assert load_model(model_copy, "cpu", Q.Q8_0).from_weight_cache
    finally:
        monkeypatch.delenv(kernels.COMPILE_ENV)
        kernels.int8_kernel.cache_clear()


def test_a_gguf_files_weights_and_tokenizer_are_kept_beside_it(make_tiny_model, tmp_path, monkeypatch):
    """A GGUF file's requantized weights and its tokenizer (which transformers builds
    from the file's metadata) are cached in the file's directory: the next load reads
    neither the file's blocks nor its vocabulary, and builds the same model and tokenizer."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    from ruvllm_cli.engine import tokenizer as own
    from ruvllm_cli.testing.tiny_gguf import write_gguf

    monkeypatch.setenv(weight_cache.ENV, "1")
    monkeypatch.setenv(own.ENV, "0")   # transformers' tokenizer, as its copy loads it (ruvllm's: below)
    path = write_gguf(make_tiny_model(), tmp_path / "tiny.gguf")
    first = load_model(path, "cpu", Q.Q4_K_M)
    assert not first.from_weight_cache
    assert _cache_files(tmp_path) == sorted([weight_cache.cache_file(path, Q.Q4_K_M).name,
                                             weight_cache.tokenizer_dir(path).name])
    parsed = []
    real = gguf_utils.load_gguf_checkpoint
    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", lambda *a, **k: parsed.append(a) or real(*a, **k))
    second = load_model(path, "cpu", Q.Q4_K_M)
    assert second.from_weight_cache and not parsed
    assert type(second.tokenizer) is type(first.tokenizer)
    assert weight_cache._same_tokenizer(second.tokenizer, first.tokenizer)
    assert second.eos_token_ids == first.eos_token_ids
    assert torch.equal(_logits(second.model), _logits(first.model))
    # A changed file is another key: read again, and its old copies replaced.
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))
    third = load_model(path, "cpu", Q.Q4_K_M)
    assert not third.from_weight_cache and parsed
    assert _cache_files(tmp_path) == sorted([weight_cache.cache_file(path, Q.Q4_K_M).name,
                                             weight_cache.tokenizer_dir(path).name])
    # With ruvllm's tokenizer on, the next load writes it down and the one after reads it.
    monkeypatch.setenv(own.ENV, "1")
    assert not isinstance(load_model(path, "cpu", Q.Q4_K_M).tokenizer, own.Tokenizer)
    assert own.record(path).is_file()
    fourth = load_model(path, "cpu", Q.Q4_K_M)
    assert isinstance(fourth.tokenizer, own.Tokenizer) and fourth.from_weight_cache
    assert own.differs(first.tokenizer, fourth.tokenizer) is None


def test_a_tokenizer_that_does_not_load_back_the_same_is_not_kept(make_tiny_model, tmp_path, monkeypatch):
    from ruvllm_cli.testing.tiny_gguf import write_gguf

    monkeypatch.setenv(weight_cache.ENV, "1")
    monkeypatch.setattr(weight_cache, "_same_tokenizer", lambda a, b: False)
    path = write_gguf(make_tiny_model(), tmp_path / "tiny.gguf")
    load_model(path, "cpu", Q.Q8_0)
    assert _cache_files(tmp_path) == [weight_cache.cache_file(path, Q.Q8_0).name]
