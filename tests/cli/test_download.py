"""`ruvllm download` end to end: the real huggingface_hub client against the fake hub."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from rich.filesize import decimal as format_size

from ruvllm_cli.errors import DownloadError
from ruvllm_cli.registry.cache import ModelCache
from ruvllm_cli.registry.download import download_model, map_hub_error
from ruvllm_cli.registry.registry import resolve_model
from ruvllm_cli.testing.fake_hub import FakeHub, hub_file

ALIAS_REPO = "Qwen/Qwen2.5-0.5B-Instruct"  # what the registry alias `qwen-0.5b` names
MIB = 1024 * 1024
TINY_FILES = ["chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
              "tokenizer.json", "tokenizer_config.json"]
Run = Callable[..., subprocess.CompletedProcess]


def unique_repo(prefix: str = "model") -> str:
    """Repos live for the whole session: every test gets its own."""
    return f"ruvllm-tests/{prefix}-{uuid.uuid4().hex[:8]}"


def assert_one_error(result: subprocess.CompletedProcess, message: str, hint: str | None = None,
                     code: int = 1) -> None:
    """Exactly `Error: <message>` (and `Hint: <hint>`) on stderr, nothing on stdout, no
    traceback; after the line that says what began downloading, where the hub refused a file."""
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""
    expected = [f"Error: {message}"] + ([f"Hint: {hint}"] if hint else [])
    lines = result.stderr.splitlines()
    assert lines[-len(expected):] == expected and all(line.startswith("Downloading ") for line in
                                                      lines[:-len(expected)][:1]) and len(lines) <= len(expected) + 1


def snapshot_of(cache_dir: Path, repo_id: str, commit: str) -> Path:
    return cache_dir / "hub" / f"models--{repo_id.replace('/', '--')}" / "snapshots" / commit


def already_downloaded(repo_id: str, commit: str, cache_dir: Path, source: Path) -> list[str]:
    """The lines `download` prints for a model whose files are all there."""
    return [f"{repo_id}@main (commit {commit[:7]}, safetensors f32) is already downloaded: "
            f"{snapshot_of(cache_dir, repo_id, commit)} ({format_size(total_size(source))}, 6 files)",
            "Nothing fetched; use --force to fetch it again."]


def assert_same_files(snapshot: Path, source: Path, names: list[str]) -> None:
    assert sorted(p.name for p in snapshot.iterdir()) == names
    for name in names:
        assert (snapshot / name).read_bytes() == (source / name).read_bytes(), name


def hub_asks(hub: FakeHub) -> list[str]:
    """The requests a run made (method and path), less the client's once-a-process registry fetch."""
    return [f"{r.method} {r.path}" for r in hub.requests if r.path != "/api/agent-harnesses"]


def only_which_commit(repo_id: str, revision: str | None = None) -> list[str]:
    """What a run asks of the hub for a branch complete in the cache: which commit it is
    now (the default branch without a revision)."""
    return [f"GET /api/models/{repo_id}" + (f"/revision/{revision}" if revision else "")]


def resolve_gets(hub: FakeHub) -> list[str]:
    return [r.path.rsplit("/", 1)[-1] for r in hub.requests if r.method == "GET" and "/resolve/" in r.path]


@pytest.fixture
def repo(fake_hub: FakeHub, tiny_model_dir: Path) -> tuple[str, str]:
    """A fresh repo holding the tiny model (plus README.md and .gitattributes): (repo_id, commit)."""
    repo_id = unique_repo()
    return repo_id, fake_hub.add_model_dir(repo_id, tiny_model_dir)


# -- happy paths ------------------------------------------------------------------------------
def test_download_by_alias_fetches_exactly_the_needed_files(ruvllm: Run, fake_hub: FakeHub, tiny_model_dir: Path,
                                                            isolated_env) -> None:
    commit = fake_hub.add_model_dir(ALIAS_REPO, tiny_model_dir)
    result = ruvllm("download", "qwen-0.5b", "--safetensors")
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""
    snapshot = snapshot_of(isolated_env.cache_dir, ALIAS_REPO, commit)
    size = format_size(total_size(tiny_model_dir))
    starting, fetched, done = result.stderr.splitlines()
    assert starting == f"Downloading {ALIAS_REPO} (commit {commit[:7]}): 6 of 6 files to fetch, {size}"
    assert fetched.startswith(f"Fetched 6 files ({size}) in ") and fetched.endswith("; 0 already in the cache.")
    # The label says what the files are (the tiny model is a float32 checkpoint), not a -q.
    assert done == (f"Downloaded {ALIAS_REPO}@main (commit {commit[:7]}, safetensors f32) to {snapshot} "
                    f"({size}, 6 files)")
    assert_same_files(snapshot, tiny_model_dir, TINY_FILES)
    assert sorted(resolve_gets(fake_hub)) == TINY_FILES  # no README.md, no .gitattributes
    manifest = json.loads((isolated_env.cache_dir / "manifests" / "Qwen--Qwen2.5-0.5B-Instruct"
                           / f"{commit}.json").read_text())
    assert manifest["repo_id"] == ALIAS_REPO and manifest["revision"] == "main" and manifest["commit"] == commit
    assert manifest["stored_as"] == "safetensors f32" and "quantization" not in manifest
    assert manifest["files"] == [{"name": n, "size": (tiny_model_dir / n).stat().st_size} for n in TINY_FILES]
    assert manifest["total_bytes"] == sum(f["size"] for f in manifest["files"])


def test_alias_downloads_the_registry_gguf_variant_and_chat_loads_it(
        ruvllm: Run, fake_hub: FakeHub, tiny_model_dir: Path, isolated_env, tmp_path: Path) -> None:
    from ruvllm_cli.quantization import Quantization
    from ruvllm_cli.registry.registry import builtin_entries
    from ruvllm_cli.testing.tiny_gguf import write_gguf

    entry = builtin_entries()["qwen-0.5b"]
    assert entry.recommended_quantization is Quantization.Q8_0
    wanted = entry.gguf_files[Quantization.Q8_0]
    tiny = write_gguf(tiny_model_dir, tmp_path / "tiny.gguf").read_bytes()
    other = entry.gguf_files[Quantization.Q4_K_M]
    commit = fake_hub.add_repo(entry.gguf_repo, {wanted: tiny, other: tiny, "README.md": b"# GGUF"})
    result = ruvllm("download", "qwen-0.5b")                     # the registry's recommended q8 by default
    assert result.returncode == 0, result.stderr
    snapshot = snapshot_of(isolated_env.cache_dir, entry.gguf_repo, commit)
    assert [p.name for p in snapshot.iterdir()] == [wanted]          # exactly the named file
    assert resolve_gets(fake_hub) == [wanted]
    listed = json.loads(ruvllm("list", "--json").stdout)
    assert next(m for m in listed["models"] if m["alias"] == "qwen-0.5b")["downloaded"] is True
    chat = ruvllm("chat", "qwen-0.5b", "--max-tokens", "3", input="hello\n")
    assert chat.returncode == 0, chat.stderr
    assert wanted in chat.stderr and "Q8_0" in chat.stderr        # the file's own quantization
    missing = ruvllm("chat", "qwen-0.5b", "-q", "q4k", input="hello\n")
    assert_one_error(missing, "qwen-0.5b is not downloaded", "run: ruvllm download qwen-0.5b -q q4k")
    # The second variant joins the first: both stay usable, the recommended one by default.
    assert ruvllm("download", "qwen-0.5b", "-q", "q4k").returncode == 0
    assert sorted(p.name for p in snapshot.iterdir()) == sorted([wanted, other])
    for args, name in ((["-q", "q4k"], other), ([], wanted)):
        chat = ruvllm("chat", "qwen-0.5b", *args, "--max-tokens", "3", input="hello\n")
        assert chat.returncode == 0 and name in chat.stderr, chat.stderr


