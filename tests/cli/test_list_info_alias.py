"""`ruvllm list`, `info` and `alias` as a user runs them (subprocess, isolated cache and config)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from rich.filesize import decimal as format_size

from ruvllm_cli.registry.cache import FileRecord, ModelCache
from ruvllm_cli.registry.memory import estimate_memory
from ruvllm_cli.registry.model_config import count_parameters, read_model_config
from ruvllm_cli.registry.registry import builtin_entries

Run = Callable[..., subprocess.CompletedProcess[str]]
ALIASES = list(builtin_entries())
COMMIT = "0123456789abcdef0123456789abcdef01234567"
WIDE = {"COLUMNS": "1000"}
REPO_ROOT = Path(__file__).resolve().parents[2]


def wide_env(cli_env: dict[str, str]) -> dict[str, str]:
    return {**cli_env, **WIDE}


def fake_download(cache_dir: Path, model_dir: Path, repo_id: str = "Qwen/Qwen2.5-0.5B-Instruct",
                  commit: str = COMMIT) -> Path:
    """Puts `model_dir`'s files into the cache as a complete download of `repo_id` at `main`."""
    cache = ModelCache(cache_dir)
    snapshot = cache.snapshot_dir(repo_id, commit)
    shutil.copytree(model_dir, snapshot)
    files = [FileRecord(p.name, p.stat().st_size) for p in sorted(snapshot.iterdir())]
    cache.write_ref(repo_id, "main", commit)
    cache.write_manifest(repo_id=repo_id, revision="main", commit=commit, files=files)
    return snapshot


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("Error:")]


# --- list --------------------------------------------------------------------------------------

def test_list_shows_the_registry(ruvllm: Run, cli_env: dict[str, str]) -> None:
    result = ruvllm("list", env=wide_env(cli_env))
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    for header in ("Alias", "Name", "Params", "Memory", "Status"):
        assert header in result.stdout
    for alias in ALIASES:
        assert f" {alias} " in result.stdout
    qwen_row = next(line for line in result.stdout.splitlines() if " qwen-0.5b " in line)
    assert "Qwen2.5 0.5B Instruct" in qwen_row and "494M" in qwen_row and "(q8)" in qwen_row
    assert "7.62B" in result.stdout and "weights as `ruvllm chat` would hold them" in result.stdout


def test_ls_is_list(ruvllm: Run) -> None:
    assert ruvllm("ls").stdout == ruvllm("list").stdout


def test_list_json_fields(ruvllm: Run) -> None:
    result = ruvllm("list", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["context"] == 4096
    assert [m["alias"] for m in data["models"]] == ALIASES
    expected_keys = {"alias", "repo_id", "name", "architecture", "params_b", "params", "context_length",
                     "use_case", "recommended_quantization", "notes", "sampling", "gguf_repo", "gguf_files",
                     "user", "path", "memory_estimate", "downloaded", "downloads"}
    for model in data["models"]:
        assert set(model) == expected_keys
        assert model["downloaded"] is False and model["downloads"] == [] and model["user"] is False
    small = next(m for m in data["models"] if m["alias"] == "qwen-0.5b")
    entry = builtin_entries()["qwen-0.5b"]
    assert small["repo_id"] == "Qwen/Qwen2.5-0.5B-Instruct"
    assert small["params"] == 494_032_768
    assert small["gguf_files"] == {"q4k": "qwen2.5-0.5b-instruct-q4_k_m.gguf",
                                   "q8": "qwen2.5-0.5b-instruct-q8_0.gguf",
                                   "f16": "qwen2.5-0.5b-instruct-fp16.gguf"}
    assert small["sampling"] == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.1}
    # not downloaded: estimated as the Q8_0 file `download` fetches loads (q8: the same bytes)
    assert small["memory_estimate"] == estimate_memory(entry.params, "q8", entry, 4096, gguf=True)
    assert small["memory_estimate"]["weights_from"] == "gguf"
    qwen = next(m for m in data["models"] if m["alias"] == "qwen")["memory_estimate"]
    # q4k from a GGUF file: groups of 32 everywhere, 0.625 bytes a weight (0.53 from safetensors)
    assert qwen["weights_bytes"] == round(7_615_616_512 * 0.625)


def test_list_long_shows_every_field(ruvllm: Run, cli_env: dict[str, str]) -> None:
    result = ruvllm("list", "--long", env=wide_env(cli_env))
    assert result.returncode == 0, result.stderr
    for field in ("Repo", "Architecture", "Parameters", "Context length", "Use case",
                  "Recommended quantization", "Memory estimate", "Sampling", "GGUF repo", "GGUF files",
                  "Notes", "Source", "Status"):
        assert result.stdout.count(field) >= len(ALIASES), field
    for text in ("Qwen/Qwen2.5-7B-Instruct", "7,615,616,512", "q4k: Qwen2.5-7B-Instruct-Q4_K_M.gguf",
                 "Gated: accept the Llama 3.2 licence", "temperature=0.6, top_p=0.9"):
        assert text in result.stdout
    assert ruvllm("ls", "-l", env=wide_env(cli_env)).stdout == result.stdout


