"""load_model's refusals: each a ModelLoadError with one clear line, before any weights
are read where that is possible."""

from __future__ import annotations

import json
import re
import shutil
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from ruvllm_cli.engine.loader import load_model
from ruvllm_cli.errors import ModelLoadError
from ruvllm_cli.quantization import Quantization as Q

Memory = namedtuple("Memory", "available")


def copy_model(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def test_a_directory_without_config_is_not_a_model(tmp_path):
    with pytest.raises(ModelLoadError, match=r"is not a model directory \(no config.json\)$") as error:
        load_model(tmp_path, "cpu", Q.F32)
    assert error.value.hint == "download the model first: ruvllm download MODEL"


@pytest.mark.parametrize("content, says", [(b"\xff\xfe{", "'utf-8' codec can't decode byte 0xff"),
                                            (b"[1, 2]", "is not a JSON object")])
def test_a_config_that_is_no_json_object_is_one_line(tmp_path, content, says):
    (tmp_path / "config.json").write_bytes(content)   # was UnicodeDecodeError / AttributeError
    with pytest.raises(ModelLoadError, match=re.escape(says)):
        load_model(tmp_path, torch.device("cpu"), Q.F32)


def test_a_directory_without_tokenizer_files_says_so_in_one_line(engine_model_dir, tmp_path):
    """transformers' own message for it ran over several lines and was cut after the first."""
    broken = copy_model(engine_model_dir, tmp_path / "notok")
    for file in broken.glob("tokenizer*"):
        file.unlink()
    with pytest.raises(ModelLoadError, match=r"^no tokenizer in .*notok: none of tokenizer.json, ") as error:
        load_model(broken, "cpu", Q.F32)
    assert error.value.hint == "the model's files are incomplete: download it again"


def test_an_unknown_architecture_is_unsupported(engine_model_dir, tmp_path):
    model = copy_model(engine_model_dir, tmp_path / "odd")
    config = json.loads((model / "config.json").read_text())
    config.update(model_type="no-such-family", architectures=["NoSuchForCausalLM"])
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"^unsupported model in .*odd: ") as error:
        load_model(model, "cpu", Q.F32)
    assert "\n" not in error.value.message


def test_weights_missing_from_the_file_are_refused_not_made_up(engine_model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    model = copy_model(engine_model_dir, tmp_path / "short")
    weights = load_file(model / "model.safetensors")
    del weights["model.norm.weight"], weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError) as error:
        load_model(model, "cpu", Q.F32)
    assert error.value.message == (f"{model} lacks weights the model needs: "
                                   "model.layers.1.mlp.up_proj.weight and 1 more")
    assert error.value.hint == "the file is damaged or incomplete: download it again"


def test_a_model_transformers_cannot_build_is_one_line(engine_model_dir, tmp_path):
    model = copy_model(engine_model_dir, tmp_path / "no-heads")
    config = json.loads((model / "config.json").read_text())
    config["num_key_value_heads"] = 0
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as error:
        load_model(model, "cpu", Q.F32)
    assert error.value.message == (f"cannot load the model in {model}: "
                                   "ZeroDivisionError: integer division or modulo by zero")
    assert error.value.hint == "the file may be damaged: download it again"


def weights_on_disk(model: Path) -> int:
    return sum(f.stat().st_size for f in model.glob("*.safetensors"))


def test_too_little_memory_is_refused_before_loading(engine_model_dir, monkeypatch):
    import psutil

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Memory(available=1024))
    with pytest.raises(ModelLoadError, match=r"^not enough memory: the weights need about .* GiB, "
                                             r".* GiB is free on cpu$") as error:
        load_model(engine_model_dir, "cpu", Q.F16)
    assert re.fullmatch(r"even --quantization q4k needs about \d+\.\d GiB: try a smaller model", error.value.hint)


# Weights, not per-row scales, dominate (as in real models).
WIDE = dict(hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=2, intermediate_size=1536)


def test_the_refusal_names_the_quantization_that_fits(make_tiny_model, monkeypatch):
    import psutil

    from ruvllm_cli.engine.loader import memory_needed

    engine_model_dir = make_tiny_model(**WIDE)
    cpu = torch.device("cpu")
    needs = {q: memory_needed(engine_model_dir, json.loads((engine_model_dir / "config.json").read_text()), cpu, q)
             for q in Q}
    assert needs[Q.F32] > needs[Q.Q8_0] > needs[Q.Q4_K_M]
    monkeypatch.setattr(psutil, "virtual_memory", lambda: Memory(available=needs[Q.Q8_0] + 1))
    with pytest.raises(ModelLoadError) as error:
        load_model(engine_model_dir, "cpu", Q.F32)
    assert error.value.hint.startswith("--quantization q8 needs about ")
    assert load_model(engine_model_dir, "cpu", Q.Q8_0).weight_bytes <= needs[Q.Q8_0] * 1.02


