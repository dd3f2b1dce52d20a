"""The fake hub, driven by the real huggingface_hub client (HF_ENDPOINT is set by conftest)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from huggingface_hub import HfApi, hf_hub_download, snapshot_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from ruvllm_cli.testing.fake_hub import FakeHub, git_blob_sha1

WEIGHTS = os.urandom(300_000)


def _add_small_repo(hub: FakeHub, repo_id: str) -> str:
    files = {"config.json": b'{"a": 1}\n', "model.safetensors": WEIGHTS, "sub/dir/notes.txt": b"notes\n"}
    return hub.add_repo(repo_id, files)


def test_snapshot_download_gets_identical_bytes(fake_hub: FakeHub, tiny_model_dir: Path, tmp_path: Path) -> None:
    sha = fake_hub.add_model_dir("ruvllm-test/snapshot", tiny_model_dir)
    path = Path(snapshot_download("ruvllm-test/snapshot", cache_dir=tmp_path))
    assert path.name == sha and path.parent.name == "snapshots"
    model_files = sorted(p.name for p in tiny_model_dir.iterdir())
    assert sorted(p.name for p in path.iterdir()) == sorted([*model_files, ".gitattributes", "README.md"])
    for name in model_files:
        assert (path / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name
    blob = (path / "model.safetensors").resolve().name
    assert blob == hashlib.sha256((tiny_model_dir / "model.safetensors").read_bytes()).hexdigest()
    paths = [(r.method, r.path) for r in fake_hub.requests]
    assert ("GET", "/api/models/ruvllm-test/snapshot/revision/main") in paths
    assert ("GET", f"/api/models/ruvllm-test/snapshot/tree/{sha}") in paths
    assert ("GET", f"/ruvllm-test/snapshot/resolve/{sha}/model.safetensors") in paths
    assert not any(r.authorization for r in fake_hub.requests)


def test_model_info_and_listings(fake_hub: FakeHub, tiny_model_dir: Path) -> None:
    sha = fake_hub.add_model_dir("ruvllm-test/info", tiny_model_dir, hub_files=False)
    api = HfApi()
    info = api.model_info("ruvllm-test/info")
    assert (info.id, info.sha, info.private, info.gated) == ("ruvllm-test/info", sha, False, False)
    assert sorted(s.rfilename for s in info.siblings) == sorted(p.name for p in tiny_model_dir.iterdir())
    assert info.config["model_type"] == "llama"
    assert info.safetensors.total == 106_816 and info.safetensors.parameters == {"F32": 106_816}

    detailed = api.model_info("ruvllm-test/info", files_metadata=True)
    sizes = {s.rfilename: (s.size, s.lfs is not None) for s in detailed.siblings}
    assert sizes["model.safetensors"] == ((tiny_model_dir / "model.safetensors").stat().st_size, True)
    assert sizes["config.json"] == ((tiny_model_dir / "config.json").stat().st_size, False)

    assert sorted(api.list_repo_files("ruvllm-test/info")) == sorted(sizes)
    refs = api.list_repo_refs("ruvllm-test/info")
    assert [(b.name, b.target_commit) for b in refs.branches] == [("main", sha)]


def test_tree_lists_folders_paths_and_git_ids(fake_hub: FakeHub) -> None:
    _add_small_repo(fake_hub, "ruvllm-test/tree")
    api = HfApi()
    top = {e.path: type(e).__name__ for e in api.list_repo_tree("ruvllm-test/tree")}
    assert top == {"config.json": "RepoFile", "model.safetensors": "RepoFile", "sub": "RepoFolder"}
    deep = {e.path: e for e in api.list_repo_tree("ruvllm-test/tree", recursive=True)}
    assert sorted(deep) == ["config.json", "model.safetensors", "sub", "sub/dir", "sub/dir/notes.txt"]
    assert deep["config.json"].blob_id == git_blob_sha1(b'{"a": 1}\n') and deep["config.json"].lfs is None
    assert deep["model.safetensors"].lfs.sha256 == hashlib.sha256(WEIGHTS).hexdigest()
    assert deep["model.safetensors"].size == len(WEIGHTS)
    assert [e.path for e in api.list_repo_tree("ruvllm-test/tree", path_in_repo="sub/dir")] == ["sub/dir/notes.txt"]
    with pytest.raises(EntryNotFoundError):
        list(api.list_repo_tree("ruvllm-test/tree", path_in_repo="missing"))


def test_tree_pagination_is_followed() -> None:
    with FakeHub(tree_page_size=2) as hub:
        hub.add_repo("org/many", {f"f{i}.txt": b"x%d" % i for i in range(5)})
        files = HfApi(endpoint=hub.url).list_repo_files("org/many")
        assert files == [f"f{i}.txt" for i in range(5)]
        cursors = [r.query for r in hub.requests if "/tree/" in r.path]
        assert len(cursors) == 3 and "cursor=4" in cursors[-1]


def test_download_resumes_with_range_after_dropped_connection(fake_hub: FakeHub, tmp_path: Path) -> None:
    # The client writes to disk in 10 MiB pieces (DOWNLOAD_CHUNK_SIZE), so it resumes from
    # the last full piece: a drop before 10 MiB restarts the file from byte 0.
    piece = 10 * 1024 * 1024
    big = os.urandom(piece + 2 * 1024 * 1024)
    fake_hub.add_repo("ruvllm-test/drop", {"model.safetensors": big})
    fake_hub.drop_connection("ruvllm-test/drop", "model.safetensors", after_bytes=piece + 1024 * 1024)
    path = hf_hub_download("ruvllm-test/drop", "model.safetensors", cache_dir=tmp_path)
    assert Path(path).read_bytes() == big
    gets = fake_hub.file_requests("model.safetensors")
    assert [(r.range, r.status, r.bytes_sent) for r in gets] == [
        (None, 200, piece + 1024 * 1024),
        (f"bytes={piece}-", 206, len(big) - piece),
    ]


def test_private_repo_needs_its_token(fake_hub: FakeHub, tmp_path: Path) -> None:
    _add_small_repo(fake_hub, "ruvllm-test/private")
    fake_hub.require_token("ruvllm-test/private", "hf_secret")
    fake_hub.add_token("hf_someone_else")
    with pytest.raises(RepositoryNotFoundError) as missing:
        hf_hub_download("ruvllm-test/private", "config.json", cache_dir=tmp_path)
    assert missing.value.response.status_code == 401
    with pytest.raises(RepositoryNotFoundError):
        snapshot_download("ruvllm-test/private", cache_dir=tmp_path)
    with pytest.raises(RepositoryNotFoundError) as other:
        HfApi(token="hf_someone_else").model_info("ruvllm-test/private")
    assert other.value.response.status_code == 404
    with pytest.raises(HfHubHTTPError) as invalid:
        hf_hub_download("ruvllm-test/private", "config.json", cache_dir=tmp_path, token="hf_garbage")
    assert invalid.value.response.status_code == 401 and not isinstance(invalid.value, RepositoryNotFoundError)
    path = hf_hub_download("ruvllm-test/private", "config.json", cache_dir=tmp_path, token="hf_secret")
    assert Path(path).read_bytes() == b'{"a": 1}\n'
    assert fake_hub.file_requests("config.json", "HEAD")[-1].authorization


def test_gated_repo_shows_info_but_not_files(fake_hub: FakeHub, tmp_path: Path) -> None:
    _add_small_repo(fake_hub, "ruvllm-test/gated")
    fake_hub.require_token("ruvllm-test/gated", "hf_granted", gated=True)
    fake_hub.add_token("hf_not_granted")
    assert HfApi().model_info("ruvllm-test/gated").gated == "manual"
    with pytest.raises(GatedRepoError) as anonymous:
        snapshot_download("ruvllm-test/gated", cache_dir=tmp_path)
    assert anonymous.value.response.status_code == 401
    with pytest.raises(GatedRepoError) as refused:
        hf_hub_download("ruvllm-test/gated", "config.json", cache_dir=tmp_path, token="hf_not_granted")
    assert refused.value.response.status_code == 403
    assert hf_hub_download("ruvllm-test/gated", "config.json", cache_dir=tmp_path, token="hf_granted")


def test_unknown_repo_is_repository_not_found(tmp_path: Path) -> None:
    with pytest.raises(RepositoryNotFoundError) as error:
        snapshot_download("ruvllm-test/does-not-exist", cache_dir=tmp_path)
    assert error.value.response.status_code == 401
    assert error.value.response.headers["X-Error-Code"] == "RepoNotFound"


def test_unknown_revision_and_file(fake_hub: FakeHub, tmp_path: Path) -> None:
    _add_small_repo(fake_hub, "ruvllm-test/revisions")
    with pytest.raises(RevisionNotFoundError):
        snapshot_download("ruvllm-test/revisions", revision="v9", cache_dir=tmp_path)
    with pytest.raises(RevisionNotFoundError):
        hf_hub_download("ruvllm-test/revisions", "config.json", revision="0" * 40, cache_dir=tmp_path)
    with pytest.raises(EntryNotFoundError):
        hf_hub_download("ruvllm-test/revisions", "nope.json", cache_dir=tmp_path)


def test_named_revisions_and_old_commits_keep_their_files(fake_hub: FakeHub, tmp_path: Path) -> None:
    first = fake_hub.add_repo("ruvllm-test/named", {"config.json": b"main v1"})
    second = fake_hub.add_repo("ruvllm-test/named", {"config.json": b"main v2"})
    other = fake_hub.add_repo("ruvllm-test/named", {"config.json": b"experimental"}, revision="exp")
    assert len({first, second, other}) == 3

    def fetch(revision: str) -> bytes:
        path = hf_hub_download("ruvllm-test/named", "config.json", revision=revision, cache_dir=tmp_path)
        return Path(path).read_bytes()

    assert (fetch("main"), fetch("exp"), fetch(first)) == (b"main v2", b"experimental", b"main v1")
    snapshot = Path(snapshot_download("ruvllm-test/named", revision="exp", cache_dir=tmp_path))
    assert snapshot.name == other
    assert HfApi().model_info("ruvllm-test/named", revision="exp").sha == other


def test_resolve_headers_and_ranges(fake_hub: FakeHub) -> None:
    sha = _add_small_repo(fake_hub, "ruvllm-test/ranges")
    url = f"{fake_hub.url}/ruvllm-test/ranges/resolve/main/model.safetensors"
    with urllib.request.urlopen(urllib.request.Request(url, method="HEAD")) as head:
        assert head.headers["X-Repo-Commit"] == sha
        assert head.headers["ETag"] == f'"{hashlib.sha256(WEIGHTS).hexdigest()}"'
        assert head.headers["X-Linked-Size"] == head.headers["Content-Length"] == str(len(WEIGHTS))
    with urllib.request.urlopen(urllib.request.Request(url, headers={"Range": "bytes=10-19"})) as part:
        assert (part.status, part.headers["Content-Range"]) == (206, f"bytes 10-19/{len(WEIGHTS)}")
        assert part.read() == WEIGHTS[10:20]
    with urllib.request.urlopen(urllib.request.Request(url, headers={"Range": "bytes=-5"})) as tail:
        assert tail.read() == WEIGHTS[-5:]
    with pytest.raises(urllib.error.HTTPError) as beyond:
        urllib.request.urlopen(urllib.request.Request(url, headers={"Range": f"bytes={len(WEIGHTS)}-"}))
    assert beyond.value.code == 416
    small = f"{fake_hub.url}/ruvllm-test/ranges/resolve/main/config.json"
    with urllib.request.urlopen(urllib.request.Request(small, method="HEAD")) as head:
        assert head.headers["ETag"] == '"%s"' % git_blob_sha1(b'{"a": 1}\n')
        assert "X-Linked-Etag" not in head.headers


def test_throttle_slows_bodies_and_log_counts_bytes(fake_hub: FakeHub) -> None:
    fake_hub.add_repo("ruvllm-test/slow", {"blob.bin": bytes(30_000)})
    fake_hub.throttle(60_000)
    started = time.monotonic()
    with urllib.request.urlopen(f"{fake_hub.url}/ruvllm-test/slow/resolve/main/blob.bin") as response:
        assert len(response.read()) == 30_000
    assert time.monotonic() - started >= 0.4
    assert fake_hub.file_requests("blob.bin")[0].bytes_sent == 30_000


def test_hold_pauses_one_body_at_a_byte_until_released(fake_hub: FakeHub) -> None:
    body = os.urandom(30_000)
    fake_hub.add_repo("ruvllm-test/held", {"blob.bin": body})
    fake_hub.hold("ruvllm-test/held", "blob.bin", after_bytes=12_345)
    url = f"{fake_hub.url}/ruvllm-test/held/resolve/main/blob.bin"
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.read(12_345) == body[:12_345]
        deadline = time.monotonic() + 10
        while fake_hub.file_requests("blob.bin")[0].bytes_sent != 12_345:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.2)
        assert fake_hub.file_requests("blob.bin")[0].bytes_sent == 12_345   # held there
        fake_hub.release()
        assert response.read() == body[12_345:]
    with urllib.request.urlopen(url, timeout=10) as response:   # the hold was for one GET
        assert response.read() == body


def test_fail_answers_every_request_of_one_file_until_reset(fake_hub: FakeHub) -> None:
    fake_hub.add_repo("ruvllm-test/failing", {"a.bin": b"a", "b.bin": b"b"})
    fake_hub.fail("ruvllm-test/failing", "a.bin", 503)
    url = f"{fake_hub.url}/ruvllm-test/failing/resolve/main/"
    for method in ("HEAD", "GET"):
        with pytest.raises(urllib.error.HTTPError) as failed:
            urllib.request.urlopen(urllib.request.Request(url + "a.bin", method=method))
        assert failed.value.code == 503
    with urllib.request.urlopen(url + "b.bin") as other:
        assert other.read() == b"b"
    fake_hub.reset()
    with urllib.request.urlopen(url + "a.bin") as again:
        assert again.read() == b"a"


def test_stop_closes_the_port() -> None:
    with FakeHub() as hub:
        hub.add_repo("org/x", {"a.txt": b"a"})
        url = hub.url
        with urllib.request.urlopen(f"{url}/api/models/org/x") as response:
            assert json.loads(response.read())["siblings"] == [{"rfilename": "a.txt"}]
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"{url}/api/models/org/x", timeout=2)


def test_throttled_download_in_a_subprocess_can_be_killed_mid_file(
    fake_hub: FakeHub, cli_env: dict[str, str], tmp_path: Path
) -> None:
    fake_hub.add_repo("ruvllm-test/killed", {"model.safetensors": bytes(2_000_000)})
    fake_hub.throttle(400_000)
    script = (
        "import sys; from huggingface_hub import hf_hub_download; "
        "hf_hub_download('ruvllm-test/killed', 'model.safetensors', cache_dir=sys.argv[1])"
    )
    child = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], env=cli_env)
    try:
        deadline = time.monotonic() + 30
        while not any(r.bytes_sent > 100_000 for r in fake_hub.file_requests("model.safetensors")):
            assert time.monotonic() < deadline and child.poll() is None
            time.sleep(0.05)
    finally:
        child.kill()
        child.wait()
    assert list(tmp_path.rglob("*.incomplete"))  # the client's orphan, for download code to clean up
    assert not list(tmp_path.rglob("snapshots/*/model.safetensors"))
    fake_hub.throttle(None)
    with urllib.request.urlopen(f"{fake_hub.url}/api/models/ruvllm-test/killed", timeout=5) as response:
        assert response.status == 200
