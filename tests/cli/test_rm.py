"""`ruvllm rm`: plan, confirm, remove files and manifests; one-line errors."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from rich.filesize import decimal as format_size

from ruvllm_cli.quantization import Quantization
from ruvllm_cli.registry.cache import DownloadedModel, ModelCache
from ruvllm_cli.registry.download import download_model
from ruvllm_cli.registry.locate import gguf_variant
from ruvllm_cli.registry.registry import resolve_model
from ruvllm_cli.testing.fake_hub import FakeHub

Run = Callable[..., subprocess.CompletedProcess]
ALIAS_REPO, GGUF_REPO = "Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct-GGUF"  # `qwen-0.5b`'s


@pytest.fixture
def cache(isolated_env) -> ModelCache:
    return ModelCache(isolated_env.cache_dir)


@pytest.fixture
def downloaded(fake_hub: FakeHub, tiny_model_dir: Path, cache: ModelCache) -> DownloadedModel:
    """A fresh repo with the tiny model, downloaded in-process (faster than through the CLI)."""
    repo_id = f"ruvllm-tests/rm-{uuid.uuid4().hex[:8]}"
    fake_hub.add_model_dir(repo_id, tiny_model_dir)
    return download_model(resolve_model(repo_id), "q4k", cache)


@pytest.fixture
def alias_gguf(fake_hub: FakeHub, cache: ModelCache) -> DownloadedModel:
    """What `ruvllm download qwen-0.5b` fetches: the registry's Q8_0 file of its GGUF repo."""
    gguf_ref, name = gguf_variant(resolve_model("qwen-0.5b"), Quantization.Q8_0)
    assert gguf_ref.repo_id == GGUF_REPO
    fake_hub.add_repo(GGUF_REPO, {name: b"GGUF" + b"\0" * 60, "README.md": b"# GGUF"})
    return download_model(gguf_ref, Quantization.Q8_0, cache, file_name=name)


def alias_downloaded(ruvllm: Run) -> bool:
    listed = json.loads(ruvllm("list", "--json").stdout)
    return next(m for m in listed["models"] if m["alias"] == "qwen-0.5b")["downloaded"]


