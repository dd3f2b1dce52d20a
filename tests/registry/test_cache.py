"""ModelCache (layout, manifests, completeness, refs, orphans, removal) and plan_files."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import pytest
from filelock import FileLock

from ruvllm_cli.errors import CacheError, DownloadError, NotDownloadedError
from ruvllm_cli.quantization import Quantization
from ruvllm_cli.registry.cache import DownloadedModel, FileRecord, ModelCache
from ruvllm_cli.registry.download import plan_files

REPO = "acme/tiny-chat"
C1 = "1" * 40
C2 = "2" * 40


def put_snapshot(cache: ModelCache, repo_id: str, commit: str, files: dict[str, bytes],
                 ref: str | None = "main") -> list[FileRecord]:
    """Lays files out the way huggingface_hub does: blobs, snapshot symlinks, a ref."""
    repo = cache.repo_dir(repo_id)
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = repo / "snapshots" / commit / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    if ref:
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return [FileRecord(name, len(data)) for name, data in files.items()]


FILES = {"config.json": b'{"a": 1}', "model.safetensors": b"w" * 1000, "tokenizer.json": b"{}"}


@pytest.fixture
def cache(tmp_path: Path) -> ModelCache:
    return ModelCache(tmp_path / "cache")


def record(cache: ModelCache, commit: str = C1, revision: str | None = None, ref: str | None = "main",
           files: dict[str, bytes] = FILES) -> DownloadedModel:
    records = put_snapshot(cache, REPO, commit, files, ref=ref)
    return cache.write_manifest(repo_id=REPO, revision=revision, commit=commit, files=records)


# -- manifests and completeness -------------------------------------------------------------
def test_manifest_layout_and_fields(cache: ModelCache) -> None:
    model = record(cache)
    manifest = cache.root / "manifests" / "acme--tiny-chat" / f"{C1}.json"
    data = json.loads(manifest.read_text())
    assert data["repo_id"] == REPO and data["revision"] == "main" and data["commit"] == C1
    assert data["stored_as"] == "safetensors"  # FILES' model.safetensors has no readable header
    assert "quantization" not in data
    assert data["files"] == [{"name": "config.json", "size": 8}, {"name": "model.safetensors", "size": 1000},
                             {"name": "tokenizer.json", "size": 2}]
    assert data["total_bytes"] == 1010
    assert data["downloaded_at"].endswith("+00:00")
    assert data["ruvllm_version"]
    assert model.path == cache.root / "hub" / "models--acme--tiny-chat" / "snapshots" / C1
    assert model.total_bytes == 1010
    assert [p.name for p in manifest.parent.iterdir()] == [f"{C1}.json"]  # no temp file left


def test_complete_model_is_found_and_listed(cache: ModelCache) -> None:
    model = record(cache)
    assert cache.find(REPO) == model
    assert cache.find(REPO, "main") == model
    assert cache.find(REPO, C1) == model
    assert cache.downloaded() == [model]


def test_no_manifest_means_not_downloaded(cache: ModelCache) -> None:
    put_snapshot(cache, REPO, C1, FILES)
    assert cache.find(REPO) is None
    assert cache.downloaded() == []


def test_missing_file_means_not_downloaded(cache: ModelCache) -> None:
    model = record(cache)
    (model.path / "tokenizer.json").unlink()
    assert cache.find(REPO) is None
    assert cache.downloaded() == []


def test_short_blob_means_not_downloaded(cache: ModelCache) -> None:
    model = record(cache)
    (model.path / "model.safetensors").resolve().write_bytes(b"w" * 999)
    assert cache.find(REPO) is None
    assert cache.downloaded() == []


def test_partly_downloaded_is_a_revision_begun_not_another_one(cache: ModelCache) -> None:
    """`chat org/x@v9` with main downloaded said "only partly: the download did not
    finish": the repo's folder was there, v9 was never fetched."""
    model = record(cache)
    assert not cache.partly_downloaded(REPO) and not cache.partly_downloaded(REPO, "v9")
    assert not cache.partly_downloaded(REPO, C2)
    (model.path / "tokenizer.json").unlink()   # main's files changed since
    assert cache.partly_downloaded(REPO) and not cache.partly_downloaded(REPO, "v9")
    put_snapshot(cache, REPO, C2, {"config.json": b"{}"}, ref="v2")   # v2 begun, never finished
    assert cache.partly_downloaded(REPO, "v2") and cache.partly_downloaded(REPO, C2)
    other = "someone/killed-early"   # killed before any ref: only its *.incomplete blob
    blobs = cache.repo_dir(other) / "blobs"
    blobs.mkdir(parents=True)
    (blobs / f"{'a' * 64}.incomplete").write_bytes(b"w" * 10)
    assert cache.partly_downloaded(other) and not cache.partly_downloaded(other, "v2")