def test_a_revision_on_an_alias_applies_to_its_gguf_repo(ruvllm: Run, fake_hub: FakeHub, tiny_model_dir: Path,
                                                         isolated_env) -> None:
    """`dl qwen-0.5b@main` and `--revision main -q q4k` switched to the safetensors repo and
    ignored -q; the revision is one of the repo the alias downloads."""
    from ruvllm_cli.quantization import Quantization
    from ruvllm_cli.registry.locate import locate_model
    from ruvllm_cli.registry.registry import builtin_entries

    entry = builtin_entries()["qwen-0.5b"]
    q8, q4 = entry.gguf_files[Quantization.Q8_0], entry.gguf_files[Quantization.Q4_K_M]
    commit = fake_hub.add_repo(entry.gguf_repo, {q8: b"q8" * 50, q4: b"q4" * 40, "README.md": b"# GGUF"})
    safetensors_commit = fake_hub.add_model_dir(ALIAS_REPO, tiny_model_dir)
    cache = ModelCache(isolated_env.cache_dir)
    snapshot = snapshot_of(isolated_env.cache_dir, entry.gguf_repo, commit)

    result = ruvllm("dl", "qwen-0.5b@main")
    assert result.returncode == 0, result.stderr
    assert resolve_gets(fake_hub) == [q8] and [p.name for p in snapshot.iterdir()] == [q8]
    fake_hub.reset()
    result = ruvllm("download", "qwen-0.5b", "--revision", "main", "-q", "q4k")
    assert result.returncode == 0, result.stderr
    assert resolve_gets(fake_hub) == [q4] and sorted(p.name for p in snapshot.iterdir()) == sorted([q4, q8])
    assert cache.find(ALIAS_REPO) is None
    # What was fetched at a revision is found at that revision.
    assert locate_model("qwen-0.5b@main", cache.root, Quantization.Q4_K_M).path == snapshot / q4
    assert locate_model("qwen-0.5b@main", cache.root).path == snapshot / q8
    assert (cache.repo_dir(entry.gguf_repo) / "refs" / "main").read_text() == commit

    result = ruvllm("download", "qwen-0.5b@main", "--safetensors")
    assert result.returncode == 0, result.stderr
    assert cache.find(ALIAS_REPO, "main").commit == safetensors_commit


def test_labels_say_what_the_files_are_and_q_applies_at_load(ruvllm: Run, fake_hub: FakeHub, repo,
                                                              tiny_model_dir: Path, isolated_env,
                                                              cli_env: dict[str, str]) -> None:
    """Issue 23, item 1: a safetensors download is labelled by its dtype, never by a -q;
    another -q finds the same files downloaded and says that -q applies when loading."""
    repo_id, commit = repo
    first = ruvllm("download", repo_id)
    assert first.returncode == 0, first.stderr
    assert "(commit %s, safetensors f32)" % commit[:7] in first.stderr
    assert "q4k" not in first.stderr and "applies when the model loads" not in first.stderr
    again = ruvllm("download", repo_id, "-q", "none")
    assert again.returncode == 0, again.stderr
    assert again.stderr.splitlines() == [
        *already_downloaded(repo_id, commit, isolated_env.cache_dir, tiny_model_dir),
        f"-q none applies when the model loads: ruvllm chat {repo_id} -q none",
    ]
    listed = ruvllm("list", "--downloaded", env={**cli_env, "COLUMNS": "300"})
    row = next(line for line in listed.stdout.splitlines() if repo_id in line)
    assert "safetensors f32" in row and "q4k" not in row and "Stored as" in listed.stdout
    data = json.loads(ruvllm("list", "--downloaded", "--json").stdout)
    model = next(m for m in data["models"] if m["repo_id"] == repo_id)
    assert model["stored_as"] == "safetensors f32" and model["weight_cache_bytes"] == 0
    # ruvllm's quantized-weight cache beside the files counts (rm removes it with them)
    (Path(model["path"]) / ".ruvllm-weights").mkdir()
    (Path(model["path"]) / ".ruvllm-weights" / "q8-layout.safetensors").write_bytes(b"x" * 5000)
    data = json.loads(ruvllm("list", "--downloaded", "--json").stdout)
    assert next(m for m in data["models"] if m["repo_id"] == repo_id)["weight_cache_bytes"] == 5000
    listed = ruvllm("list", "--downloaded", env={**cli_env, "COLUMNS": "300"})
    assert "(cache 5.0 kB)" in listed.stdout and "quantized-weight cache" in listed.stdout


def test_each_command_help_shows_its_quantization_default(ruvllm: Run, cli_env: dict[str, str]) -> None:
    for command, default in (("download", "[default: the alias's recommended one (ruvllm list), else q4k, "
                                          "else a GGUF repo's only file]"),
                             ("chat", "[default: what the files are: a GGUF file keeps its type "
                                      "(Q4_K_M as q4k, Q8_0 as q8, F16 as none);"),
                             ("serve", "[default: what the files are"), ("benchmark", "[default: what the files are")):
        text = " ".join(ruvllm(command, "--help", env={**cli_env, "COLUMNS": "2000"}).stdout.split())
        assert default in text, (command, text)


def test_download_by_id_then_skips_after_asking_only_for_the_commit(ruvllm: Run, fake_hub: FakeHub, repo,
                                                                    tiny_model_dir: Path, isolated_env) -> None:
    repo_id, commit = repo
    assert ruvllm("dl", repo_id, "-q", "q8").returncode == 0
    fake_hub.reset()
    again = ruvllm("download", repo_id)
    assert again.returncode == 0, again.stderr
    assert again.stderr.splitlines() == already_downloaded(repo_id, commit, isolated_env.cache_dir, tiny_model_dir)
    assert hub_asks(fake_hub) == only_which_commit(repo_id)   # whether main moved; no file request
    fake_hub.reset()
    by_hash = ruvllm("download", f"{repo_id}@{commit}")   # a commit cannot move: nothing asked
    assert by_hash.returncode == 0 and "is already downloaded" in by_hash.stderr and hub_asks(fake_hub) == []


def test_force_fetches_every_file_again(ruvllm: Run, fake_hub: FakeHub, repo, tiny_model_dir: Path,
                                        isolated_env) -> None:
    repo_id, commit = repo
    assert ruvllm("download", repo_id).returncode == 0
    fake_hub.reset()
    result = ruvllm("download", repo_id, "--force", "-v")
    assert result.returncode == 0, result.stderr
    assert sorted(resolve_gets(fake_hub)) == TINY_FILES
    for name in TINY_FILES:
        assert f"  fetched {name} (" in result.stderr
    assert "Fetched 6 files" in result.stderr
    assert_same_files(snapshot_of(isolated_env.cache_dir, repo_id, commit), tiny_model_dir, TINY_FILES)