def listed_count(ruvllm: Run) -> int:
    result = ruvllm("list", "--downloaded", "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["count"]


def describe(model: DownloadedModel, files: int) -> str:
    return f"{model.repo_id} ({model.commit[:7]}): {files} files, {format_size(model.total_bytes)}"


def test_rm_yes_removes_files_and_manifest(ruvllm: Run, downloaded: DownloadedModel, cache: ModelCache) -> None:
    assert listed_count(ruvllm) == 1
    result = ruvllm("rm", downloaded.repo_id, "-y")
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""
    assert result.stderr.splitlines() == [f"Removed {describe(downloaded, 7)}."]  # 6 files + the manifest
    assert not cache.repo_dir(downloaded.repo_id).exists()
    assert not cache.manifest_path(downloaded.repo_id, downloaded.commit).exists()
    assert not cache.manifest_path(downloaded.repo_id, downloaded.commit).parent.exists()
    assert cache.find(downloaded.repo_id) is None
    assert listed_count(ruvllm) == 0


def test_rm_asks_first(ruvllm: Run, downloaded: DownloadedModel, cache: ModelCache) -> None:
    declined = ruvllm("rm", downloaded.repo_id, input="n\n")
    assert declined.returncode == 0, declined.stderr
    assert declined.stderr.splitlines() == [f"Remove {describe(downloaded, 7)}? [y/N]: Nothing removed."]
    assert cache.find(downloaded.repo_id) == downloaded

    accepted = ruvllm("rm", downloaded.repo_id, input="y\n")
    assert accepted.returncode == 0, accepted.stderr
    # piped answers are not echoed, so the prompt and the result share a line
    plan = describe(downloaded, 7)
    assert accepted.stderr.splitlines() == [f"Remove {plan}? [y/N]: Removed {plan}."]
    assert cache.find(downloaded.repo_id) is None


@pytest.mark.parametrize("stdin", ["at its end", "closed"])
def test_rm_without_confirmation_on_closed_stdin(ruvllm: Run, downloaded: DownloadedModel, cache: ModelCache,
                                                 cli_env: dict[str, str], stdin: str) -> None:
    """A closed stdin (`<&-`: Python's sys.stdin is None) had given "RuntimeError: input():
    lost sys.stdin"; one at its end (`</dev/null`) refused already."""
    if stdin == "closed":
        result = subprocess.run([sys.executable, "-m", "ruvllm_cli", "rm", downloaded.repo_id], env=cli_env,
                                capture_output=True, text=True, timeout=60, preexec_fn=lambda: os.close(0))
    else:
        result = ruvllm("rm", downloaded.repo_id, input="")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert [line for line in lines if line.startswith("Error:")] == ["Error: no confirmation (stdin is closed)"]
    assert lines[-1] == "Hint: pass -y to remove without asking"
    assert cache.find(downloaded.repo_id) == downloaded


def test_rm_that_cannot_delete_the_files_fails_naming_one(ruvllm: Run, downloaded: DownloadedModel,
                                                          cache: ModelCache, unwritable) -> None:
    """The hub client only logs (with a traceback) a blob it may not delete: rm had said
    "Removed ..." and exited 0 with every blob still on disk."""
    blobs = cache.repo_dir(downloaded.repo_id) / "blobs"
    with unwritable(blobs):
        result = ruvllm("rm", downloaded.repo_id, "-y")
        left = sorted(blobs.iterdir())
    assert result.returncode == 1
    assert result.stdout == "" and "Traceback" not in result.stderr and "Removed" not in result.stderr
    error, hint = result.stderr.splitlines()
    assert len(left) == 6
    reason = "Permission denied" if os.geteuid() != 0 else "Operation not permitted"
    assert error == f"Error: could not remove all of {downloaded.repo_id}: {left[0]}: {reason} (and 5 more)"
    assert hint == f"Hint: make {blobs} writable (or its file system), then run ruvllm rm again"
    assert cache.find(downloaded.repo_id) is None   # what could go is gone: no longer listed as complete
    again = ruvllm("rm", downloaded.repo_id, "-y")
    assert again.returncode == 0, again.stderr
    assert not cache.repo_dir(downloaded.repo_id).exists()


def test_a_removal_on_a_read_only_file_system_says_so(tmp_path: Path) -> None:
    """EROFS is no PermissionError: the hub client raises it, and rm printed "OSError: [Errno 30] ... 'main'"."""
    import errno

    from ruvllm_cli.errors import CacheError
    from ruvllm_cli.registry.cache import RemovalPlan

    ref = tmp_path / "refs" / "main"

    class ReadOnly:   # a DeleteCacheStrategy on a read-only mount, as far as execute() goes
        def execute(self) -> None:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(ref))

    with pytest.raises(CacheError) as raised:
        RemovalPlan("org/x", ("c" * 40,), (), 0, ReadOnly()).execute()
    assert raised.value.message == f"could not remove all of org/x: {ref}: Read-only file system"
    assert raised.value.hint == f"make {ref.parent} writable (or its file system), then run ruvllm rm again"


def read_stderr_until(process: subprocess.Popen, text: bytes, timeout: float = 60) -> bytes:
    """What the process wrote to stderr up to `text` (a prompt ends no line, so read raw bytes)."""
    seen, deadline = b"", time.monotonic() + timeout
    while text not in seen:
        ready, _, _ = select.select([process.stderr], [], [], max(0.0, deadline - time.monotonic()))
        assert ready, f"no {text!r} on stderr, only {seen!r}"
        chunk = os.read(process.stderr.fileno(), 4096)
        assert chunk, f"stderr closed after {seen!r} (exit {process.wait()})"
        seen += chunk
    return seen