def test_the_quantized_estimate_matches_the_loaded_weights(make_tiny_model):
    from ruvllm_cli.engine.loader import memory_needed

    engine_model_dir = make_tiny_model(**WIDE)
    config = json.loads((engine_model_dir / "config.json").read_text())
    for quant in (Q.Q8_0, Q.Q4_K_M):
        loaded = load_model(engine_model_dir, "cpu", quant).weight_bytes
        estimate = memory_needed(engine_model_dir, config, torch.device("cpu"), quant)
        assert 0.97 < estimate / loaded < 1.03, (quant, estimate, loaded)


def test_memory_needed_is_the_weights_in_our_dtype_plus_a_tied_heads_packed_copy(engine_model_dir, monkeypatch):
    import psutil

    config = json.loads((engine_model_dir / "config.json").read_text())
    assert config["tie_word_embeddings"] and config["dtype"] == "float32"
    head_copy = config["vocab_size"] * config["hidden_size"] * 4      # float32 (none)
    on_disk = weights_on_disk(engine_model_dir)                       # a float32 file: no growth
    free = {"bytes": on_disk + head_copy + 1024}
    monkeypatch.setattr(psutil, "virtual_memory", lambda: Memory(available=free["bytes"]))
    assert load_model(engine_model_dir, "cpu", Q.F32).quantization is Q.F32   # just fits
    # Room for the file's weights but not for the head's second, packed copy.
    free["bytes"] = on_disk + head_copy // 2
    with pytest.raises(ModelLoadError, match="not enough memory"):
        load_model(engine_model_dir, "cpu", Q.F32)
    # q8 quantizes the head instead of packing a full-precision copy: it fits.
    assert load_model(engine_model_dir, "cpu", Q.Q8_0).quantization is Q.Q8_0


def _unstreamable(make_tiny_model, tmp_path: Path) -> Path:
    """A bfloat16 checkpoint with a tensor the model lacks: transformers' path loads it
    (and drops the extra), the streamed loader does not (its names must match)."""
    from safetensors.torch import load_file, save_file

    path = copy_model(make_tiny_model(**WIDE, dtype="bfloat16"), tmp_path / "extra")
    tensors = load_file(path / "model.safetensors")
    tensors["model.unused_extra.weight"] = torch.zeros(3, dtype=torch.bfloat16)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_transformers_peak_is_the_checkpoint_beside_the_quantized_model(make_tiny_model, tmp_path):
    from ruvllm_cli.engine.loader import memory_needed

    path = _unstreamable(make_tiny_model, tmp_path)
    config = json.loads((path / "config.json").read_text())
    cpu = torch.device("cpu")
    table = config["vocab_size"] * config["hidden_size"]
    on_disk = weights_on_disk(path)
    extra = {q: memory_needed(path, config, cpu, q, streamed=False) - memory_needed(path, config, cpu, q, streamed=True)
             for q in (Q.Q8_0, Q.Q4_K_M)}
    # q8's float32 activations: its bfloat16 table is widened whole before it is quantized.
    assert extra == {Q.Q8_0: on_disk + table * 4, Q.Q4_K_M: on_disk}


def test_a_checkpoint_that_does_not_stream_is_checked_again_before_transformers_reads_it(
        make_tiny_model, tmp_path, monkeypatch):
    import psutil

    from ruvllm_cli.engine import loader

    path = _unstreamable(make_tiny_model, tmp_path)
    config = json.loads((path / "config.json").read_text())
    cpu = torch.device("cpu")
    streamed = loader.memory_needed(path, config, cpu, Q.Q8_0, streamed=True)
    through = {q: loader.memory_needed(path, config, cpu, q, streamed=False) for q in (Q.Q8_0, Q.Q4_K_M)}
    assert through[Q.Q4_K_M] < through[Q.Q8_0]
    free = {"bytes": through[Q.Q4_K_M] + 1}     # the streamed figure fits, transformers' q8 does not
    assert streamed < free["bytes"]
    monkeypatch.setattr(psutil, "virtual_memory", lambda: Memory(available=free["bytes"]))
    real = loader._from_pretrained
    monkeypatch.setattr(loader, "_from_pretrained", lambda *a, **k: pytest.fail("weights read before the check"))
    with pytest.raises(ModelLoadError) as error:
        load_model(path, "cpu", Q.Q8_0, use_cache=False)
    assert re.fullmatch(r"not enough memory: the weights need about \d+\.\d GiB \(it loads through transformers, "
                        r"which holds the whole checkpoint meanwhile: checkpoint names differ .*\), "
                        r"\d+\.\d GiB is free on cpu", error.value.message)
    assert re.fullmatch(r"--quantization q4k needs about \d+\.\d GiB: try it", error.value.hint)
    # With room for transformers' peak it loads that way.
    monkeypatch.setattr(loader, "_from_pretrained", real)
    free["bytes"] = through[Q.Q8_0] + 1
    loaded = load_model(path, "cpu", Q.Q8_0, use_cache=False)
    assert not loaded.streamed and loaded.quantization is Q.Q8_0