def test_revisions_are_kept_apart(ruvllm: Run, fake_hub: FakeHub, repo, tiny_model_dir: Path, tmp_path: Path,
                                  isolated_env) -> None:
    repo_id, main = repo
    v2_dir = tmp_path / "v2"
    shutil.copytree(tiny_model_dir, v2_dir)
    config = json.loads((v2_dir / "config.json").read_text())
    (v2_dir / "config.json").write_text(json.dumps({**config, "ruvllm_test_revision": 2}))
    v2 = fake_hub.add_model_dir(repo_id, v2_dir, revision="v2")
    assert ruvllm("download", repo_id).returncode == 0
    fake_hub.reset()
    result = ruvllm("download", repo_id, "--revision", "v2")
    assert result.returncode == 0, result.stderr
    assert f"Downloaded {repo_id}@v2 (commit {v2[:7]}, safetensors f32)" in result.stderr
    # A new snapshot; the blobs both revisions share are linked, not fetched again.
    assert "Fetched 1 file " in result.stderr and "; 5 already in the cache." in result.stderr
    assert resolve_gets(fake_hub) == ["config.json"]
    fake_hub.reset()
    assert "is already downloaded" in ruvllm("download", f"{repo_id}@v2").stderr
    assert hub_asks(fake_hub) == only_which_commit(repo_id, "v2")

    cache = ModelCache(isolated_env.cache_dir)
    found_main, found_v2 = cache.find(repo_id), cache.find(repo_id, "v2")
    assert (found_main.commit, found_v2.commit) == (main, v2)
    assert found_main.path != found_v2.path
    assert (found_v2.path / "config.json").read_bytes() == (v2_dir / "config.json").read_bytes()
    assert (found_main.path / "config.json").read_bytes() == (tiny_model_dir / "config.json").read_bytes()
    manifests = sorted(p.name for p in (isolated_env.cache_dir / "manifests" / repo_id.replace("/", "--")).iterdir())
    assert manifests == sorted([f"{main}.json", f"{v2}.json"])


def commit_changed_config(hub: FakeHub, repo_id: str, source: Path, tmp_path: Path) -> str:
    """A new commit on main: the model's files with config.json changed (a key added)."""
    changed = tmp_path / "moved"
    shutil.copytree(source, changed)
    config = json.loads((changed / "config.json").read_text())
    (changed / "config.json").write_text(json.dumps({**config, "ruvllm_test_moved": True}))
    return hub.add_model_dir(repo_id, changed)


def test_a_branch_that_moved_fetches_its_new_commit_linking_unchanged_blobs(
        ruvllm: Run, fake_hub: FakeHub, repo, tiny_model_dir: Path, tmp_path: Path, isolated_env,
        cli_env: dict[str, str]) -> None:
    """`download` had said "already downloaded" for main's old commit without asking the
    hub, and only --force (every file again) got the new one, as `huggingface-cli
    download` and `ollama pull` do with a plain run."""
    repo_id, old = repo
    assert ruvllm("download", repo_id).returncode == 0
    new = commit_changed_config(fake_hub, repo_id, tiny_model_dir, tmp_path)
    fake_hub.reset()
    result = ruvllm("download", repo_id)
    assert result.returncode == 0, result.stderr
    assert resolve_gets(fake_hub) == ["config.json"]   # the other blobs did not change: linked
    assert "Fetched 1 file " in result.stderr and "; 5 already in the cache." in result.stderr
    assert f"Downloaded {repo_id}@main (commit {new[:7]}, safetensors f32)" in result.stderr
    cache = ModelCache(isolated_env.cache_dir)
    assert cache.find(repo_id).commit == new and json.loads((cache.find(repo_id).path / "config.json")
                                                            .read_text())["ruvllm_test_moved"] is True
    # The old commit stays, complete, until rm; list -d tells the two apart.
    assert cache.find(repo_id, old).commit == old
    listed = json.loads(ruvllm("list", "--downloaded", "--json").stdout)
    rows = {m["commit"]: m["current"] for m in listed["models"] if m["repo_id"] == repo_id}
    assert rows == {old: False, new: True}
    table = ruvllm("list", "--downloaded", env={**cli_env, "COLUMNS": "300"}).stdout
    assert f"main ({new[:7]})" in table and f"{old[:7]} (was main)" in table
    fake_hub.reset()
    again = ruvllm("download", repo_id)
    assert "is already downloaded" in again.stderr and hub_asks(fake_hub) == only_which_commit(repo_id)
    assert ruvllm("rm", "-y", f"{repo_id}@{old[:7]}").returncode == 0
    assert cache.find(repo_id).commit == new and cache.find(repo_id, old) is None


def test_a_ref_moved_to_an_unrecorded_commit_still_finds_the_branchs_complete_one(
        fake_hub: FakeHub, repo, isolated_env) -> None:
    """Disk full between the ref and the manifest: chat keeps the last complete commit of main."""
    repo_id, commit = repo
    cache = ModelCache(isolated_env.cache_dir)
    download_model(resolve_model(repo_id), None, cache)
    cache.write_ref(repo_id, "main", "f" * 40)
    assert cache.find(repo_id).commit == commit


@pytest.mark.parametrize("how", ["HF_HUB_OFFLINE", "no network"])
def test_a_complete_branch_downloads_offline_with_a_note(ruvllm: Run, fake_hub: FakeHub, repo, tiny_model_dir: Path,
                                                         isolated_env, cli_env: dict[str, str], how: str) -> None:
    repo_id, commit = repo
    assert ruvllm("download", repo_id).returncode == 0
    with socket_bound_but_closed() as url:
        env = {**cli_env, "HF_HUB_OFFLINE": "1"} if how == "HF_HUB_OFFLINE" else {**cli_env, "HF_ENDPOINT": url}
        result = ruvllm("download", repo_id, env=env)
    reason = ("offline mode is on (HF_HUB_OFFLINE)" if how == "HF_HUB_OFFLINE"
              else f"cannot reach the Hugging Face hub ({url})")
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [
        f"Could not check the hub for a newer commit of {repo_id}@main: {reason}; using the downloaded one.",
        *already_downloaded(repo_id, commit, isolated_env.cache_dir, tiny_model_dir)]


def test_two_revisions_in_name_and_option_conflict(ruvllm: Run, repo) -> None:
    repo_id, _ = repo
    result = ruvllm("download", f"{repo_id}@main", "--revision", "v2")
    assert_one_error(result, "two revisions given: 'main' (in the name) and 'v2' (--revision)", "give only one", 2)


def test_resume_after_dropped_connection(ruvllm: Run, fake_hub: FakeHub, tiny_model_dir: Path,
                                         isolated_env) -> None:
    # The client writes in 10 MiB pieces and resumes from the last one written, so the
    # weights here are bigger than that and the connection drops after the first piece.
    repo_id = unique_repo("resume")
    weights = safetensors_bytes(1, floats=3 * 1024 * 1024 + 5)
    files = {name: tiny_model_dir / name for name in TINY_FILES}
    commit = fake_hub.add_repo(repo_id, {**files, "model.safetensors": weights})
    fake_hub.drop_connection(repo_id, "model.safetensors", after_bytes=11 * MIB)
    result = ruvllm("download", repo_id)
    assert result.returncode == 0, result.stderr
    gets = fake_hub.file_requests("model.safetensors")
    assert [(r.range, r.bytes_sent) for r in gets] == [
        (None, 11 * MIB), (f"bytes={10 * MIB}-", len(weights) - 10 * MIB)]
    snapshot = snapshot_of(isolated_env.cache_dir, repo_id, commit)
    assert (snapshot / "model.safetensors").read_bytes() == weights
    assert "Trying to resume" not in result.stderr  # the client's retry log shows with -v only


