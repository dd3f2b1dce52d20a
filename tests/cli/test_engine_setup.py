"""What chat, serve and benchmark load when -q is not given (cli/engine_setup.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ruvllm_cli.cli.context import AppContext
from ruvllm_cli.cli.engine_setup import NO_BF16_NOTE, open_engine, weight_cache_line
from ruvllm_cli.quantization import Quantization


def opened_dtype(model: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *,
                 bf16_kernels: bool, quantization: Quantization | None = None,
                 half_kernel: bool = False, bf16_kernel: bool | None = None) -> tuple[torch.dtype, list[str]]:
    """Open the engine on CPU as if the CPU had (or lacked) oneDNN's bfloat16 kernels,
    our float16 kernel and (`bf16_kernel`, unless None) our bfloat16 kernel: (the loaded
    dtype, the stderr lines)."""
    import ruvllm_cli.engine.kernels as kernels
    import ruvllm_cli.engine.quantize as quantize

    monkeypatch.setattr(quantize, "cpu_has_bf16_kernels", lambda: bf16_kernels)
    if bf16_kernel is not None:
        monkeypatch.setattr(quantize, "bf16_weights_here", lambda: bf16_kernel)
    if not half_kernel:
        monkeypatch.setattr(kernels, "half_kernel", lambda: None)
    monkeypatch.setenv("COLUMNS", "400")
    opened = open_engine(AppContext(no_color=True), str(model), quantization=quantization, device="cpu",
                         max_num_seqs=1, max_model_len=64)
    return opened.loaded.dtype, capsys.readouterr().err.splitlines()


@pytest.fixture(scope="module")
def bf16_model_dir(make_tiny_model) -> Path:
    return make_tiny_model(dtype="bfloat16")


def test_no_bf16_kernels_default_is_float16_weights_in_our_kernel(
        bf16_model_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 22: where our float16 kernel runs, `f16` stays the default on an AVX2-only CPU."""
    from ruvllm_cli.engine.kernels import half_kernel

    if half_kernel() is None:
        pytest.skip("no C compiler or no AVX2/F16C here")
    capsys.readouterr()   # on a fresh machine the check above built the kernel, and said so
    dtype, lines = opened_dtype(bf16_model_dir, monkeypatch, capsys, bf16_kernels=False, half_kernel=True)
    assert dtype == torch.float32
    assert len(lines) == 1 and "· f16: 16-bit weights, float32 compute ·" in lines[0] and "float16 weights with float32 arithmetic" in lines[0]