def test_ctrl_c_at_the_prompt_aborts_with_130(downloaded: DownloadedModel, cli_env: dict[str, str],
                                              cache: ModelCache) -> None:
    """Ctrl-C is no closed stdin: it ends as on every other command, and removes nothing."""
    process = subprocess.Popen([sys.executable, "-m", "ruvllm_cli", "rm", downloaded.repo_id], env=cli_env,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        prompt = read_stderr_until(process, b"[y/N]: ")
        process.send_signal(signal.SIGINT)
        stdout, rest = process.communicate(timeout=30)
    finally:
        process.kill()
    assert process.returncode == 130, rest
    assert stdout == b""
    assert (prompt + rest).decode().splitlines() == [f"Remove {describe(downloaded, 7)}? [y/N]: ", "Aborted."]
    assert cache.find(downloaded.repo_id) == downloaded


def test_rm_dry_run_lists_the_plan_and_removes_nothing(ruvllm: Run, downloaded: DownloadedModel,
                                                       cache: ModelCache) -> None:
    result = ruvllm("rm", downloaded.repo_id, "--dry-run")
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    manifest = cache.manifest_path(downloaded.repo_id, downloaded.commit)
    assert lines[:-1] == [f"  {downloaded.path / f.name}" for f in downloaded.files] + [f"  {manifest}"]
    assert lines[-1] == f"Would remove {describe(downloaded, 7)}."
    assert cache.find(downloaded.repo_id) == downloaded


def test_rm_one_revision_keeps_the_other(ruvllm: Run, fake_hub: FakeHub, downloaded: DownloadedModel,
                                         tiny_model_dir: Path, tmp_path: Path, cache: ModelCache) -> None:
    v2_dir = tmp_path / "v2"
    v2_dir.mkdir()
    for path in tiny_model_dir.iterdir():
        (v2_dir / path.name).write_bytes(path.read_bytes())
    (v2_dir / "generation_config.json").write_text('{"revision": 2}')
    fake_hub.add_model_dir(downloaded.repo_id, v2_dir, revision="v2")
    v2 = download_model(resolve_model(downloaded.repo_id), "q4k", cache, revision="v2")

    result = ruvllm("rm", downloaded.repo_id, "--revision", "v2", "-y")
    assert result.returncode == 0, result.stderr
    assert result.stderr.startswith(f"Removed {downloaded.repo_id} ({v2.commit[:7]}): 7 files, ")
    assert cache.find(downloaded.repo_id, "v2") is None
    assert not v2.path.exists()
    assert cache.find(downloaded.repo_id) == downloaded  # shared blobs stay intact
    assert listed_count(ruvllm) == 1


def test_rm_by_alias(ruvllm: Run, fake_hub: FakeHub, tiny_model_dir: Path, cache: ModelCache) -> None:
    fake_hub.add_model_dir("Qwen/Qwen2.5-0.5B-Instruct", tiny_model_dir)
    download_model(resolve_model("qwen-0.5b"), "q4k", cache)
    result = ruvllm("rm", "qwen-0.5b", "-y")
    assert result.returncode == 0, result.stderr
    assert result.stderr.startswith("Removed Qwen/Qwen2.5-0.5B-Instruct (")
    assert cache.downloaded() == []


def test_rm_by_alias_removes_the_gguf_download_fetched(ruvllm: Run, alias_gguf: DownloadedModel,
                                                     cache: ModelCache) -> None:
    """`download qwen-0.5b` fetches the GGUF repo, so `rm qwen-0.5b` removes that (it looked
    only at the safetensors repo: "not in the cache" while `list` said downloaded)."""
    assert alias_downloaded(ruvllm)
    plan = describe(alias_gguf, 2)  # the GGUF file + the manifest
    dry = ruvllm("rm", "qwen-0.5b", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    manifest = cache.manifest_path(GGUF_REPO, alias_gguf.commit)
    assert dry.stderr.splitlines() == [f"  {alias_gguf.path / alias_gguf.files[0].name}", f"  {manifest}",
                                       f"Would remove {plan}."]
    assert cache.find(GGUF_REPO) == alias_gguf

    result = ruvllm("rm", "qwen-0.5b", "-y")
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [f"Removed {plan}."]
    assert cache.downloaded() == [] and not cache.repo_dir(GGUF_REPO).exists()
    assert not alias_downloaded(ruvllm)


def test_rm_by_alias_removes_both_its_gguf_and_its_safetensors(
        ruvllm: Run, fake_hub: FakeHub, tiny_model_dir: Path, alias_gguf: DownloadedModel,
        cache: ModelCache) -> None:
    fake_hub.add_model_dir(ALIAS_REPO, tiny_model_dir)
    safetensors = download_model(resolve_model("qwen-0.5b"), "q4k", cache)   # `download qwen-0.5b --safetensors`
    both = f"{describe(alias_gguf, 2)} and {describe(safetensors, 7)}"
    declined = ruvllm("rm", "qwen-0.5b", input="n\n")
    assert declined.returncode == 0, declined.stderr
    assert declined.stderr.splitlines() == [f"Remove {both}? [y/N]: Nothing removed."]
    dry = ruvllm("rm", "qwen-0.5b", "--dry-run")
    assert dry.stderr.splitlines()[-1] == f"Would remove {both}."
    assert len(dry.stderr.splitlines()) == 1 + 2 + 7
    assert sorted(m.repo_id for m in cache.downloaded()) == [ALIAS_REPO, GGUF_REPO]

    result = ruvllm("rm", "qwen-0.5b", input="y\n")
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [f"Remove {both}? [y/N]: Removed {both}."]
    assert cache.downloaded() == []
    assert not alias_downloaded(ruvllm)


def test_rm_by_hub_id_removes_only_that_repo(ruvllm: Run, fake_hub: FakeHub, tiny_model_dir: Path,
                                             alias_gguf: DownloadedModel, cache: ModelCache) -> None:
    fake_hub.add_model_dir(ALIAS_REPO, tiny_model_dir)
    safetensors = download_model(resolve_model(ALIAS_REPO), "q4k", cache)
    result = ruvllm("rm", ALIAS_REPO, "-y")
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [f"Removed {describe(safetensors, 7)}."]
    assert cache.downloaded() == [alias_gguf]


def test_rm_of_a_model_not_downloaded(ruvllm: Run, isolated_env) -> None:
    result = ruvllm("rm", "qwen-0.5b", "-y")
    assert result.returncode == 1
    assert result.stdout == "" and "Traceback" not in result.stderr
    assert result.stderr.splitlines() == [
        f"Error: neither {GGUF_REPO} nor {ALIAS_REPO} is in the cache ({isolated_env.cache_dir})",
        "Hint: see what is there with: ruvllm list --downloaded",
    ]
    by_id = ruvllm("rm", ALIAS_REPO, "-y")
    assert by_id.returncode == 1
    assert by_id.stderr.splitlines()[0] == f"Error: {ALIAS_REPO} is not in the cache ({isolated_env.cache_dir})"


def test_rm_of_an_unknown_revision(ruvllm: Run, downloaded: DownloadedModel, cache: ModelCache) -> None:
    result = ruvllm("rm", downloaded.repo_id, "--revision", "v9", "-y")
    assert result.returncode == 1
    assert result.stderr.splitlines()[0] == \
        f"Error: {downloaded.repo_id} at revision v9 is not in the cache ({cache.root})"
    assert cache.find(downloaded.repo_id) == downloaded


def test_rm_of_a_local_path_is_a_usage_error(ruvllm: Run, tiny_model_dir: Path) -> None:
    result = ruvllm("rm", str(tiny_model_dir), "-y")
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"Error: {tiny_model_dir} is a local path, not a model in the cache",
        "Hint: ruvllm rm removes only downloaded models; delete local files yourself",
    ]
    assert tiny_model_dir.joinpath("config.json").exists()


def test_rm_refuses_a_model_a_running_server_uses(ruvllm: Run, downloaded: DownloadedModel, cache: ModelCache,
                                                 cli_env: dict[str, str], tmp_path: Path) -> None:
    """A server records its models while it runs (here: this test's own process, alive);
    rm refuses them unless --force, and ignores (and clears) the records of dead ones."""
    from ruvllm_cli.registry.in_use import register, run_dir

    unregister = register([downloaded.path], "http://127.0.0.1:8080", cache.root)
    try:
        refused = ruvllm("rm", downloaded.repo_id, "-y")
        assert refused.returncode == 1 and downloaded.path.exists()
        assert f"in use by ruvllm serve (pid {os.getpid()} at http://127.0.0.1:8080)" in refused.stderr
        assert "--force" in refused.stderr and "Traceback" not in refused.stderr
        dry = ruvllm("rm", downloaded.repo_id, "--dry-run")
        assert dry.returncode == 0 and "in use by ruvllm serve" in dry.stderr
        # the record is the cache's: an rm with another data directory (a server run as
        # a service, another HOME) sees it too (it had removed the files)
        elsewhere = ruvllm("rm", downloaded.repo_id, "-y", env={**cli_env, "RUVLLM_DATA_DIR": str(tmp_path)})
        assert elsewhere.returncode == 1 and downloaded.path.exists()
    finally:
        unregister()
    assert not run_dir(cache.root).exists()   # the last server out leaves the cache as it found it
    stale = run_dir(cache.root) / "serve-999999999.json"   # a server that is gone
    stale.parent.mkdir()
    stale.write_text(json.dumps({"pid": 999999999, "url": "http://x", "paths": [str(downloaded.path)]}))
    removed = ruvllm("rm", downloaded.repo_id, "-y")
    assert removed.returncode == 0, removed.stderr
    assert not downloaded.path.exists() and not stale.exists()


def test_rm_refuses_a_model_a_server_is_still_loading(ruvllm: Run, downloaded: DownloadedModel,
                                                     cache: ModelCache, cli_env: dict[str, str]) -> None:
    """The server recorded its model only once loaded: an `rm` during the load (a minute
    at 7B) removed the files it was reading. The server is held still (SIGSTOP) right
    after it says it is loading."""
    import socket

    from ruvllm_cli.registry.in_use import run_dir

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-m", "ruvllm_cli", "serve", downloaded.repo_id, "--port", str(port),
                                "-q", "none", "--device", "cpu", "--max-context", "128", "--kv-cache-memory", "4MiB"],
                               env=cli_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        read_stderr_until(process, b"loading the model")
        process.send_signal(signal.SIGSTOP)
        refused = ruvllm("rm", downloaded.repo_id, "-y")
        process.send_signal(signal.SIGCONT)
        assert refused.returncode == 1, refused.stderr
        assert f"in use by ruvllm serve (pid {process.pid} at http://127.0.0.1:{port})" in refused.stderr
        assert cache.find(downloaded.repo_id) == downloaded
        read_stderr_until(process, b"Press Ctrl+C")
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        process.kill()
        process.wait()
    assert not run_dir(cache.root).exists()


def test_rm_force_removes_a_model_in_use(ruvllm: Run, downloaded: DownloadedModel, cache: ModelCache) -> None:
    from ruvllm_cli.registry.in_use import register

    unregister = register([downloaded.path], "http://127.0.0.1:8080", cache.root)
    try:
        forced = ruvllm("rm", downloaded.repo_id, "-y", "--force")
        assert forced.returncode == 0 and not downloaded.path.exists()
    finally:
        unregister()


def test_a_server_that_cannot_write_its_record_serves_all_the_same(tmp_path, monkeypatch) -> None:
    from ruvllm_cli.registry import in_use

    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    in_use.register([tmp_path], "http://x", blocked)()   # no error, and nothing to undo
    assert in_use.users_of([tmp_path], blocked) == []