def test_a_connection_that_keeps_dropping_mid_file_is_said_as_such(ruvllm: Run, fake_hub: FakeHub,
                                                                   tiny_model_dir: Path) -> None:
    """The hub answered the listing, then one file's transfer failed every retry: that is
    no "cannot reach the Hugging Face hub, check your network" (as it was said)."""
    repo_id = unique_repo("drops")
    fake_hub.add_repo(repo_id, {name: tiny_model_dir / name for name in TINY_FILES})
    fake_hub.drop_connection(repo_id, "model.safetensors", after_bytes=1000, times=100)
    result = ruvllm("download", repo_id)
    error = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert result.returncode == 1 and len(error) == 1, result.stderr
    assert error[0].startswith("Error: the connection to the hub failed while fetching model.safetensors (")
    assert "files done)" in error[0] and "cannot reach" not in result.stderr
    assert "Hint: run the same command again: complete files stay" in result.stderr
    assert len(fake_hub.file_requests("model.safetensors")) > 1   # the client's own retries came first


def test_sharded_safetensors_take_exactly_the_indexed_shards(ruvllm: Run, fake_hub: FakeHub,
                                                             isolated_env) -> None:
    repo_id = unique_repo("sharded")
    shards = {f"model-0000{i}-of-00002.safetensors": safetensors_bytes(i) for i in (1, 2)}
    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                            "b": "model-00002-of-00002.safetensors"}}
    commit = fake_hub.add_repo(repo_id, {
        "config.json": b'{"model_type": "llama"}', "tokenizer.json": b"{}", "README.md": b"# x",
        "model.safetensors.index.json": json.dumps(index).encode(), **shards,
        "consolidated.safetensors": safetensors_bytes(3), "pytorch_model.bin": b"pickle",
    })
    result = ruvllm("download", repo_id)
    assert result.returncode == 0, result.stderr
    snapshot = snapshot_of(isolated_env.cache_dir, repo_id, commit)
    assert sorted(p.name for p in snapshot.iterdir()) == sorted(
        ["config.json", "tokenizer.json", "model.safetensors.index.json", *shards])
    # The index comes first (it names the shards): it was said to be "1 already in the cache"
    assert "Fetched 5 files " in result.stderr and "; 0 already in the cache." in result.stderr


def test_gguf_repo_takes_one_file_by_quantization(ruvllm: Run, fake_hub: FakeHub, isolated_env) -> None:
    repo_id = unique_repo("gguf")
    names = ["tiny-Q4_K_M.gguf", "tiny-Q8_0.gguf", "tiny-F16.gguf"]
    commit = fake_hub.add_repo(repo_id, {**{n: n.encode() * 100 for n in names}, "README.md": b"# x"})
    result = ruvllm("download", repo_id, "-q", "q8_0")
    assert result.returncode == 0, result.stderr
    snapshot = snapshot_of(isolated_env.cache_dir, repo_id, commit)
    assert [p.name for p in snapshot.iterdir()] == ["tiny-Q8_0.gguf"]
    assert ModelCache(isolated_env.cache_dir).find(repo_id).stored_as == "GGUF Q8_0"
    # another quantization of the same commit is another file, so not "already downloaded"
    result = ruvllm("download", repo_id, "-q", "q4k")
    assert result.returncode == 0 and "Fetched 1 file " in result.stderr
    # ... and the commit's one manifest now lists both files, so neither is forgotten
    both = ModelCache(isolated_env.cache_dir).find(repo_id)
    assert [f.name for f in both.files] == ["tiny-Q4_K_M.gguf", "tiny-Q8_0.gguf"]
    assert both.stored_as == "GGUF Q4_K_M, Q8_0"
    assert sorted(p.name for p in snapshot.iterdir()) == ["tiny-Q4_K_M.gguf", "tiny-Q8_0.gguf"]
    listed = json.loads(ruvllm("list", "--downloaded", "--json").stdout)
    assert [f["name"] for f in next(m for m in listed["models"] if m["repo_id"] == repo_id)["files"]] == [
        "tiny-Q4_K_M.gguf", "tiny-Q8_0.gguf"]
    fake_hub.reset()
    again = ruvllm("download", repo_id, "-q", "q8")
    assert again.returncode == 0 and "already downloaded" in again.stderr
    assert hub_asks(fake_hub) == only_which_commit(repo_id)
    missing = ruvllm("download", repo_id, "-q", "none")
    assert_one_error(missing, "no F32 GGUF file in the repo (available: tiny-F16.gguf, tiny-Q4_K_M.gguf, "
                              "tiny-Q8_0.gguf)", "choose a --quantization the repo has: q4k, q8, f16")


def test_a_gguf_repo_of_one_file_named_for_no_q_downloads_and_loads_as_its_type(
        ruvllm: Run, fake_hub: FakeHub, tiny_model_dir: Path, isolated_env, tmp_path: Path) -> None:
    """A repo of one `model.gguf` (or only a Q5_K_M file) could not be downloaded with any
    -q, and the hint ("choose another --quantization") led nowhere. Without -q its only
    file is taken, and chat loads it as the file is."""
    from ruvllm_cli.testing.tiny_gguf import write_gguf

    repo_id = unique_repo("gguf-one")
    tiny = write_gguf(tiny_model_dir, tmp_path / "tiny.gguf").read_bytes()
    commit = fake_hub.add_repo(repo_id, {"model.gguf": tiny, "README.md": b"# x"})
    asked = ruvllm("download", repo_id, "-q", "q8")
    assert_one_error(asked, "no Q8_0 GGUF file in the repo (available: model.gguf)",
                     "leave out -q to take the repo's only GGUF file, model.gguf")
    result = ruvllm("download", repo_id)
    assert result.returncode == 0, result.stderr
    assert [p.name for p in snapshot_of(isolated_env.cache_dir, repo_id, commit).iterdir()] == ["model.gguf"]
    fake_hub.reset()
    again = ruvllm("download", repo_id)
    assert again.returncode == 0 and "already downloaded" in again.stderr
    assert hub_asks(fake_hub) == only_which_commit(repo_id)
    chat = ruvllm("chat", repo_id, "--max-tokens", "3", input="hello\n")
    assert chat.returncode == 0 and "model.gguf" in chat.stderr, chat.stderr