def test_emulated_bf16_default_is_float16_weights_in_our_kernel(
        bf16_model_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """An AVX-512 CPU without AVX-512 BF16: oneDNN runs bfloat16 (emulated), our bfloat16
    kernel does not; float16 in our kernel was faster and smaller there (design, section 19)."""
    from ruvllm_cli.engine.kernels import half_kernel

    if half_kernel() is None:
        pytest.skip("no C compiler or no AVX2/F16C here")
    capsys.readouterr()
    dtype, lines = opened_dtype(bf16_model_dir, monkeypatch, capsys, bf16_kernels=True, half_kernel=True,
                                bf16_kernel=False)
    assert dtype == torch.float32
    assert len(lines) == 1 and "· f16: 16-bit weights, float32 compute ·" in lines[0] and "float16 weights with float32 arithmetic" in lines[0]


def test_no_bf16_kernels_default_is_float32_with_one_line(bf16_model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 23, item 1: on an AVX2-only CPU without our kernel bfloat16 runs unpacked;
    unasked, load float32."""
    dtype, lines = opened_dtype(bf16_model_dir, monkeypatch, capsys, bf16_kernels=False)
    assert dtype == torch.float32
    assert lines[0] == NO_BF16_NOTE
    assert len(lines) == 2 and lines[1].startswith("Loaded ") and "· cpu · float32 · context" in lines[1]


def test_float32_files_load_as_float32_without_a_note(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """The tiny model's checkpoint is float32: keeping it so needs no explanation."""
    dtype, lines = opened_dtype(tiny_model_dir, monkeypatch, capsys, bf16_kernels=False)
    assert dtype == torch.float32
    assert len(lines) == 1 and lines[0].startswith("Loaded ") and "· cpu · float32 · context" in lines[0]


def test_bf16_kernels_keep_the_16_bit_default(bf16_model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    dtype, lines = opened_dtype(bf16_model_dir, monkeypatch, capsys, bf16_kernels=True)
    assert dtype == torch.bfloat16
    assert len(lines) == 1 and "· cpu · f16: bfloat16 ·" in lines[0]


def test_explicit_f16_is_honoured_without_bf16_kernels(bf16_model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    dtype, lines = opened_dtype(bf16_model_dir, monkeypatch, capsys, bf16_kernels=False,
                                quantization=Quantization.F16)
    assert dtype == torch.bfloat16
    assert len(lines) == 1 and NO_BF16_NOTE not in lines[0]


def test_no_weight_cache_neither_reads_nor_writes_it(make_tiny_model, tmp_path, monkeypatch, capsys) -> None:
    """--no-weight-cache (chat, serve, benchmark) reaches the loader: no cache is written;
    without it a q8 load writes one, says where (the model is the user's own, outside
    the cache: it had been written there silently), and the next load reads it."""
    import shutil

    from click.testing import CliRunner

    from ruvllm_cli.cli.main import cli
    from ruvllm_cli.engine import weight_cache

    monkeypatch.setenv(weight_cache.ENV, "1")
    monkeypatch.setenv("COLUMNS", "400")
    model = tmp_path / "model"
    shutil.copytree(make_tiny_model(), model)
    off = open_engine(AppContext(no_color=True), str(model), quantization=Quantization.Q8_0, device="cpu",
                      weight_cache=False, max_num_seqs=1, max_model_len=64)
    assert not off.loaded.from_weight_cache and not (model / weight_cache.CACHE_DIR).exists()
    assert "Kept" not in capsys.readouterr().err
    first = open_engine(AppContext(no_color=True), str(model), quantization=Quantization.Q8_0, device="cpu",
                        max_num_seqs=1, max_model_len=64)
    assert (model / weight_cache.CACHE_DIR).is_dir()
    written = first.loaded.weight_cache_written
    assert written is not None and written.parent == model / weight_cache.CACHE_DIR and written.is_file()
    assert f"Kept these quantized weights for faster loads in {written.parent} (" in capsys.readouterr().err
    on = open_engine(AppContext(no_color=True), str(model), quantization=Quantization.Q8_0, device="cpu",
                     max_num_seqs=1, max_model_len=64)
    assert on.loaded.from_weight_cache and on.loaded.weight_cache_written is None
    assert "Kept" not in capsys.readouterr().err
    # a model in the cache (downloaded) keeps its weights there quietly: `rm` removes them with it
    assert weight_cache_line(written, tmp_path) is None and weight_cache_line(written, tmp_path / "other")
    for command in ("chat", "serve", "benchmark"):
        assert "--no-weight-cache" in CliRunner().invoke(cli, [command, "--help"]).output


def test_a_gguf_file_loads_as_its_file_type_and_another_q_says_what_happens(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 27, item 2: the file type (not the file name) picks the default; -q wins."""
    from ruvllm_cli.testing.tiny_gguf import write_gguf

    path = write_gguf(tiny_model_dir, tmp_path / "tiny.gguf")          # Q8_0, and its name says nothing
    _, lines = opened_dtype(path, monkeypatch, capsys, bf16_kernels=False)
    assert len(lines) == 1 and "· q8: 8-bit weights" in lines[0] and "GGUF Q8_0 tiny.gguf, tensor by tensor" in lines[0]
    _, lines = opened_dtype(path, monkeypatch, capsys, bf16_kernels=False, quantization=Quantization.Q4_K_M)
    assert lines[0] == ("-q q4k: the file's blocks are requantized into int4 where their layout differs "
                        "(without -q it loads as q8; the load line counts each way)")
    assert len(lines) == 2 and "· q4k: 4-bit weights" in lines[1] and "15 Q8_0 requantized into int4" in lines[1]


def test_a_quantized_gguf_on_cuda_defaults_to_16_bit_and_refuses_q8(tiny_model_dir: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """bitsandbytes (q8/q4k on CUDA) cannot read a GGUF file: found on a lent GPU, where
    `ruvllm chat FILE.gguf` failed with transformers' error. Decided here without a GPU."""
    from ruvllm_cli.cli.engine_setup import GGUF_ON_CUDA_NOTE, load_default
    from ruvllm_cli.engine import loader
    from ruvllm_cli.errors import ModelLoadError
    from ruvllm_cli.registry.locate import locate_model
    from ruvllm_cli.testing.tiny_gguf import write_gguf

    path = write_gguf(tiny_model_dir, tmp_path / "tiny.gguf")          # Q8_0
    monkeypatch.setattr(loader, "select_device", lambda device: torch.device("cuda"))
    located = locate_model(str(path), tmp_path / "cache", None)
    assert load_default(located, "auto") == (Quantization.F16, GGUF_ON_CUDA_NOTE)
    with pytest.raises(ModelLoadError, match="-q q8 on CUDA quantizes through bitsandbytes") as error:
        loader.load_model(path, "cuda", Quantization.Q8_0)
    assert "-q f16" in error.value.hint


def test_no_compile_keeps_our_kernels_out(tiny_model_dir, monkeypatch, capsys) -> None:
    """--no-compile (chat, serve, benchmark): no fused decode step and no kernel of our
    own; the load line says which decode path runs."""
    from click.testing import CliRunner

    from ruvllm_cli.cli.main import cli
    from ruvllm_cli.engine import kernels

    monkeypatch.setenv("COLUMNS", "400")
    monkeypatch.setenv(kernels.COMPILE_ENV, "1")   # restored after the test, whatever turn_off sets
    try:
        on = open_engine(AppContext(no_color=True), str(tiny_model_dir), quantization=Quantization.F32,
                         device="cpu", max_num_seqs=1, max_model_len=64)
        assert on.engine.runner.fused is not None
        assert "decode steps fused (C kernels)" in capsys.readouterr().err
        off = open_engine(AppContext(no_color=True), str(tiny_model_dir), quantization=Quantization.F32,
                          device="cpu", max_num_seqs=1, max_model_len=64, kernels=False)
        assert off.engine.runner.fused is None and kernels.decode_kernel() is None
        assert "fused" not in capsys.readouterr().err
    finally:
        monkeypatch.undo()
        for loader in (kernels.half_kernel, kernels.int8_kernel, kernels.decode_kernel):
            loader.cache_clear()
    for command in ("chat", "serve", "benchmark"):
        assert "--no-compile" in CliRunner().invoke(cli, [command, "--help"]).output


def test_a_reload_leaves_out_an_adapter_that_went_bad(tiny_model_dir, make_tiny_model, tmp_path, capsys) -> None:
    """serve's pooled loads (skip_bad_adapters): an unreadable adapter or one of another base
    model is left out with a warning; without it, either fails the load."""
    from ruvllm_cli.errors import RuvllmError
    from ruvllm_cli.testing.tiny_lora import MLP, build_lora_adapter

    good = build_lora_adapter(tiny_model_dir, tmp_path / "good", rank=4, targets=MLP)
    other = build_lora_adapter(make_tiny_model(hidden_size=96, num_heads=4), tmp_path / "other", rank=4, targets=MLP)
    adapters = [("good", good), ("gone", tmp_path / "gone"), ("other", other)]
    opened = open_engine(AppContext(no_color=True), str(tiny_model_dir), quantization=Quantization.F32,
                         device="cpu", adapters=adapters, skip_bad_adapters=True)
    assert opened.engine.lora.names() == ["good"]
    warnings = capsys.readouterr().err
    assert "LoRA adapter gone left out" in warnings and "LoRA adapter other left out" in warnings
    for bad in adapters[1:]:
        with pytest.raises(RuvllmError):
            open_engine(AppContext(no_color=True), str(tiny_model_dir), quantization=Quantization.F32,
                        device="cpu", adapters=[adapters[0], bad])


def test_a_hub_adapter_is_said_to_be_fetched_only_when_it_is(tiny_model_dir, fake_hub, isolated_env, tmp_path,
                                                             capsys):
    """`--lora NAME=OWNER/REPO`: "Fetching LoRA adapter" when it downloads, nothing once
    it is in the cache (the line showed on every start)."""
    import uuid

    from ruvllm_cli.cli.engine_setup import locate_adapters
    from ruvllm_cli.testing.tiny_lora import ATTENTION, build_lora_adapter

    repo_id = f"org/tiny-lora-{uuid.uuid4().hex[:8]}"
    fake_hub.add_model_dir(repo_id, build_lora_adapter(tiny_model_dir, tmp_path / "lora", rank=4, targets=ATTENTION))
    app = AppContext(no_color=True)
    first = locate_adapters(app, [f"hub={repo_id}"])
    assert f"Fetching LoRA adapter hub ({repo_id}) ..." in capsys.readouterr().err
    assert fake_hub.file_requests("adapter_model.safetensors")
    assert locate_adapters(app, [f"hub={repo_id}"]) == first
    assert "Fetching" not in capsys.readouterr().err


def test_threads_sets_torch_s_and_warns_beyond_the_cores(tiny_model_dir, capsys) -> None:
    """--threads (chat, serve, benchmark): torch's threads, which the C kernels take too;
    more than the usable cores is allowed with a warning (each step waits on them)."""
    from click.testing import CliRunner

    from ruvllm_cli.bench.noise import usable_cores
    from ruvllm_cli.cli.main import cli

    before = torch.get_num_threads()
    try:
        open_engine(AppContext(no_color=True), str(tiny_model_dir), quantization=Quantization.F32, device="cpu",
                    max_num_seqs=1, max_model_len=64, threads=1)
        assert torch.get_num_threads() == 1 and "--threads" not in capsys.readouterr().err
        many = usable_cores() + 1
        open_engine(AppContext(no_color=True), str(tiny_model_dir), quantization=Quantization.F32, device="cpu",
                    max_num_seqs=1, max_model_len=64, threads=many)
        assert torch.get_num_threads() == many
        assert f"--threads {many} is more than the {many - 1} CPU cores" in capsys.readouterr().err
        # A serve pool opens an engine at each model load: said once a process.
        open_engine(AppContext(no_color=True), str(tiny_model_dir), quantization=Quantization.F32, device="cpu",
                    max_num_seqs=1, max_model_len=64, threads=many)
        assert torch.get_num_threads() == many and "--threads" not in capsys.readouterr().err
    finally:
        torch.set_num_threads(before)
    for command in ("chat", "serve", "benchmark"):
        assert "--threads N" in CliRunner().invoke(cli, [command, "--help"]).output