def test_unfinished_names_a_stopped_second_revision_beside_a_complete_one(cache: ModelCache) -> None:
    """A killed `download org/big@dev` with main complete: its partial blob and its
    snapshot without a manifest were left out, as the repo had a complete download."""
    record(cache)
    assert cache.unfinished() == []
    blobs = cache.repo_dir(REPO) / "blobs"
    (blobs / f"{'d' * 64}.1234abcd.incomplete").write_bytes(b"p" * 700)
    assert cache.unfinished() == [(REPO, 700)]
    # dev's snapshot: config.json shared with main (counted once, under main), one blob of its own
    put_snapshot(cache, REPO, C2, {"config.json": FILES["config.json"], "dev.safetensors": b"v" * 300}, ref=None)
    assert cache.unfinished() == [(REPO, 1000)]
    assert [m.commit for m in cache.downloaded()] == [C1]


def test_corrupt_manifest_is_ignored(cache: ModelCache) -> None:
    record(cache)
    cache.manifest_path(REPO, C1).write_text("{not json")
    assert cache.find(REPO) is None
    assert cache.downloaded() == []


def safetensors_bytes(dtypes: list[str]) -> bytes:
    """A safetensors file of one-element tensors in `dtypes` (header plus data)."""
    sizes = {"BF16": 2, "F16": 2, "F32": 4}
    header, offset = {}, 0
    for i, dtype in enumerate(dtypes):
        header[f"t{i}"] = {"dtype": dtype, "shape": [1], "data_offsets": [offset, offset + sizes[dtype]]}
        offset += sizes[dtype]
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + b"\0" * offset


@pytest.mark.parametrize("files, expected", [
    ({"config.json": b"{}", "model.safetensors": safetensors_bytes(["BF16", "BF16", "F32"])}, "safetensors bf16"),
    ({"config.json": b"{}", "model-00001-of-00002.safetensors": safetensors_bytes(["F32"]),
      "model-00002-of-00002.safetensors": safetensors_bytes(["F32", "BF16"])}, "safetensors f32"),
    ({"qwen2.5-0.5b-instruct-q4_k_m.gguf": b"g" * 8, "qwen2.5-0.5b-instruct-fp16.gguf": b"g" * 9},
     "GGUF F16, Q4_K_M"),
    ({"tiny-Q8_0.gguf": b"g"}, "GGUF Q8_0"),
    ({"config.json": b"{}"}, "-"),
])
def test_manifest_says_what_the_files_are(cache: ModelCache, files: dict[str, bytes], expected: str) -> None:
    """The label is read from the files (GGUF names, safetensors headers), whatever -q was."""
    model = record(cache, files=files)
    assert model.stored_as == expected
    assert json.loads(cache.manifest_path(REPO, C1).read_text())["stored_as"] == expected
    assert cache.find(REPO).stored_as == expected


def test_old_manifest_label_is_read_from_the_files(cache: ModelCache) -> None:
    """Manifests written before the label recorded the download's -q ("q4k" on bf16 safetensors)."""
    record(cache, files={"config.json": b"{}", "model.safetensors": safetensors_bytes(["BF16"])})
    path = cache.manifest_path(REPO, C1)
    data = json.loads(path.read_text())
    del data["stored_as"]
    path.write_text(json.dumps({**data, "quantization": "q4k"}))
    assert cache.find(REPO).stored_as == "safetensors bf16"
    assert "q4k" not in json.dumps(cache.find(REPO).to_json())


def test_write_manifest_refuses_incomplete_files(cache: ModelCache) -> None:
    records = put_snapshot(cache, REPO, C1, FILES)
    with pytest.raises(CacheError):
        cache.write_manifest(repo_id=REPO, revision=None, commit=C1,
                             files=[*records, FileRecord("model-2.safetensors", 10)])
    assert not cache.manifest_path(REPO, C1).exists()