def test_asking_a_q_of_a_gguf_download_named_for_no_q_hints_what_works(fake_hub: FakeHub, isolated_env) -> None:
    """The hint had been `ruvllm download ID -q q4k`, which that repo refuses with "leave out -q"."""
    from ruvllm_cli.errors import NotDownloadedError
    from ruvllm_cli.quantization import Quantization
    from ruvllm_cli.registry.locate import locate_model

    repo_id = unique_repo("gguf-noq")
    fake_hub.add_repo(repo_id, {"model.gguf": b"GGUF" * 40, "README.md": b"# x"})
    cache = ModelCache(isolated_env.cache_dir)
    model = download_model(resolve_model(repo_id), None, cache)
    with pytest.raises(NotDownloadedError) as error:
        locate_model(repo_id, cache.root, Quantization.Q4_K_M)
    assert error.value.message == f"{repo_id} has no Q4_K_M GGUF file downloaded (it has model.gguf)"
    assert error.value.hint == "leave out -q to load model.gguf as the type it is"
    with pytest.raises(DownloadError) as refused:   # what the old hint ran into
        download_model(resolve_model(repo_id), "q4k", cache)
    assert refused.value.hint == "leave out -q to take the repo's only GGUF file, model.gguf"
    assert locate_model(repo_id, cache.root).path == model.path / "model.gguf"   # what the new hint runs


def test_a_gguf_repo_with_no_file_we_can_choose_says_so(ruvllm: Run, fake_hub: FakeHub) -> None:
    repo_id = unique_repo("gguf-none")
    fake_hub.add_repo(repo_id, {"m-IQ4_XS.gguf": b"GGUF" + bytes(60), "m-Q5_K_M.gguf": b"GGUF" + bytes(60)})
    assert_one_error(ruvllm("download", repo_id),
                     "ruvllm cannot choose among the repo's GGUF files: none is named for a -q quantization (q4k, "
                     "q8, f16, none), and there is more than one (available: m-IQ4_XS.gguf, m-Q5_K_M.gguf)",
                     "pick another repo, or download the GGUF file you want yourself and run it by its path "
                     "(ruvllm chat ./FILE.gguf)")


def test_a_split_gguf_is_refused_naming_its_set(ruvllm: Run, fake_hub: FakeHub, isolated_env) -> None:
    """Only the first part of a split GGUF had been fetched, and recorded as a complete model."""
    repo_id = unique_repo("gguf-split")
    parts = ["Q4_K_M/m-Q4_K_M-00001-of-00002.gguf", "Q4_K_M/m-Q4_K_M-00002-of-00002.gguf"]
    fake_hub.add_repo(repo_id, {**{name: b"GGUF" + bytes(60) for name in parts}, "m-Q8_0.gguf": b"GGUF" + bytes(60)})
    result = ruvllm("download", repo_id)
    assert_one_error(result, f"the repo's Q4_K_M GGUF is split into 2 files ({parts[0]} and the rest of its set), "
                             "and ruvllm loads a model from one GGUF file",
                     "merge them with llama.cpp: llama-gguf-split --merge m-Q4_K_M-00001-of-00002.gguf merged.gguf, "
                     "and run merged.gguf; or choose another --quantization or repo")
    assert resolve_gets(fake_hub) == [] and ModelCache(isolated_env.cache_dir).find(repo_id) is None
    assert ruvllm("download", repo_id, "-q", "q8").returncode == 0   # a whole file of the same repo


def test_a_gguf_repo_downloaded_by_its_hub_id_is_what_chat_loads(ruvllm: Run, fake_hub: FakeHub,
                                                                  tiny_model_dir: Path, isolated_env,
                                                                  tmp_path: Path) -> None:
    """Found by an audit: locate_model gave the snapshot directory ("not a model directory
    (no config.json)", hint "download the model first"); now the file -q names, else the
    first of q4k, q8, f16, f32. The cache's file is a link to a blob without the suffix,
    and its path as `list -d` shows it loads too (it had read as "not a directory")."""
    from ruvllm_cli.testing.tiny_gguf import write_gguf

    repo_id = unique_repo("gguf-hub")
    tiny = write_gguf(tiny_model_dir, tmp_path / "tiny.gguf").read_bytes()
    commit = fake_hub.add_repo(repo_id, {"tiny-Q8_0.gguf": tiny, "tiny-F16.gguf": tiny, "README.md": b"# x"})
    assert ruvllm("download", repo_id, "-q", "q8").returncode == 0
    snapshot = snapshot_of(isolated_env.cache_dir, repo_id, commit)
    chat = ruvllm("chat", repo_id, "--max-tokens", "3", input="hello\n")
    assert chat.returncode == 0 and "tiny-Q8_0.gguf" in chat.stderr, chat.stderr
    missing = ruvllm("chat", repo_id, "-q", "q4k", input="hello\n")
    assert_one_error(missing, f"{repo_id} has no Q4_K_M GGUF file downloaded (it has tiny-Q8_0.gguf)",
                     f"run: ruvllm download {repo_id} -q q4k")
    linked = snapshot / "tiny-Q8_0.gguf"
    assert linked.is_symlink() or linked.resolve() == linked   # a link where the platform has them
    by_path = ruvllm("chat", str(linked), "--max-tokens", "3", input="hello\n")
    assert by_path.returncode == 0, by_path.stderr
    info = json.loads(ruvllm("info", str(linked), "--json").stdout)
    assert info.get("gguf"), info


def test_local_path_is_already_local(ruvllm: Run, tiny_model_dir: Path, fake_hub: FakeHub) -> None:
    result = ruvllm("download", str(tiny_model_dir))
    assert result.returncode == 0
    assert result.stderr.splitlines() == [f"{tiny_model_dir} is already local: nothing to download."]
    assert fake_hub.requests == []


def test_damaged_file_is_fetched_again(fake_hub: FakeHub, repo, tiny_model_dir: Path, isolated_env) -> None:
    repo_id, commit = repo
    cache = ModelCache(isolated_env.cache_dir)
    model = download_model(resolve_model(repo_id), "q4k", cache)
    blob = (model.path / "model.safetensors").resolve()
    blob.write_bytes(blob.read_bytes()[:1000])
    assert cache.find(repo_id) is None  # a short file is not a download
    fake_hub.reset()
    again = download_model(resolve_model(repo_id), "q4k", cache)
    assert resolve_gets(fake_hub) == ["model.safetensors"]
    assert again.commit == commit and cache.find(repo_id) == again
    assert_same_files(model.path, tiny_model_dir, TINY_FILES)


# -- errors -----------------------------------------------------------------------------------
def test_private_repo_needs_hf_token(ruvllm: Run, fake_hub: FakeHub, repo, cli_env: dict[str, str],
                                     isolated_env) -> None:
    repo_id, commit = repo
    fake_hub.require_token(repo_id, "secret-token")
    result = ruvllm("download", repo_id)
    assert_one_error(result, f"{repo_id} needs authentication (HTTP 401): it is private or gated, or does not exist",
                     "check the id's spelling (org/name); if it is private or gated, set HF_TOKEN to a token "
                     "that can read it")
    assert ModelCache(isolated_env.cache_dir).find(repo_id) is None
    ok = ruvllm("download", repo_id, env={**cli_env, "HF_TOKEN": "secret-token"})
    assert ok.returncode == 0, ok.stderr
    assert all(r.authorization for r in fake_hub.requests if r.path.startswith(f"/{repo_id}/resolve/"))
    assert ModelCache(isolated_env.cache_dir).find(repo_id).commit == commit