def test_list_downloaded_when_empty(ruvllm: Run) -> None:
    result = ruvllm("list", "--downloaded")
    assert result.returncode == 0 and result.stdout == ""
    assert "No models downloaded yet" in result.stderr
    data = json.loads(ruvllm("list", "-d", "--json").stdout)
    assert data == {"models": [], "count": 0, "total_bytes": 0, "unfinished": []}


def test_list_downloaded_names_a_stopped_revision_beside_a_complete_one(ruvllm: Run, isolated_env: Any,
                                                                        tiny_model_dir: Path) -> None:
    """docs/design.md section 10: `list -d` names what a stopped download left, with its
    size; with main complete, a killed `download ID@dev`'s 20 MB partial file was not."""
    repo_id = "org/big"
    fake_download(isolated_env.cache_dir, tiny_model_dir, repo_id)
    blobs = ModelCache(isolated_env.cache_dir).repo_dir(repo_id) / "blobs"
    blobs.mkdir()
    (blobs / f"{'e' * 64}.0badc0de.incomplete").write_bytes(b"x" * 20_900_000)
    data = json.loads(ruvllm("list", "-d", "--json").stdout)
    assert data["count"] == 1 and data["unfinished"] == [{"repo_id": repo_id, "bytes": 20_900_000}]
    shown = " ".join(ruvllm("list", "-d").stderr.split())
    assert f"Not listed: 1 incomplete or damaged download: {repo_id} (20.9 MB)." in shown


def test_an_alias_with_its_safetensors_downloaded_is_estimated_from_them(ruvllm: Run, isolated_env: Any,
                                                                          tiny_model_dir: Path) -> None:
    """What would load decides the layout: the safetensors once they are in the cache
    (registry.locate prefers them), the registry's GGUF file before."""
    def weights_from() -> tuple[str, str, str]:   # list (as chat loads without -q), info at q4k
        listed = json.loads(ruvllm("list", "--json").stdout)["models"]
        small = next(m for m in listed if m["alias"] == "qwen-1.5b")
        return small["memory_estimate"]["weights_from"], small["memory_estimate"]["quantization"], json.loads(
            ruvllm("info", "qwen-1.5b", "--json").stdout)["memory"]["q4k"]["weights_from"]

    assert weights_from() == ("gguf", "q8", "gguf")
    fake_download(isolated_env.cache_dir, tiny_model_dir, repo_id="Qwen/Qwen2.5-1.5B-Instruct")
    # chat loads the safetensors as f16 without -q: list had said q8, the recommended one
    assert weights_from() == ("safetensors", "f16", "safetensors")


def test_an_alias_with_only_another_gguf_variant_downloaded_is_estimated_as_chat_loads_it(
        ruvllm: Run, isolated_env: Any, tiny_model_dir: Path, tmp_path: Path) -> None:
    """Only the q4k file of qwen-0.5b (recommended: q8) downloaded: chat without -q loads
    it, while list estimated the q8 file."""
    from ruvllm_cli.testing.tiny_gguf import write_gguf

    entry = builtin_entries()["qwen-0.5b"]
    repo = tmp_path / "repo"
    repo.mkdir()
    write_gguf(tiny_model_dir, repo / entry.gguf_files["q4k"], types=lambda _: "Q4_0")
    fake_download(isolated_env.cache_dir, repo, repo_id=entry.gguf_repo)
    listed = json.loads(ruvllm("list", "--json").stdout)["models"]
    memory = next(m for m in listed if m["alias"] == "qwen-0.5b")["memory_estimate"]
    assert memory == estimate_memory(entry.params, "q4k", entry, 4096, gguf=True)