# -- revisions -------------------------------------------------------------------------------
def test_revisions_stay_apart_and_resolve_through_refs(cache: ModelCache) -> None:
    main = record(cache, C1)
    v2 = record(cache, C2, revision="v2", ref="v2", files={**FILES, "config.json": b'{"a": 22}'})
    assert cache.find(REPO) == main
    assert cache.find(REPO, "v2") == v2
    assert cache.find(REPO, C2) == v2
    assert cache.find(REPO, "v3") is None
    assert main.path != v2.path
    assert [m.commit for m in cache.downloaded()] == [C1, C2]


def test_revision_resolves_through_manifest_without_ref(cache: ModelCache) -> None:
    model = record(cache, C2, revision="dev", ref=None)
    assert cache.find(REPO, "dev") == model
    assert cache.find(REPO) is None


def test_a_short_commit_names_the_one_downloaded_commit_it_begins(cache: ModelCache) -> None:
    """`download` and `list` print 7 hex digits; those (or more) find the download."""
    main = record(cache, C1)
    v2 = record(cache, C2, revision="v2", ref="v2", files={**FILES, "config.json": b'{"a": 22}'})
    assert cache.find(REPO, C1[:7]) == main and cache.find(REPO, C2[:12].upper()) == v2
    assert cache.resolve_commit(REPO, C2[:7]) == C2
    assert cache.find(REPO, C1[:6]) is None            # too short to be a commit
    assert cache.find(REPO, "f" * 7) is None           # begins none
    assert cache.plan_removal(REPO, C2[:7]).files     # rm --revision takes it too


def test_a_short_commit_that_begins_two_downloads_names_neither(cache: ModelCache) -> None:
    one, two = "abcdef01" + "1" * 32, "abcdef02" + "2" * 32
    record(cache, one)
    record(cache, two, revision="v2", ref="v2")
    assert cache.resolve_commit(REPO, "abcdef0") is None
    assert cache.resolve_commit(REPO, "abcdef02") == two


def test_write_ref(cache: ModelCache) -> None:
    cache.write_ref(REPO, "main", C1)
    cache.write_ref(REPO, C2, C2)  # a commit is no ref
    assert (cache.repo_dir(REPO) / "refs" / "main").read_text() == C1
    assert not (cache.repo_dir(REPO) / "refs" / C2).exists()


# -- orphans ---------------------------------------------------------------------------------
def test_orphaned_incomplete_files_skip_locked_ones(cache: ModelCache) -> None:
    blobs = cache.repo_dir(REPO) / "blobs"
    blobs.mkdir(parents=True)
    orphan = blobs / "aaaa.1234abcd.incomplete"
    live = blobs / "bbbb.5678abcd.incomplete"
    orphan.write_bytes(b"x")
    live.write_bytes(b"y")
    locks = cache.hub_dir / ".locks" / "models--acme--tiny-chat"
    locks.mkdir(parents=True)
    (locks / "aaaa.lock").touch()  # a lock file left by a dead process is not held
    with FileLock(str(locks / "bbbb.lock")):
        assert cache.orphaned_incomplete_files(REPO) == [orphan]
        assert cache.remove_orphaned_incomplete_files(REPO) == [orphan]
    assert not orphan.exists() and live.exists()
    assert cache.orphaned_incomplete_files("acme/other") == []


# -- removal ---------------------------------------------------------------------------------
def test_plan_removal_of_all_revisions(cache: ModelCache) -> None:
    record(cache, C1)
    record(cache, C2, revision="v2", ref="v2", files={**FILES, "config.json": b'{"a": 22}'})
    plan = cache.plan_removal(REPO)
    assert plan.commits == (C1, C2)
    assert len(plan.files) == 3 + 3 + 2  # snapshot entries of both, two manifests
    assert plan.bytes == 1010 + 9  # blobs are shared: only the second config.json is extra
    assert cache.repo_dir(REPO).exists()  # a plan deletes nothing
    plan.execute()
    assert not cache.repo_dir(REPO).exists()
    assert not (cache.root / "manifests" / "acme--tiny-chat").exists()
    assert cache.downloaded() == []