def test_gated_repo_without_access(ruvllm: Run, fake_hub: FakeHub, repo, cli_env: dict[str, str]) -> None:
    repo_id, _ = repo
    fake_hub.require_token(repo_id, "granted", gated=True)
    fake_hub.add_token("not-granted")
    result = ruvllm("download", repo_id, env={**cli_env, "HF_TOKEN": "not-granted"})
    assert_one_error(result, f"{repo_id} is a gated repo and the hub refused this token (HTTP 403)",
                     "accept its terms on the hub and set HF_TOKEN to a token of that account")


def test_invalid_token(ruvllm: Run, repo, cli_env: dict[str, str]) -> None:
    repo_id, _ = repo
    result = ruvllm("download", repo_id, env={**cli_env, "HF_TOKEN": "hf_unknown"})
    assert_one_error(result, "the hub rejected the token in HF_TOKEN (HTTP 401: invalid credentials)",
                     "set HF_TOKEN to a valid token, or unset it for public repos")


def test_a_rejected_token_from_hf_auth_login_is_blamed_on_its_file(ruvllm: Run, repo, isolated_env) -> None:
    """A token saved by `hf auth login` (HF_HOME/token) had been blamed on HF_TOKEN, with
    the hint to unset a variable that was not set."""
    repo_id, _ = repo
    saved = isolated_env.hf_home / "token"
    saved.parent.mkdir(parents=True, exist_ok=True)
    saved.write_text("hf_unknown")
    result = ruvllm("download", repo_id)
    assert_one_error(result, f"the hub rejected the token saved in {saved} by `hf auth login` (HTTP 401: "
                             "invalid credentials)",
                     f"log in again with a valid token (hf auth login), or for public repos log out "
                     f"(hf auth logout, or delete {saved})")


def test_unknown_repo_is_404(ruvllm: Run, fake_hub: FakeHub, cli_env: dict[str, str]) -> None:
    fake_hub.add_token("valid")
    result = ruvllm("download", "ruvllm-tests/no-such-model", env={**cli_env, "HF_TOKEN": "valid"})
    assert_one_error(result, "model repo ruvllm-tests/no-such-model not found on the hub",
                     "check the id (org/name); private repos need HF_TOKEN")


def test_a_missing_gguf_repo_points_at_the_aliass_safetensors(ruvllm: Run) -> None:
    """Issue 23, item 7: the hint said to set HF_TOKEN, which leads nowhere; the alias's
    safetensors repo is another way to the model. (The fake hub answers an unknown repo
    with 401, as the real one does without a token.)"""
    result = ruvllm("download", "smollm")
    assert_one_error(result, "bartowski/SmolLM2-360M-Instruct-GGUF needs authentication (HTTP 401): it is "
                             "private or gated, or does not exist",
                     "fetch the safetensors from HuggingFaceTB/SmolLM2-360M-Instruct instead: "
                     "ruvllm download smollm --safetensors")


def test_unknown_revision(ruvllm: Run, repo) -> None:
    repo_id, _ = repo
    result = ruvllm("download", repo_id, "--revision", "no-such-branch")
    assert_one_error(result, f"revision 'no-such-branch' not found in {repo_id}",
                     "check the branch, tag or commit name")


def test_an_aliass_unknown_revision_keeps_the_revision_hint(ruvllm: Run, fake_hub: FakeHub) -> None:
    """Not "fetch the safetensors instead", which fails the same way (found by an audit)."""
    from ruvllm_cli.registry.registry import builtin_entries

    entry = builtin_entries()["qwen-0.5b"]
    fake_hub.add_repo(entry.gguf_repo, {entry.gguf_files[entry.recommended_quantization]: b"x" * 64})
    result = ruvllm("download", "qwen-0.5b@nosuch")
    assert_one_error(result, f"revision 'nosuch' not found in {entry.gguf_repo}",
                     "check the branch, tag or commit name")


def test_a_file_too_large_for_the_cache_says_so(repo, cli_env: dict[str, str]) -> None:
    """EFBIG (FAT32's 4 GiB, `ulimit -f`): "run the download again" would fail the same way."""
    import resource
    import subprocess
    import sys

    repo_id, _ = repo
    result = subprocess.run([sys.executable, "-m", "ruvllm_cli", "download", repo_id], env=cli_env,
                            capture_output=True, text=True, timeout=120,
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096)))
    assert result.returncode == 1 and "cannot hold a file this large" in result.stderr, result.stderr
    assert "choose another --cache-dir" in result.stderr and "Traceback" not in result.stderr


def test_unknown_alias(ruvllm: Run) -> None:
    result = ruvllm("download", "qwen-0.5")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.splitlines()[0] == "Error: unknown model 'qwen-0.5'"


def test_network_down(ruvllm: Run, cli_env: dict[str, str]) -> None:
    with socket_bound_but_closed() as url:
        result = ruvllm("download", "ruvllm-tests/anything", env={**cli_env, "HF_ENDPOINT": url})
    assert_one_error(result, f"cannot reach the Hugging Face hub ({url})",
                     "check your network connection (and HF_ENDPOINT)")


@pytest.mark.slow   # the client retries a 5xx for about 25 s first
def test_a_5xx_on_a_file_is_the_hubs_answer_not_no_network(ruvllm: Run, fake_hub: FakeHub, repo) -> None:
    """The client wraps a file's 5xx in LocalEntryNotFoundError ("not in the local cache"),
    which had read as "cannot reach the Hugging Face hub ... check your network"."""
    repo_id, _ = repo
    fake_hub.fail(repo_id, "model.safetensors", 502)
    result = ruvllm("download", repo_id)
    assert_one_error(result, f"the hub answered HTTP 502 for {repo_id}@main", "try again later")


@pytest.mark.parametrize("status", [502, 429])
def test_a_hub_answer_wrapped_as_not_in_the_local_cache_maps_to_it(tmp_path: Path, status: int) -> None:
    """hf_hub_download's wrapping of a failed metadata request, as file_download.py raises it."""
    import httpx2
    from huggingface_hub.errors import LocalEntryNotFoundError
    from huggingface_hub.utils import hf_raise_for_status

    response = httpx2.Response(status, request=httpx2.Request("HEAD", "http://hub/org/x/resolve/main/a"))
    with pytest.raises(LocalEntryNotFoundError) as raised:
        try:
            hf_raise_for_status(response)
        except Exception as error:
            raise LocalEntryNotFoundError("An error happened while trying to locate the file") from error
    mapped = map_hub_error(raised.value, "org/x", None, ModelCache(tmp_path))
    assert mapped is not None
    assert (mapped.message, mapped.hint) == (f"the hub answered HTTP {status} for org/x@main", "try again later")


def test_disk_full_maps_to_one_line(tmp_path: Path) -> None:
    error = map_hub_error(OSError(errno.ENOSPC, "No space left on device"), "org/x", None, ModelCache(tmp_path))
    assert error is not None and error.message == f"disk full while downloading org/x into {tmp_path}"
    assert error.hint == "free some space or choose another --cache-dir"


def test_unwritable_cache_maps_to_one_line(tmp_path: Path) -> None:
    denied = PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "hub"))
    error = map_hub_error(denied, "org/x", None, ModelCache(tmp_path))
    assert error is not None
    assert error.message == f"cannot write to the cache dir {tmp_path} (Permission denied: {tmp_path}/hub)"
    assert error.hint == "choose another --cache-dir (or RUVLLM_CACHE_DIR)"