def test_list_downloaded_shows_cached_models(ruvllm: Run, cli_env: dict[str, str], isolated_env: Any,
                                             tiny_model_dir: Path) -> None:
    snapshot = fake_download(isolated_env.cache_dir, tiny_model_dir)
    size = sum(p.stat().st_size for p in snapshot.iterdir())
    data = json.loads(ruvllm("list", "--downloaded", "--json").stdout)
    assert data["count"] == 1 and data["total_bytes"] == size
    (model,) = data["models"]
    assert (model["repo_id"], model["revision"], model["commit"]) == ("Qwen/Qwen2.5-0.5B-Instruct", "main", COMMIT)
    assert model["path"] == str(snapshot) and model["aliases"] == ["qwen-0.5b"]
    assert {f["name"] for f in model["files"]} == {p.name for p in snapshot.iterdir()}

    table = ruvllm("list", "-d", env=wide_env(cli_env))
    assert table.returncode == 0, table.stderr
    assert "Qwen/Qwen2.5-0.5B-Instruct (qwen-0.5b)" in table.stdout
    assert f"main ({COMMIT[:7]})" in table.stdout and str(snapshot) in table.stdout
    # Issue 23, item 8: file sizes in download's decimal units (MB), never MiB.
    assert f"Total: 1 model, {format_size(size)}" in table.stdout and "iB" not in table.stdout
    row = next(line for line in table.stdout.splitlines() if "Qwen/Qwen2.5-0.5B-Instruct" in line)
    assert f" {format_size(size)} " in row
    info = ruvllm("info", "qwen-0.5b", env=wide_env(cli_env)).stdout
    assert re.search(rf"│ Size +│ {re.escape(format_size(size))} +│", info)

    registry = json.loads(ruvllm("list", "--json").stdout)["models"]
    status = {m["alias"]: m["downloaded"] for m in registry}
    assert status == {alias: alias == "qwen-0.5b" for alias in ALIASES}
    row = next(line for line in ruvllm("list", env=wide_env(cli_env)).stdout.splitlines() if " qwen-0.5b " in line)
    assert "downloaded" in row


def test_list_downloaded_piped_keeps_every_cell_whole(ruvllm: Run, cli_env: dict[str, str], isolated_env: Any,
                                                       tiny_model_dir: Path) -> None:
    """No terminal and no COLUMNS (a pipe, a script): a row as long as its cells, never
    a repo id or path cut with an ellipsis at 80 columns."""
    snapshot = fake_download(isolated_env.cache_dir, tiny_model_dir, repo_id="Qwen/Qwen2.5-0.5B-Instruct-GGUF")
    env = {k: v for k, v in cli_env.items() if k != "COLUMNS"}
    table = ruvllm("list", "-d", env=env)
    assert table.returncode == 0, table.stderr
    row = next(line for line in table.stdout.splitlines() if "Qwen/Qwen2.5-0.5B-Instruct-GGUF" in line)
    assert str(snapshot) in row and "…" not in table.stdout


def _python_importtime() -> list[str]:
    return [sys.executable, "-X", "importtime", "-m", "ruvllm_cli"]