def test_plan_removal_of_one_revision_keeps_shared_blobs(cache: ModelCache) -> None:
    main = record(cache, C1)
    record(cache, C2, revision="v2", ref="v2", files={**FILES, "config.json": b'{"a": 22}'})
    plan = cache.plan_removal(REPO, "v2")
    assert plan.commits == (C2,)
    assert plan.bytes == 9
    plan.execute()
    assert cache.find(REPO, "v2") is None
    assert cache.downloaded() == [main]
    assert not cache.manifest_path(REPO, C2).exists()


def test_plan_removal_of_the_only_revision(cache: ModelCache) -> None:
    record(cache, C1)
    cache.plan_removal(REPO, "main").execute()
    assert not cache.repo_dir(REPO).exists()
    assert not (cache.root / "manifests" / "acme--tiny-chat").exists()


def test_plan_removal_of_partial_download(cache: ModelCache) -> None:
    blobs = cache.repo_dir(REPO) / "blobs"
    blobs.mkdir(parents=True)
    (blobs / "cccc.0000abcd.incomplete").write_bytes(b"z" * 50)
    plan = cache.plan_removal(REPO)
    assert plan.bytes == 50
    plan.execute()
    assert not cache.repo_dir(REPO).exists()


def test_plan_removal_of_a_repo_the_scan_skips_counts_what_is_there(cache: ModelCache) -> None:
    """A blob deleted under a snapshot link makes scan_cache_dir skip the repo: the plan had
    said "1 files, 0 bytes" (the manifest) and then removed the whole repo dir."""
    model = record(cache, C1)
    (model.path / "tokenizer.json").resolve().unlink()
    plan = cache.plan_removal(REPO)
    assert plan.commits == (C1,)
    assert plan.files == (*(model.path / name for name in sorted(FILES)), cache.manifest_path(REPO, C1))
    assert plan.bytes == 1000 + 8 + 40   # the blobs left (model.safetensors, config.json) and refs/main
    plan.execute()
    assert not cache.repo_dir(REPO).exists()


def test_plan_removal_of_missing_model_raises(cache: ModelCache) -> None:
    with pytest.raises(NotDownloadedError):
        cache.plan_removal(REPO)
    record(cache, C1)
    with pytest.raises(NotDownloadedError):
        cache.plan_removal(REPO, "nope")


# -- plan_files -------------------------------------------------------------------------------
TOKENIZER = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt"]
BASE = ["config.json", "generation_config.json", *TOKENIZER]


@pytest.mark.parametrize("repo_files, quantization, shards, expected", [
    # single safetensors file; README, .gitattributes and other exports are left out
    ([*BASE, "model.safetensors", "README.md", ".gitattributes", "onnx/model.onnx", "pytorch_model.bin"],
     "q4k", None, sorted([*BASE, "model.safetensors"])),
    # with an index: exactly the shards it names
    ([*BASE, "model.safetensors.index.json", "model-00001-of-00002.safetensors",
      "model-00002-of-00002.safetensors", "consolidated.safetensors"], "q8",
     ["model-00002-of-00002.safetensors", "model-00001-of-00002.safetensors"],
     sorted([*BASE, "model.safetensors.index.json", "model-00001-of-00002.safetensors",
             "model-00002-of-00002.safetensors"])),
    # a single model.safetensors beside another export
    (["config.json", "model.safetensors", "consolidated.safetensors", "tokenizer.model"], "f16", None,
     ["config.json", "model.safetensors", "tokenizer.model"]),
    # chat templates and added tokens where present
    (["config.json", "model.safetensors", "chat_template.jinja", "added_tokens.json", "chat_template.json"],
     "none", None,
     ["added_tokens.json", "chat_template.jinja", "chat_template.json", "config.json", "model.safetensors"]),
    # GGUF repo: one file chosen by quantization, case-insensitive
    (["README.md", "qwen2.5-0.5b-instruct-q4_k_m.gguf", "qwen2.5-0.5b-instruct-Q8_0.gguf",
      "qwen2.5-0.5b-instruct-fp16.gguf", "qwen2.5-0.5b-instruct-q4_k_s.gguf"], "q4k", None,
     ["qwen2.5-0.5b-instruct-q4_k_m.gguf"]),
    (["a-Q4_K_M.gguf", "a-Q8_0.gguf", "a-F16.gguf"], Quantization.Q8_0, None, ["a-Q8_0.gguf"]),
    (["a-Q4_K_M.gguf", "a-Q8_0.gguf", "a-F16.gguf"], "fp16", None, ["a-F16.gguf"]),
    (["config.json", "x.Q4_K_M.gguf", "big/x.Q4_K_M-00001-of-00002.gguf"], "q4k", None,
     ["config.json", "x.Q4_K_M.gguf"]),
    # no -q: the Q4_K_M file, else the repo's only GGUF file, whatever its type
    (["a-Q4_K_M.gguf", "a-Q8_0.gguf"], None, None, ["a-Q4_K_M.gguf"]),
    (["README.md", "model.gguf"], None, None, ["model.gguf"]),
    (["m-Q5_K_M.gguf"], None, None, ["m-Q5_K_M.gguf"]),
])
def test_plan_files(repo_files: list[str], quantization: str, shards: list[str] | None,
                    expected: list[str]) -> None:
    assert plan_files(repo_files, quantization, shards) == expected