@pytest.mark.parametrize("where", ["under a file", "under /proc"])
def test_a_cache_dir_that_cannot_be_made_says_so(ruvllm: Run, fake_hub: FakeHub, repo, tmp_path: Path,
                                                  where: str) -> None:
    """A file in the cache path (ENOTDIR) or /proc (ENOENT) said "download failed" and
    "run the download again", which cannot help."""
    repo_id, _ = repo
    if where == "under a file":
        (tmp_path / "afile").write_text("")
        cache_dir = tmp_path / "afile" / "sub"
    else:
        cache_dir = Path(f"/proc/ruvllm-{uuid.uuid4().hex[:8]}/cache")
    with pytest.raises(OSError) as refused:  # what the system says (ENOTDIR; ENOENT or EACCES)
        (cache_dir / "hub").mkdir(parents=True)
    reason, culprit = refused.value.strerror, refused.value.filename
    result = ruvllm("--cache-dir", str(cache_dir), "download", repo_id)
    assert_one_error(result, f"cannot write to the cache dir {cache_dir} ({reason}: {culprit})",
                     "choose another --cache-dir (or RUVLLM_CACHE_DIR)")
    assert fake_hub.requests == []


def test_a_file_in_the_cache_maps_to_one_line(tmp_path: Path) -> None:
    in_the_way = NotADirectoryError(errno.ENOTDIR, "Not a directory", str(tmp_path / "hub"))
    error = map_hub_error(in_the_way, "org/x", None, ModelCache(tmp_path))
    assert error is not None
    assert error.message == f"cannot write to the cache dir {tmp_path} (Not a directory: {tmp_path}/hub)"
    assert error.hint == "choose another --cache-dir (or RUVLLM_CACHE_DIR)"


# The disk fills up after the download's first bookkeeping write (the manifest or the
# ref, whichever comes first); every file of the model is complete by then.
_DISK_FULL_AT_THE_END = """
import errno, sys
from ruvllm_cli.registry import cache
from ruvllm_cli.cli.main import main
real, written = cache.write_text_atomic, []
def write_text_atomic(path, text):
    if written:
        raise OSError(errno.ENOSPC, "No space left on device", str(path))
    written.append(path)
    real(path, text)
cache.write_text_atomic = write_text_atomic
sys.argv = ["ruvllm", *sys.argv[1:]]
main()
"""


def test_disk_full_at_the_end_leaves_a_download_the_next_run_finishes(
        ruvllm: Run, fake_hub: FakeHub, repo, tiny_model_dir: Path, cli_env: dict[str, str], isolated_env) -> None:
    """The manifest came before refs/main: a run that failed then still counted as complete."""
    repo_id, commit = repo
    failed = subprocess.run([sys.executable, "-c", _DISK_FULL_AT_THE_END, "download", repo_id], env=cli_env,
                            capture_output=True, text=True, timeout=120)
    assert failed.returncode == 1, failed.stderr
    assert failed.stderr.splitlines()[-2:] == [
        f"Error: disk full while downloading {repo_id} into {isolated_env.cache_dir}",
        "Hint: free some space or choose another --cache-dir"]
    cache = ModelCache(isolated_env.cache_dir)
    assert cache.find(repo_id) is None
    assert json.loads(ruvllm("list", "--downloaded", "--json").stdout)["count"] == 0

    fake_hub.reset()
    again = ruvllm("download", repo_id)
    assert again.returncode == 0, again.stderr
    assert resolve_gets(fake_hub) == []   # every file was complete: only the records were missing
    assert cache.find(repo_id).commit == commit
    assert (cache.repo_dir(repo_id) / "refs" / "main").read_text() == commit
    assert_same_files(snapshot_of(isolated_env.cache_dir, repo_id, commit), tiny_model_dir, TINY_FILES)


# -- interrupted runs ---------------------------------------------------------------------------
def start_download(repo_id: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ruvllm_cli", "download", repo_id], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_partial_blob(blobs: Path, etag: str, process: subprocess.Popen, timeout: float = 30) -> Path:
    """The `<etag>.<random>.incomplete` file the client writes while it fetches that blob."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = sorted(blobs.glob(f"{etag}.*.incomplete")) if blobs.is_dir() else []
        if found:
            return found[0]
        assert process.poll() is None, process.communicate()
        time.sleep(0.02)
    process.kill()
    raise AssertionError("no partial blob appeared")


def weights_etag(model_dir: Path) -> str:
    """The hub's etag of an LFS file is its sha256."""
    return hashlib.sha256((model_dir / "model.safetensors").read_bytes()).hexdigest()


def test_killed_download_is_not_downloaded_and_next_run_completes(
        ruvllm: Run, fake_hub: FakeHub, repo, tiny_model_dir: Path, cli_env: dict[str, str], isolated_env) -> None:
    repo_id, commit = repo
    blobs = isolated_env.cache_dir / "hub" / f"models--{repo_id.replace('/', '--')}" / "blobs"
    fake_hub.throttle(100_000)
    process = start_download(repo_id, cli_env)
    orphan = wait_for_partial_blob(blobs, weights_etag(tiny_model_dir), process)
    process.send_signal(signal.SIGKILL)
    process.communicate(timeout=30)
    fake_hub.throttle(None)

    listed = ruvllm("list", "--downloaded", "--json")
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout)["count"] == 0
    cache = ModelCache(isolated_env.cache_dir)
    assert cache.find(repo_id) is None
    assert cache.orphaned_incomplete_files(repo_id) == [orphan]
    # not listed as downloaded, but named, with the disk it takes and what to do (found by an audit)
    [(unfinished, size)] = [(u["repo_id"], u["bytes"]) for u in json.loads(listed.stdout)["unfinished"]]
    assert unfinished == repo_id and size >= orphan.stat().st_size
    shown = " ".join(ruvllm("list", "--downloaded").stderr.split())
    assert f"Not listed: 1 incomplete or damaged download: {repo_id}" in shown and "ruvllm rm ID" in shown
    chat = ruvllm("chat", repo_id, input="hi\n")
    assert f"{repo_id} is not downloaded (only partly: the download did not finish" in " ".join(chat.stderr.split())

    partial = orphan.stat().st_size
    fake_hub.reset()
    result = ruvllm("download", repo_id)
    assert result.returncode == 0, result.stderr
    # Issue 23, item 6: the client cannot continue the partial file, and the line says so.
    assert result.stderr.splitlines()[0] == (
        f"Removed 1 partial file ({format_size(partial)}) a stopped download left behind: huggingface_hub "
        "cannot continue a partial file from another run, so those files start over.")
    assert [r for r in fake_hub.requests if r.range] == []  # the weights came again from byte 0
    assert "Fetched 3 files" in result.stderr and "; 3 already in the cache." in result.stderr
    assert not orphan.exists() and list(blobs.glob("*.incomplete")) == []
    snapshot = snapshot_of(isolated_env.cache_dir, repo_id, commit)
    assert_same_files(snapshot, tiny_model_dir, TINY_FILES)

    sizes = [{"name": n, "size": (tiny_model_dir / n).stat().st_size} for n in TINY_FILES]
    listed = json.loads(ruvllm("list", "--downloaded", "--json").stdout)
    assert listed["count"] == 1
    (model,) = listed["models"]
    assert (model["repo_id"], model["commit"], model["path"]) == (repo_id, commit, str(snapshot))
    assert model["files"] == sizes and model["total_bytes"] == sum(s["size"] for s in sizes)
    info = ruvllm("info", repo_id, "--json")
    assert info.returncode == 0, info.stderr
    data = json.loads(info.stdout)
    assert data["downloaded"] is True
    assert [(d["commit"], d["revision"]) for d in data["downloads"]] == [(commit, "main")]

    removed = ruvllm("rm", repo_id, "-y")
    assert removed.returncode == 0, removed.stderr
    assert json.loads(ruvllm("list", "--downloaded", "--json").stdout)["count"] == 0
    assert not blobs.parent.exists()