def test_with_streaming_off_the_first_check_uses_transformers_peak(make_tiny_model, monkeypatch):
    import psutil

    from ruvllm_cli.engine import loader

    path = make_tiny_model(**WIDE, dtype="bfloat16")
    config = json.loads((path / "config.json").read_text())
    through = loader.memory_needed(path, config, torch.device("cpu"), Q.Q8_0, streamed=False)
    monkeypatch.setenv(loader.STREAM_ENV, "0")
    monkeypatch.setattr(psutil, "virtual_memory", lambda: Memory(available=through - 1))
    monkeypatch.setattr(loader, "_tokenizer", lambda *a, **k: pytest.fail("read before the check"))
    with pytest.raises(ModelLoadError, match=r"^not enough memory: the weights need about .* GiB, "):
        load_model(path, "cpu", Q.Q8_0, use_cache=False)


def test_the_memory_check_sees_a_containers_memory_limit(tmp_path, monkeypatch):
    """docker --memory (cgroup v2 or v1): the host's available memory can be far more than
    the limit, past which the kernel kills the process without a word (found by an audit)."""
    from ruvllm_cli.engine import loader

    gib = 1 << 30
    v2 = tmp_path / "v2"
    (v2 / "job").mkdir(parents=True)
    (tmp_path / "cgroup2").write_text("0::/job\n")
    (v2 / "job" / "memory.max").write_text(f"{2 * gib}\n")
    (v2 / "job" / "memory.current").write_text(f"{gib}\n")
    (v2 / "job" / "memory.stat").write_text(f"anon 1\ninactive_file {gib // 2}\n")
    assert loader.cgroup_room(tmp_path / "cgroup2", v2) == gib + gib // 2   # the inactive page cache is room
    (v2 / "job" / "memory.max").write_text("max\n")
    assert loader.cgroup_room(tmp_path / "cgroup2", v2) is None
    v1 = tmp_path / "v1" / "memory"
    v1.mkdir(parents=True)
    (tmp_path / "cgroup1").write_text("9:cpu,cpuacct:/\n4:memory:/\n")
    (v1 / "memory.limit_in_bytes").write_text(f"{3 * gib}\n")
    (v1 / "memory.usage_in_bytes").write_text(f"{gib}\n")
    (v1 / "memory.stat").write_text("total_inactive_file 0\n")
    assert loader.cgroup_room(tmp_path / "cgroup1", tmp_path / "v1") == 2 * gib
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")   # v1's "no limit"
    assert loader.cgroup_room(tmp_path / "cgroup1", tmp_path / "v1") is None
    assert loader.cgroup_room(tmp_path / "none", tmp_path / "nothing") is None
    monkeypatch.setattr(loader, "cgroup_room", lambda: 123 << 20)
    assert loader.free_memory(torch.device("cpu")) == 123 << 20


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_decode_weight_bytes_leave_out_an_embedding_table_only_its_rows_are_read_of(make_tiny_model, tied):
    """The benchmark's GB/s had counted every byte held, the embedding table beside a
    head of its own among them (a third more on the tiny model), as read each step."""
    from ruvllm_cli.engine.loader import decode_weight_bytes

    model_dir = make_tiny_model(tie_word_embeddings=tied)
    config = json.loads((model_dir / "config.json").read_text())
    table = config["vocab_size"] * config["hidden_size"]
    for quant, table_bytes, shared in ((Q.F32, 4 * table, False), (Q.F16, 2 * table, tied),
                                       (Q.Q8_0, table, tied)):
        loaded = load_model(model_dir, "cpu", quant)
        expected = loaded.weight_bytes - (0 if shared else table_bytes)
        assert decode_weight_bytes(loaded.model) == pytest.approx(expected, rel=0.02), quant