@pytest.mark.parametrize("repo_files, quantization, message", [
    (["a-Q4_K_M.gguf", "a-F16.gguf"], "q8", "no Q8_0 GGUF file in the repo (available: a-F16.gguf, a-Q4_K_M.gguf)"),
    (["config.json", "pytorch_model.bin"], "q4k", "only PyTorch pickle weights"),
    (["config.json", "README.md"], "q4k", "no model weights"),
    (["model.safetensors"], "q4k", "no config.json"),
    # a split GGUF: the first part alone had been fetched and recorded as the model
    (["Q4_K_M/m-Q4_K_M-00002-of-00002.gguf", "Q4_K_M/m-Q4_K_M-00001-of-00002.gguf", "m-Q8_0.gguf"], "q4k",
     "the repo's Q4_K_M GGUF is split into 2 files (Q4_K_M/m-Q4_K_M-00001-of-00002.gguf and the rest of its "
     "set), and ruvllm loads a model from one GGUF file"),
])
def test_plan_files_errors(repo_files: list[str], quantization: str, message: str) -> None:
    with pytest.raises(DownloadError, match=re.escape(message)):
        plan_files(repo_files, quantization)


@pytest.mark.parametrize("repo_files, quantization, message, hint", [
    (["a-Q8_0.gguf", "a-Q5_K_M.gguf"], None, "no Q4_K_M GGUF file, the default, in the repo (available: "
     "a-Q5_K_M.gguf, a-Q8_0.gguf)", "choose a --quantization the repo has: q8"),
    (["model.gguf"], "q4k", "no Q4_K_M GGUF file in the repo (available: model.gguf)",
     "leave out -q to take the repo's only GGUF file, model.gguf"),
    (["m-IQ4_XS.gguf", "m-Q5_K_M.gguf"], "q4k", "no Q4_K_M GGUF file in the repo (available: m-IQ4_XS.gguf, "
     "m-Q5_K_M.gguf)", "pick another repo, or download the GGUF file you want yourself and run it by its path "
     "(ruvllm chat ./FILE.gguf)"),
    # one split set and nothing else: the split is what stops it
    (["m-00001-of-00002.gguf", "m-00002-of-00002.gguf"], None, "the repo's GGUF is split into 2 files "
     "(m-00001-of-00002.gguf and the rest of its set), and ruvllm loads a model from one GGUF file",
     "merge them with llama.cpp: llama-gguf-split --merge m-00001-of-00002.gguf merged.gguf, and run merged.gguf; "
     "or choose another --quantization or repo"),
])
def test_a_gguf_choice_that_fails_says_what_the_repo_has(repo_files: list[str], quantization: str | None,
                                                          message: str, hint: str) -> None:
    with pytest.raises(DownloadError) as raised:
        plan_files(repo_files, quantization)
    assert (raised.value.message, raised.value.hint) == (message, hint)


def test_plan_files_index_naming_missing_shard() -> None:
    with pytest.raises(DownloadError, match="model-00002-of-00002.safetensors"):
        plan_files(["config.json", "model.safetensors.index.json", "model-00001-of-00002.safetensors"], "q4k",
                   ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"])