def wait_held(hub: FakeHub, name: str, after_bytes: int, process: subprocess.Popen, timeout: float = 30) -> None:
    """Until the hub has sent exactly `after_bytes` of `name` and holds the rest back."""
    deadline = time.monotonic() + timeout
    while not any(r.bytes_sent == after_bytes for r in hub.file_requests(name)):
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, f"{name} was never held at byte {after_bytes}"
        time.sleep(0.02)


def test_rm_waits_for_a_download_under_way(ruvllm: Run, fake_hub: FakeHub, repo, tiny_model_dir: Path,
                                          cli_env: dict[str, str]) -> None:
    """`rm` during another process's download deleted its partial files under it, and
    the download failed. The download records the repo as in use, as a server does."""
    repo_id, commit = repo
    name = TINY_FILES[0]
    half = (tiny_model_dir / name).stat().st_size // 2
    fake_hub.hold(repo_id, name, after_bytes=half)
    process = start_download(repo_id, cli_env)
    try:
        wait_held(fake_hub, name, half, process)
        refused = ruvllm("rm", repo_id, "-y")
        assert refused.returncode == 1, refused.stderr
        assert f"{repo_id} is being downloaded (pid {process.pid})" in refused.stderr
        fake_hub.release()
        out, err = process.communicate(timeout=60)
        assert process.returncode == 0, err
    finally:
        fake_hub.release()
        process.kill()
        process.wait()
    removed = ruvllm("rm", repo_id, "-y")   # the record went with the download
    assert removed.returncode == 0, removed.stderr


def test_kill_9_in_every_file_in_turn_never_lists_the_model_and_the_next_run_completes(
        ruvllm: Run, fake_hub: FakeHub, repo, tiny_model_dir: Path, cli_env: dict[str, str], isolated_env) -> None:
    repo_id, commit = repo
    blobs = isolated_env.cache_dir / "hub" / f"models--{repo_id.replace('/', '--')}" / "blobs"
    for name in TINY_FILES:   # the order the download fetches them in
        half = (tiny_model_dir / name).stat().st_size // 2
        fake_hub.hold(repo_id, name, after_bytes=half)
        process = start_download(repo_id, cli_env)
        try:
            wait_held(fake_hub, name, half, process)
            wait_for_partial_blob(blobs, hub_file(name, tiny_model_dir / name).etag, process)
        finally:
            process.send_signal(signal.SIGKILL)
            process.communicate(timeout=30)
            fake_hub.release()
        listed = ruvllm("list", "--downloaded", "--json")
        assert listed.returncode == 0, listed.stderr
        assert json.loads(listed.stdout)["count"] == 0, name

    result = ruvllm("download", repo_id)
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines()[0].startswith("Removed 1 partial file (")
    assert result.stderr.splitlines()[0].endswith(") a stopped download left behind: huggingface_hub cannot "
                                                  "continue a partial file from another run, so those files "
                                                  "start over.")
    assert "Fetched 1 file " in result.stderr and "; 5 already in the cache." in result.stderr
    assert list(blobs.glob("*.incomplete")) == []
    assert_same_files(snapshot_of(isolated_env.cache_dir, repo_id, commit), tiny_model_dir, TINY_FILES)
    listed = json.loads(ruvllm("list", "--downloaded", "--json").stdout)
    assert [(m["repo_id"], m["commit"]) for m in listed["models"]] == [(repo_id, commit)]


def test_ctrl_c_exits_130_and_leaves_the_cache_consistent(fake_hub: FakeHub, repo, tiny_model_dir: Path,
                                                          cli_env: dict[str, str], isolated_env) -> None:
    repo_id, _ = repo
    blobs = isolated_env.cache_dir / "hub" / f"models--{repo_id.replace('/', '--')}" / "blobs"
    fake_hub.throttle(100_000)
    process = start_download(repo_id, cli_env)
    wait_for_partial_blob(blobs, weights_etag(tiny_model_dir), process)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=30)
    assert process.returncode == 130, stderr
    assert "Traceback" not in stderr and [line for line in stderr.splitlines() if line][-2:] == [
        "Warning: interrupted: complete files stay in the cache, but huggingface_hub cannot continue a partial "
        "file from another run: the file in progress starts over next time", "Aborted."]
    assert list(blobs.glob("*.incomplete")) == []
    assert ModelCache(isolated_env.cache_dir).find(repo_id) is None
    assert not (isolated_env.cache_dir / "manifests" / repo_id.replace("/", "--")).exists()


# -- helpers ------------------------------------------------------------------------------------
def total_size(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.iterdir() if p.name in TINY_FILES)


def safetensors_bytes(value: int, floats: int = 2) -> bytes:
    """A valid one-tensor safetensors file (the fake hub reads their headers)."""
    header = json.dumps({"w": {"dtype": "F32", "shape": [floats], "data_offsets": [0, 4 * floats]}}).encode()
    header += b" " * (-len(header) % 8)
    data = struct.pack("<f", value) * floats
    return struct.pack("<Q", len(header)) + header + data


class socket_bound_but_closed:
    """A local URL where nothing listens (the port is reserved, then released)."""

    def __enter__(self) -> str:
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc: object) -> None:
        pass


if os.name != "posix":  # SIGKILL/SIGINT semantics above are POSIX
    pytestmark = pytest.mark.skip("POSIX only")


def test_a_log_gets_progress_lines_while_a_download_runs(monkeypatch) -> None:
    """On a stderr that is no terminal (a CI log) the live bars are off; a download of
    minutes had printed nothing until its end (a helper's pass)."""
    import io

    from rich.console import Console

    from ruvllm_cli.registry import progress
    from ruvllm_cli.registry.cache import FileRecord

    clock = iter(range(0, 1000, 4))
    monkeypatch.setattr(progress.time, "monotonic", lambda: float(next(clock)))
    log = io.StringIO()
    shown = progress.DownloadProgress(Console(file=log, width=200))
    weights = FileRecord("model.safetensors", 4_000_000)
    shown.started("org/x", "a" * 40, [weights], [weights])
    with shown:
        shown.file_started(weights)
        for _ in range(8):
            shown.bar_advanced(500_000)
    lines = log.getvalue().splitlines()
    assert lines[0] == "Downloading org/x (commit aaaaaaa): 1 of 1 file to fetch, 4.0 MB"
    import re

    found = [re.fullmatch(r"  ([\d.]+) MB of 4\.0 MB \((\d+)%\), [\d.]+ kB/s", line) for line in lines[1:]]
    assert len(found) >= 2 and all(found), lines   # one a PLAIN_INTERVAL (10 s of a clock 4 s a call)
    shares = [int(m.group(2)) for m in found]
    assert shares == sorted(shares) and shares[0] < 100