@pytest.mark.parametrize("args", [["list"], ["list", "--downloaded"], ["info", "qwen"], ["alias", "list"]])
def test_model_free_commands_import_no_torch(cli_env: dict[str, str], args: list[str]) -> None:
    result = subprocess.run([*_python_importtime(), *args], env=cli_env, cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    imported = {line.rsplit("|", 1)[1].strip().split(".")[0] for line in result.stderr.splitlines()
                if line.startswith("import time:") and "|" in line}
    assert not imported & {"torch", "transformers", "huggingface_hub"}


# --- info --------------------------------------------------------------------------------------

def test_info_registry_alias_json(ruvllm: Run) -> None:
    result = ruvllm("info", "qwen", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert (data["model"], data["kind"], data["repo_id"], data["revision"]) == \
        ("qwen", "registry", "Qwen/Qwen2.5-7B-Instruct", None)
    assert data["registry"]["name"] == "Qwen2.5 7B Instruct"
    assert data["registry"]["architecture"] == "Qwen2ForCausalLM"
    assert data["registry"]["context_length"] == 32768
    assert data["config"] is None and data["local"] is None
    assert data["downloaded"] is False and data["downloads"] == []
    assert (data["parameters"], data["parameter_source"]) == (7_615_616_512, "registry")
    assert list(data["memory"]) == ["q4k", "q8", "f16", "none"]
    entry = builtin_entries()["qwen"]
    for quant, memory in data["memory"].items():
        # the registry names GGUF files for q4k, q8 and f16: those are what would load
        gguf = quant != "none"
        assert memory == estimate_memory(entry.params, quant, entry, 4096, gguf=gguf)
        assert memory["weights_from"] == ("gguf" if gguf else "safetensors")


def test_info_registry_alias_table(ruvllm: Run, cli_env: dict[str, str]) -> None:
    result = ruvllm("info", "qwen", env=wide_env(cli_env))
    assert result.returncode == 0, result.stderr
    for text in ("registry alias", "Qwen/Qwen2.5-7B-Instruct", "Qwen2ForCausalLM", "Not downloaded",
                 "ruvllm download qwen", "Memory estimates", "Q4_K_M (q4k)", "F32 (none)",
                 "7,615,616,512 parameters, from the registry"):
        assert text in result.stdout, text


def test_info_local_tiny_model_json(ruvllm: Run, tiny_model_dir: Path) -> None:
    result = ruvllm("info", str(tiny_model_dir), "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert (data["kind"], data["repo_id"], data["registry"]) == ("local", None, None)
    shape = read_model_config(tiny_model_dir)
    assert data["config"] == {
        "architecture": "LlamaForCausalLM", "model_type": "llama", "hidden_size": 64, "num_layers": 2,
        "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 512,
        "context_length": 4096, "tie_word_embeddings": True, "torch_dtype": shape.torch_dtype,
    }
    assert data["config_path"] == str(tiny_model_dir / "config.json")
    assert (data["parameters"], data["parameter_source"]) == (count_parameters(shape), "safetensors headers")
    local = data["local"]
    assert local["path"] == str(tiny_model_dir) and local["format"] == "safetensors"
    assert local["weights"] == ["model.safetensors"]
    assert local["size_bytes"] == sum(f["size"] for f in local["files"]) > 0
    assert "config.json" in {f["name"] for f in local["files"]}
    # float32, and the tied head's packed copy of the 512 x 64 table; q8 one byte each
    assert data["memory"]["none"]["weights_bytes"] == 4 * (data["parameters"] + 512 * 64)
    assert data["memory"]["q8"]["weights_bytes"] == data["parameters"]
    assert data["memory"]["f16"]["kv_cache_bytes"] == 2 * 2 * 2 * 16 * 2 * 4096


def test_info_says_what_the_model_can_do_from_its_own_files(ruvllm: Run, tiny_model_dir: Path, make_tiny_model,
                                                           cli_env: dict[str, str]) -> None:
    """Ollama's `show` lists capabilities; ours come from the chat template serve would use."""
    plain = json.loads(ruvllm("info", str(tiny_model_dir), "--json").stdout)["capabilities"]
    assert plain == {"chat": True, "tools": "hermes", "reasoning": None}
    thinker = make_tiny_model(reasoning="opens")
    shown = ruvllm("info", str(thinker), env=wide_env(cli_env)).stdout
    assert "Capabilities: completion, chat, tools (hermes), reasoning (<think>...</think>)" in shown
    assert json.loads(ruvllm("info", "qwen", "--json").stdout)["capabilities"] is None   # no file at hand


def test_info_gguf_file_memory_from_its_header(ruvllm: Run, cli_env: dict[str, str], tiny_model_dir: Path,
                                               tmp_path: Path) -> None:
    """A GGUF file has no config.json beside it: its header gives the parameter count,
    the KV cache's shape and each weight's loaded size (the loader's own figure)."""
    torch = pytest.importorskip("torch")
    from ruvllm_cli.engine.gguf_check import check_gguf
    from ruvllm_cli.engine.loader import memory_needed
    from ruvllm_cli.quantization import Quantization
    from ruvllm_cli.testing.tiny_gguf import write_gguf

    gguf = write_gguf(tiny_model_dir, tmp_path / "tiny-Q8_0.gguf")
    result = ruvllm("info", str(gguf), "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    shape = read_model_config(tiny_model_dir)
    assert (data["parameters"], data["parameter_source"]) == (count_parameters(shape), "GGUF header")
    layout = check_gguf(gguf)
    for quantization in (Quantization.Q8_0, Quantization.Q4_K_M):
        memory = data["memory"][quantization.value]
        loader = memory_needed(gguf, None, torch.device("cpu"), quantization, layout)
        assert memory["weights_bytes"] == pytest.approx(loader, rel=0.02), quantization
        assert memory["kv_cache_bytes"] == 2 * 2 * 2 * 16 * 2 * 4096    # 2 layers, 2 KV heads of 16
        assert memory["total_bytes"] == sum(memory[k] for k in ("weights_bytes", "kv_cache_bytes",
                                                                "overhead_bytes"))
    shown = ruvllm("info", str(gguf), env=wide_env(cli_env)).stdout
    assert "Memory estimates" in shown and "from the GGUF header" in shown


def test_info_downloaded_gguf_repo_memory_from_its_file(ruvllm: Run, isolated_env: Any, tiny_model_dir: Path,
                                                        tmp_path: Path) -> None:
    from ruvllm_cli.testing.tiny_gguf import write_gguf

    repo = tmp_path / "repo"
    repo.mkdir()
    write_gguf(tiny_model_dir, repo / "tiny-Q8_0.gguf")
    fake_download(isolated_env.cache_dir, repo, repo_id="someone/Tiny-GGUF")
    data = json.loads(ruvllm("info", "someone/Tiny-GGUF", "--json").stdout)
    assert data["config"] is None and data["downloaded"] is True
    assert (data["parameters"], data["parameter_source"]) == (count_parameters(read_model_config(tiny_model_dir)),
                                                              "GGUF header")
    assert data["memory"]["q8"]["weights_from"] == "gguf" and data["memory"]["q8"]["kv_cache_bytes"] > 0


def test_info_local_gguf_file(ruvllm: Run, tmp_path: Path) -> None:
    gguf = tmp_path / "model-Q4_K_M.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 60)
    result = ruvllm("info", str(gguf), "--json")
    assert result.returncode == 1
    data = json.loads(result.stdout)
    assert data["kind"] == "local" and data["local"]["format"] == "gguf"
    assert data["local"]["weights"] == ["model-Q4_K_M.gguf"] and data["local"]["size_bytes"] == 64
    assert data["parameters"] is None and data["memory"] is None
    message = f"{gguf} is not a valid GGUF file: it is version 0; ruvllm reads little-endian GGUF versions 2 and 3"
    assert data["gguf"] == [{"path": str(gguf), "error": message}]
    assert error_lines(result.stderr) == [f"Error: {message}"]
    table = ruvllm("info", str(gguf))
    assert table.returncode == 1 and "Size" in table.stdout
    assert error_lines(table.stderr) == [f"Error: {message}"] and "Warning" not in table.stderr


def test_info_of_a_gguf_file_no_reader_takes_fails_as_its_load_would(ruvllm: Run, tiny_model_dir: Path,
                                                                    tmp_path: Path) -> None:
    """A helper's pass: an architecture neither ruvllm nor transformers' GGUF reader maps
    showed "Loading: through transformers ..., dequantized whole" with exit 0, and chat
    then failed on it."""
    from ruvllm_cli.testing.tiny_gguf import write_gguf

    path = write_gguf(tiny_model_dir, tmp_path / "odd.gguf", arch="frobnicator")
    result = ruvllm("info", str(path), "--json")
    message = f"{path}: ruvllm and transformers read no GGUF file of architecture frobnicator"
    assert result.returncode == 1 and json.loads(result.stdout)["gguf"] == [{"path": str(path), "error": message}]
    assert error_lines(result.stderr) == [f"Error: {message}"]


def test_info_gguf_says_what_each_tensor_becomes(ruvllm: Run, cli_env: dict[str, str], tiny_model_dir: Path,
                                                 tmp_path: Path) -> None:
    from ruvllm_cli.testing.tiny_gguf import write_gguf

    path = write_gguf(tiny_model_dir, tmp_path / "tiny.gguf")
    result = subprocess.run([*_python_importtime(), "info", str(path), "--json"], env=cli_env, cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    imported = {line.rsplit("|", 1)[1].strip().split(".")[0] for line in result.stderr.splitlines()
                if line.startswith("import time:") and "|" in line}
    assert "gguf" in imported and "torch" not in imported
    record, = json.loads(result.stdout)["gguf"]
    from ruvllm_cli.engine.loader import half_weights_here

    sixteen = "float16" if half_weights_here() else "bf16"   # what a load here does (the kernels say)
    assert record == {"path": str(path), "file_type": "Q8_0", "default_quantization": "q8",
                      "through_transformers": None, "tensors": {
                          "q4k": "15 Q8_0 requantized into int4; 5 norms and biases",
                          "q8": "15 Q8_0 requantized into int8; 5 norms and biases",
                          "f16": f"15 Q8_0 rounded into {sixteen}; 5 norms and biases",
                          "none": "15 Q8_0 dequantized exactly into float32; 5 norms and biases"},
                      "sampling_defaults": {}}
    table = ruvllm("info", str(path), env=wide_env(cli_env)).stdout
    for text in ("GGUF file", "q8 (without -q)", "tensor by tensor", "15 Q8_0 requantized into int8"):
        assert text in table, text


def test_info_downloaded_alias_reads_the_snapshot(ruvllm: Run, isolated_env: Any, tiny_model_dir: Path) -> None:
    snapshot = fake_download(isolated_env.cache_dir, tiny_model_dir)
    data = json.loads(ruvllm("info", "qwen-0.5b", "--json").stdout)
    assert data["downloaded"] is True
    (download,) = data["downloads"]
    assert (download["path"], download["commit"], download["revision"]) == (str(snapshot), COMMIT, "main")
    assert download["weights"] == ["model.safetensors"]
    assert data["config_path"] == str(snapshot / "config.json")
    assert data["config"]["hidden_size"] == 64
    assert data["parameter_source"] == "safetensors headers"
    assert data["parameters"] == count_parameters(read_model_config(tiny_model_dir))
    # The same download by hub id, and a revision that was never downloaded.
    assert json.loads(ruvllm("info", "Qwen/Qwen2.5-0.5B-Instruct", "--json").stdout)["downloaded"] is True
    other = json.loads(ruvllm("info", "qwen-0.5b@v2", "--json").stdout)
    assert other["downloaded"] is False and other["parameter_source"] == "registry"


def test_info_unknown_hub_id_needs_no_network(ruvllm: Run, cli_env: dict[str, str]) -> None:
    offline = {**cli_env, "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "1"}
    data = json.loads(ruvllm("info", "someone/unknown-model", "--json", env=offline).stdout)
    assert (data["kind"], data["repo_id"], data["registry"], data["downloaded"]) == \
        ("hub", "someone/unknown-model", None, False)
    assert data["parameters"] is None and data["memory"] is None
    table = ruvllm("info", "someone/unknown-model", env={**offline, **WIDE})
    assert table.returncode == 0, table.stderr
    assert "Not downloaded. Get it with: ruvllm download someone/unknown-model" in table.stdout
    assert "Memory estimates: unknown" in table.stdout


def test_info_unknown_name_is_one_error_with_a_suggestion(ruvllm: Run) -> None:
    result = ruvllm("info", "nosuchmodel")
    assert result.returncode == 1
    assert result.stdout == ""
    assert error_lines(result.stderr) == ["Error: unknown model 'nosuchmodel'"]
    assert "did you mean" not in result.stderr  # no alias is close: no guess that leads nowhere
    assert "ruvllm alias set nosuchmodel ORG/NAME (or a local directory)" in result.stderr
    assert "Traceback" not in result.stderr
    typo = ruvllm("info", "qwne")
    assert typo.returncode == 1 and "Hint: did you mean 'qwen'?" in typo.stderr


@pytest.mark.parametrize("name,code,message", [
    ("a/b/c", 2, "Error: invalid Hugging Face model id 'a/b/c'"),
    ("./missing-dir", 1, "Error: no such file or directory: './missing-dir'"),
    ("qwen@", 2, "Error: invalid model reference 'qwen@'"),
])
def test_info_bad_names(ruvllm: Run, name: str, code: int, message: str) -> None:
    result = ruvllm("info", name)
    assert result.returncode == code
    assert error_lines(result.stderr) == [message]


def test_info_directory_without_config(ruvllm: Run, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    result = ruvllm("info", str(tmp_path / "empty"))
    assert result.returncode == 1
    message = f"Error: '{tmp_path / 'empty'}' is not a model directory (it has no config.json)"
    assert error_lines(result.stderr) == [message]


# --- alias -------------------------------------------------------------------------------------

def list_row(ruvllm: Run, cli_env: dict[str, str], alias: str) -> list[str]:
    """The cells of the alias's row in `list` (Alias, Name, Params, Memory, Status)."""
    line = next(line for line in ruvllm("list", env=wide_env(cli_env)).stdout.splitlines() if f" {alias} " in line)
    return [cell.strip() for cell in line.strip("│ ").split("│")]


def test_list_tells_a_tiny_local_alias_and_its_path_deleted(ruvllm: Run, cli_env: dict[str, str],
                                                             tiny_model_dir: Path, tmp_path: Path) -> None:
    """A 106,816-parameter model read `0M`; a path deleted since still said `local`."""
    model = tmp_path / "tiny"
    shutil.copytree(tiny_model_dir, model)
    assert ruvllm("alias", "set", "mytiny", str(model)).returncode == 0
    count = count_parameters(read_model_config(model))
    assert count < 1_000_000
    alias, _, params, _, status = list_row(ruvllm, cli_env, "mytiny (user)")
    assert (params, status) == (f"{count / 1e6:.1f}M", "local") and params != "0.0M"
    shutil.rmtree(model)
    assert list_row(ruvllm, cli_env, "mytiny (user)")[4] == "missing"
    assert ruvllm("info", "mytiny").returncode == 1


def test_list_reads_an_alias_of_a_downloaded_gguf_repo_as_info_does(ruvllm: Run, cli_env: dict[str, str],
                                                                     isolated_env: Any, tiny_model_dir: Path,
                                                                     tmp_path: Path) -> None:
    """No config.json: list showed `-` for params and memory, which info reads from the GGUF header."""
    from ruvllm_cli.testing.tiny_gguf import write_gguf

    repo = tmp_path / "repo"
    repo.mkdir()
    write_gguf(tiny_model_dir, repo / "tiny-Q8_0.gguf")
    fake_download(isolated_env.cache_dir, repo, repo_id="someone/Tiny-GGUF")
    assert ruvllm("alias", "set", "tg", "someone/Tiny-GGUF").returncode == 0
    info = json.loads(ruvllm("info", "tg", "--json").stdout)
    listed = next(m for m in json.loads(ruvllm("list", "--json").stdout)["models"] if m["alias"] == "tg")
    assert listed["params"] == info["parameters"] == count_parameters(read_model_config(tiny_model_dir))
    assert listed["memory_estimate"] == info["memory"]["q8"]
    assert list_row(ruvllm, cli_env, "tg (user)")[3].endswith("(q8)")


def test_alias_set_list_rm(ruvllm: Run, cli_env: dict[str, str], isolated_env: Any) -> None:
    result = ruvllm("alias", "set", "mine", "someone/their-model", "--name", "Their model")
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip() == "Alias 'mine' -> someone/their-model"
    assert (isolated_env.config_dir / "aliases.json").is_file()

    listed = json.loads(ruvllm("alias", "list", "--json").stdout)
    assert listed["path"] == str(isolated_env.config_dir / "aliases.json")
    (alias,) = listed["aliases"]
    assert (alias["alias"], alias["repo_id"], alias["name"], alias["user"], alias["shadows_builtin"]) == \
        ("mine", "someone/their-model", "Their model", True, False)
    table = ruvllm("alias", "list", env=wide_env(cli_env))
    assert " mine " in table.stdout and "someone/their-model" in table.stdout

    models = json.loads(ruvllm("list", "--json").stdout)["models"]
    assert models[-1]["alias"] == "mine" and models[-1]["user"] is True
    row = next(line for line in ruvllm("list", env=wide_env(cli_env)).stdout.splitlines() if "mine" in line)
    assert "mine (user)" in row and "Their model" in row
    info = json.loads(ruvllm("info", "mine", "--json").stdout)
    assert (info["kind"], info["repo_id"], info["registry"]["user"]) == ("registry", "someone/their-model", True)

    removed = ruvllm("alias", "rm", "mine")
    assert removed.returncode == 0, removed.stderr
    assert removed.stderr.strip() == "Removed alias 'mine' (someone/their-model)"
    assert json.loads(ruvllm("alias", "list", "--json").stdout)["aliases"] == []
    assert "No user aliases yet" in ruvllm("alias", "list").stderr
    assert ruvllm("info", "mine").returncode == 1


def test_alias_of_a_local_directory_chats_by_its_name(ruvllm: Run, cli_env: dict[str, str], tiny_model_dir: Path,
                                                     tmp_path: Path) -> None:
    """Issue 23, item 7: `ruvllm alias set mytiny ./models/tiny` was refused."""
    work = tmp_path / "work"
    shutil.copytree(tiny_model_dir, work / "models" / "tiny")
    result = ruvllm("alias", "set", "mytiny", "./models/tiny", cwd=work)
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip() == f"Alias 'mytiny' -> {work / 'models' / 'tiny'}"
    chat = ruvllm("chat", "mytiny", "-q", "none", "--max-tokens", "2", input="hello\n")  # from another directory
    assert chat.returncode == 0, chat.stderr
    assert chat.stderr.startswith("Loaded mytiny · cpu · float32")
    row = next(line for line in ruvllm("list", env=wide_env(cli_env)).stdout.splitlines() if "mytiny" in line)
    assert "mytiny (user)" in row and row.rstrip(" │").endswith("local")
    # its size and memory from its config.json, as `info` reads them (they were "-")
    mine = next(m for m in json.loads(ruvllm("list", "--json").stdout)["models"] if m["alias"] == "mytiny")
    assert mine["params"] == count_parameters(read_model_config(tiny_model_dir))
    assert mine["memory_estimate"] is not None and mine["architecture"] == "LlamaForCausalLM"
    listed = json.loads(ruvllm("alias", "list", "--json").stdout)["aliases"]
    assert [(a["alias"], a["path"], a["repo_id"]) for a in listed] == [("mytiny", str(work / "models" / "tiny"), "")]
    # nothing the tool does not use: no recommended quantization (a local model loads as
    # its files are) nor registry sampling (chat samples as its generation_config.json
    # says); info had shown q4k and temperature=0.7, top_p=1.0, ... beside the model's
    info = ruvllm("info", "mytiny", env=wide_env(cli_env))
    assert "Recommended quantization" not in info.stdout and "│ Sampling  " not in info.stdout
    assert (mine["recommended_quantization"], mine["sampling"]) == (None, None)
    refused = ruvllm("alias", "set", "mytiny", str(work / "models" / "tiny"), "-q", "q8")
    assert refused.returncode == 2 and error_lines(refused.stderr) == [
        "Error: a recommended quantization names the GGUF file `ruvllm download` fetches for a repo; a local model "
        "loads as its files are"]


def test_a_user_alias_without_sampling_samples_as_its_model_recommends(isolated_env: Any) -> None:
    """A user alias had counted the registry's placeholder sampling (temperature 0.7,
    top_p 1, no top_k) as a recommendation, over the model's generation_config.json."""
    from types import SimpleNamespace

    from ruvllm_cli.cli.chat import recommended_sampling
    from ruvllm_cli.registry.registry import add_user_alias, resolve_model

    add_user_alias("mine", "someone/their-model")
    ref = resolve_model("mine")
    assert ref.kind == "registry" and not ref.entry.sampling_given and ref.entry.to_dict()["sampling"] is None
    model = {"temperature": 0.6, "top_p": 0.8}
    opened = SimpleNamespace(located=SimpleNamespace(ref=ref), engine=SimpleNamespace(sampling_defaults=model))
    assert recommended_sampling(opened) == model
    add_user_alias("mine", "someone/their-model", sampling={"temperature": 0.2})
    opened.located.ref = resolve_model("mine")
    assert recommended_sampling(opened)["temperature"] == 0.2
    builtin = resolve_model("qwen-0.5b")
    assert builtin.entry.sampling_given and builtin.entry.to_dict()["sampling"]["top_k"] == 20


def test_alias_shadowing_a_builtin(ruvllm: Run) -> None:
    result = ruvllm("alias", "set", "qwen", "me/my-qwen", "-q", "q8")
    assert result.returncode == 0, result.stderr
    assert "shadows the built-in alias" in result.stderr
    data = json.loads(ruvllm("info", "qwen", "--json").stdout)
    assert data["repo_id"] == "me/my-qwen" and data["registry"]["recommended_quantization"] == "q8"
    assert json.loads(ruvllm("alias", "list", "--json").stdout)["aliases"][0]["shadows_builtin"] is True
    removed = ruvllm("alias", "rm", "qwen")
    assert removed.returncode == 0 and "names the built-in model again" in removed.stderr
    assert json.loads(ruvllm("info", "qwen", "--json").stdout)["repo_id"] == "Qwen/Qwen2.5-7B-Instruct"


@pytest.mark.parametrize("args,code,message", [
    (["alias", "set", "Bad", "org/x"], 2, "Error: invalid alias name 'Bad'"),
    (["alias", "set", "ok", "not-a-repo"], 2, "Error: invalid Hugging Face model id 'not-a-repo'"),
    (["alias", "set", "my.gguf", "org/x"], 2,
     "Error: invalid alias name 'my.gguf': a name ending in .gguf is read as a GGUF file's path"),
    (["alias", "rm", "ghost"], 1, "Error: no user alias 'ghost'"),
    (["alias", "rm", "llama"], 2, "Error: 'llama' is a built-in alias and cannot be removed"),
])
def test_alias_errors(ruvllm: Run, args: list[str], code: int, message: str) -> None:
    result = ruvllm(*args)
    assert result.returncode == code
    assert error_lines(result.stderr) == [message]
    assert "Traceback" not in result.stderr


def test_an_aliases_file_that_cannot_be_written_is_one_error(ruvllm: Run, isolated_env: Any, unwritable) -> None:
    """It had been "Error: PermissionError: ... .aliases.json.1234.abc.tmp", naming a temp file."""
    assert ruvllm("alias", "set", "kept", "org/kept").returncode == 0
    path = isolated_env.config_dir / "aliases.json"
    reason = "Permission denied" if os.geteuid() != 0 else "Operation not permitted"
    with unwritable(isolated_env.config_dir):
        for args in (["alias", "set", "new", "org/new"], ["alias", "rm", "kept"]):
            result = ruvllm(*args)
            assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
            assert result.stderr.splitlines() == [
                f"Error: cannot write the user aliases file {path} ({reason})",
                f"Hint: make {isolated_env.config_dir} writable, or point RUVLLM_CONFIG_DIR at a directory that is"]
    assert json.loads(path.read_text())["aliases"] == {"kept": {"repo_id": "org/kept"}}


def test_corrupt_alias_file_is_one_error(ruvllm: Run, isolated_env: Any) -> None:
    isolated_env.config_dir.mkdir(parents=True)
    path = isolated_env.config_dir / "aliases.json"
    path.write_text("{broken")
    for args in (["list"], ["info", "qwen"], ["alias", "list"]):
        result = ruvllm(*args)
        assert result.returncode == 1
        (line,) = error_lines(result.stderr)
        assert line.startswith(f"Error: cannot read user aliases file {path}")


def test_info_with_a_corrupt_safetensors_header_shows_the_rest_and_fails(ruvllm: Run, tiny_model_dir: Path,
                                                                        tmp_path: Path) -> None:
    """It had exited 0 without a word, counting parameters from config.json instead."""
    model = tmp_path / "corrupt"
    shutil.copytree(tiny_model_dir, model)
    weights = model / "model.safetensors"
    weights.write_bytes((16).to_bytes(8, "little") + b"{not json at all" + bytes(64))
    result = ruvllm("info", str(model), "--json")
    assert result.returncode == 1
    data = json.loads(result.stdout)
    assert data["weights_error"] == f"{weights} has a corrupt safetensors header"
    assert data["parameter_source"] == "config.json shape" and data["memory"] is not None
    table = ruvllm("info", str(model))
    assert table.returncode == 1 and "Path" in table.stdout
    assert error_lines(table.stderr) == [f"Error: the weights could not be read: {weights} has a corrupt "
                                         "safetensors header"]


def test_info_with_an_unreadable_config_shows_the_rest_and_fails(ruvllm: Run, tmp_path: Path) -> None:
    model = tmp_path / "broken"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    result = ruvllm("info", str(model), "--json")
    assert result.returncode == 1  # as serve and chat fail on it: a script checking with info learns so
    data = json.loads(result.stdout)
    assert data["config"] is None and data["memory"] is None
    assert "lacks hidden_size" in data["config_error"]
    assert data["local"]["format"] == "no weights" and data["local"]["weights"] == []
    table = ruvllm("info", str(model))
    assert table.returncode == 1 and "Layers" not in table.stdout and "Path" in table.stdout
    (line,) = error_lines(table.stderr)
    assert line.startswith("Error: config.json could not be read:") and "lacks hidden_size" in line
