"""`ruvllm rm`: plan, confirm, remove files and manifests; one-line errors."""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from rich.filesize import decimal as format_size

from ruvllm_cli.registry.cache import DownloadedModel, ModelCache
from ruvllm_cli.registry.download import download_model
from ruvllm_cli.registry.registry import resolve_model
from ruvllm_cli.testing.fake_hub import FakeHub

Run = Callable[..., subprocess.CompletedProcess]


@pytest.fixture
def cache(isolated_env) -> ModelCache:
    return ModelCache(isolated_env.cache_dir)


@pytest.fixture
def downloaded(fake_hub: FakeHub, tiny_model_dir: Path, cache: ModelCache) -> DownloadedModel:
    """A fresh repo with the tiny model, downloaded in-process (faster than through the CLI)."""
    repo_id = f"ruvllm-tests/rm-{uuid.uuid4().hex[:8]}"
    fake_hub.add_model_dir(repo_id, tiny_model_dir)
    return download_model(resolve_model(repo_id), "q4k", cache)


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


def test_rm_without_confirmation_on_closed_stdin(ruvllm: Run, downloaded: DownloadedModel,
                                                 cache: ModelCache) -> None:
    result = ruvllm("rm", downloaded.repo_id, input="")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert [line for line in lines if line.startswith("Error:")] == ["Error: no confirmation (stdin is closed)"]
    assert lines[-1] == "Hint: pass -y to remove without asking"
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


def test_rm_of_a_model_not_downloaded(ruvllm: Run, isolated_env) -> None:
    result = ruvllm("rm", "qwen-0.5b", "-y")
    assert result.returncode == 1
    assert result.stdout == "" and "Traceback" not in result.stderr
    assert result.stderr.splitlines() == [
        f"Error: Qwen/Qwen2.5-0.5B-Instruct is not in the cache ({isolated_env.cache_dir})",
        "Hint: see what is there with: ruvllm list --downloaded",
    ]


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
