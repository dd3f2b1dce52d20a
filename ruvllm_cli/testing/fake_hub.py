"""A local stand-in for the Hugging Face hub that the real `huggingface_hub` client talks to.

Point `HF_ENDPOINT` at `FakeHub.url` before `huggingface_hub` is imported, and
`snapshot_download`, `hf_hub_download`, `HfApi().model_info`, `list_repo_files`,
`list_repo_tree` and `list_repo_refs` work against repos added with `add_repo` /
`add_model_dir`. Served (as huggingface_hub 2.4 calls them):

- `GET /api/models/{repo}` and `/api/models/{repo}/revision/{rev}`: model info
  (`?blobs=true` adds sizes and LFS info to `siblings`; `?expand=...` filters fields).
- `GET /api/models/{repo}/tree/{rev}[/{path}]`: tree listing, `recursive`, paginated
  with a `Link: <...>; rel="next"` header (`tree_page_size` entries a page).
- `GET /api/models/{repo}/refs`: branches.
- `GET /api/agent-harnesses`: an empty registry (the client asks once per process).
- `HEAD` / `GET /{repo}/resolve/{rev}/{path}`: the file, redirect-free, with
  `X-Repo-Commit`, `ETag` (sha256 for LFS files, git blob sha1 otherwise),
  `X-Linked-Etag` / `X-Linked-Size` for LFS files, and `Range` answered with 206.

Errors follow the real hub, so the client raises the same exceptions: an unknown or
private repo is 401 `RepoNotFound` without a token (404 with one), a gated repo's files
are 401 / 403 `GatedRepo`, an unknown revision is 404 `RevisionNotFound`, an unknown
file 404 `EntryNotFound`, and a token the hub does not know is 401 "Invalid credentials
in Authorization header" on every route. Failures are injected per test with
`require_token`, `drop_connection`, `throttle` and `hold`; `requests` logs every request.
"""

from __future__ import annotations

import hashlib
import json
import math
import mimetypes
import os
import socket
import struct
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlencode, urlsplit

# Patterns the hub's default .gitattributes stores in LFS; bigger files go there too.
LFS_SUFFIXES = (
    ".safetensors", ".bin", ".gguf", ".pt", ".pth", ".ckpt", ".h5", ".onnx", ".msgpack",
    ".model", ".npy", ".npz", ".pkl", ".tar", ".gz", ".zip", ".tflite", ".ot",
)
LFS_MIN_SIZE = 10 * 1024 * 1024
DATE = "2024-09-25T14:00:00.000Z"
CHUNK_SIZE = 64 * 1024
GITATTRIBUTES = "".join(f"*{s} filter=lfs diff=lfs merge=lfs -text\n" for s in LFS_SUFFIXES)


def git_blob_sha1(data: bytes) -> str:
    """The id git gives a blob with this content."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class HubFile:
    """One file of a commit: in memory (`content`) or read from disk when served (`source`)."""

    path: str
    size: int
    blob_id: str
    sha256: str | None = None  # set for LFS files only
    content: bytes | None = None
    source: Path | None = None

    @property
    def is_lfs(self) -> bool:
        return self.sha256 is not None

    @property
    def etag(self) -> str:
        return self.sha256 or self.blob_id

    def chunks(self, start: int, end: int, size: int) -> Iterator[bytes]:
        """The bytes [start, end) in pieces of at most `size`."""
        if self.content is not None:
            end = min(end, len(self.content))
            for pos in range(start, end, size):
                yield self.content[pos : min(pos + size, end)]
            return
        assert self.source is not None
        with self.source.open("rb") as f:
            f.seek(start)
            pos = start
            while pos < end:
                block = f.read(min(size, end - pos))
                if not block:
                    return
                pos += len(block)
                yield block


def hub_file(path: str, value: bytes | os.PathLike) -> HubFile:
    """Describe `value` (bytes, or a file on disk) as the repo file `path`."""
    if isinstance(value, (bytes, bytearray)):
        content, source = bytes(value), None
        size, read_all = len(content), lambda: content
    elif isinstance(value, os.PathLike):
        content, source = None, Path(value)
        size, read_all = source.stat().st_size, source.read_bytes
    else:
        raise TypeError(f"{path}: expected bytes or a Path, got {type(value).__name__}")
    if not (path.endswith(LFS_SUFFIXES) or size >= LFS_MIN_SIZE):
        return HubFile(path, size, git_blob_sha1(read_all()), None, content, source)
    sha256 = hashlib.sha256(content).hexdigest() if source is None else _sha256_of(source)
    return HubFile(path, size, git_blob_sha1(_lfs_pointer(sha256, size)), sha256, content, source)


def _lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


@dataclass(frozen=True)
class Commit:
    sha: str
    files: Mapping[str, HubFile]


@dataclass
class Repo:
    repo_id: str
    refs: dict[str, str] = field(default_factory=dict)  # branch name -> commit sha
    commits: dict[str, Commit] = field(default_factory=dict)

    def resolve(self, revision: str) -> Commit | None:
        return self.commits.get(self.refs.get(revision, revision))


@dataclass(frozen=True)
class AccessRule:
    token: str
    gated: bool


@dataclass
class RequestRecord:
    """One request as the hub saw it; `status` and `bytes_sent` fill in while it is answered."""

    method: str
    path: str  # decoded, without the query
    query: str
    range: str | None
    authorization: bool
    status: int = 0
    bytes_sent: int = 0


class HubError(Exception):
    """An error answer: status, `X-Error-Code` and `X-Error-Message` as the hub sends them."""

    def __init__(self, status: int, code: str | None, message: str, commit: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.commit = status, code, message, commit


@dataclass
class Answer:
    """A successful answer: JSON, or (part of) a file."""

    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    file: HubFile | None = None
    span: tuple[int, int] = (0, 0)
    cut_after: int | None = None  # injected drop: close after this many body bytes
    hold_after: int | None = None  # injected pause: wait for release() after this many body bytes


class FakeHub:
    """The fake hub: a threaded HTTP server on 127.0.0.1 plus the repos it serves.

    Use as a context manager, or `start()` / `stop()`. Repos persist until `stop()`;
    `reset()` clears injected failures, known tokens and the request log.
    """

    def __init__(self, port: int = 0, *, tree_page_size: int = 1000) -> None:
        self.tree_page_size = tree_page_size
        self._port = port
        self._lock = threading.Lock()
        self._repos: dict[str, Repo] = {}
        self._rules: dict[str, AccessRule] = {}
        self._tokens: set[str] = set()
        self._drops: dict[tuple[str, str], list[int]] = {}  # -> [after_bytes, times left]
        self._holds: dict[tuple[str, str], int] = {}  # -> after_bytes, for the next GET only
        self._failures: dict[tuple[str, str], int] = {}  # -> the HTTP status every request of the file gets
        self._released = threading.Event()
        self._bytes_per_second: int | None = None
        self._log: list[RequestRecord] = []
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self.stopping = threading.Event()

    # -- lifecycle -------------------------------------------------------------------
    def start(self) -> "FakeHub":
        self.stopping.clear()
        self._server = _Server(("127.0.0.1", self._port), _Handler, self)
        # A short poll interval so that stop() returns at once.
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.05,), name="fake-hub", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is None:
            return
        self.stopping.set()
        self._server.shutdown()
        self._server.close_connections()
        self._server.server_close()
        self._server = None

    def __enter__(self) -> "FakeHub":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        assert self._server is not None, "FakeHub is not running"
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    # -- content -----------------------------------------------------------------------
    def add_repo(
        self, repo_id: str, files: Mapping[str, bytes | os.PathLike], revision: str = "main"
    ) -> str:
        """Commit exactly `files` to branch `revision` (created if new); return the commit sha.

        Every commit stays reachable by its 40-hex sha after the branch moves on.
        """
        tree = {path: hub_file(path, value) for path, value in sorted(files.items())}
        with self._lock:
            repo = self._repos.setdefault(repo_id, Repo(repo_id))
            parent = repo.refs.get(revision, "")
            listing = "".join(f"{f.path} {f.blob_id}\n" for f in tree.values())
            sha = hashlib.sha1(f"{repo_id}\n{revision}\n{parent}\n{listing}".encode()).hexdigest()
            repo.commits[sha] = Commit(sha, tree)
            repo.refs[revision] = sha
        return sha

    def add_model_dir(
        self, repo_id: str, model_dir: str | os.PathLike, revision: str = "main", *, hub_files: bool = True
    ) -> str:
        """Commit every file under `model_dir` (served from disk); return the commit sha.

        With `hub_files` the commit also holds the `.gitattributes` and `README.md` every
        real repo has, so download code has something to leave out.
        """
        root = Path(model_dir)
        files: dict[str, bytes | os.PathLike] = {
            p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*")) if p.is_file()
        }
        if hub_files:
            files.setdefault(".gitattributes", GITATTRIBUTES.encode())
            files.setdefault("README.md", f"# {repo_id}\n\nA tiny random model for tests.\n".encode())
        return self.add_repo(repo_id, files, revision)

    def remove_repo(self, repo_id: str) -> None:
        with self._lock:
            self._repos.pop(repo_id, None)

    # -- failure injection ---------------------------------------------------------------
    def require_token(self, repo_id: str, token: str, *, gated: bool = False) -> None:
        """Make `repo_id` private (or gated) and readable only with `Authorization: Bearer <token>`.

        Private: every route answers as for a missing repo (401 `RepoNotFound` without a
        token, 404 with another valid one). Gated: info and tree stay public, files are
        401 `GatedRepo` without a token and 403 `GatedRepo` with another valid one.
        """
        with self._lock:
            self._rules[repo_id] = AccessRule(token, gated)
            self._tokens.add(token)

    def add_token(self, token: str) -> None:
        """Make `token` a valid user token (one without access to protected repos)."""
        with self._lock:
            self._tokens.add(token)

    def drop_connection(self, repo_id: str, filename: str, after_bytes: int, times: int = 1) -> None:
        """Close the socket after `after_bytes` body bytes of the next `times` GETs of the file."""
        with self._lock:
            self._drops[(repo_id, filename)] = [after_bytes, times]

    def fail(self, repo_id: str, filename: str, status: int) -> None:
        """Answer every request of the file (HEAD and GET) with `status` until `reset()`:
        a hub or proxy in trouble (502, 503) or rate limiting (429)."""
        with self._lock:
            self._failures[(repo_id, filename)] = status

    def hold(self, repo_id: str, filename: str, after_bytes: int) -> None:
        """Pause the body of the next GET of the file after `after_bytes` bytes until
        `release()` (or `reset()` / `stop()`): a client caught at a known point."""
        with self._lock:
            self._holds[(repo_id, filename)] = after_bytes
            self._released.clear()

    def release(self) -> None:
        """Let every held body go on."""
        self._released.set()

    def wait_released(self) -> None:
        """Block (a handler thread) until `release()`; _Dropped when the hub stops meanwhile."""
        while not self._released.wait(0.05):
            if self.stopping.is_set():
                raise _Dropped()

    def throttle(self, bytes_per_second: int | None) -> None:
        """Send file bodies at about this rate (None: full speed); applies to bodies in flight."""
        self._bytes_per_second = bytes_per_second

    def reset(self) -> None:
        """Forget injected failures, access rules, tokens and the request log; keep repos."""
        with self._lock:
            self._rules.clear()
            self._tokens.clear()
            self._drops.clear()
            self._holds.clear()
            self._failures.clear()
            self._released.set()
            self._bytes_per_second = None
            self._log.clear()

    # -- request log -------------------------------------------------------------------
    @property
    def requests(self) -> list[RequestRecord]:
        """A copy of the request log, oldest first."""
        with self._lock:
            return list(self._log)

    def file_requests(self, filename: str, method: str = "GET") -> list[RequestRecord]:
        """Logged `method` requests of a `resolve` URL ending in `/filename`."""
        return [
            r for r in self.requests
            if r.method == method and "/resolve/" in r.path and r.path.endswith("/" + filename)
        ]

    def log(self, record: RequestRecord) -> None:
        with self._lock:
            self._log.append(record)

    # -- routing (called by the handler threads) ------------------------------------------
    def answer(self, method: str, raw_path: str, query: str, token: str | None, range_: str | None) -> Answer:
        """Route one request; raises `HubError` for error answers."""
        parts = raw_path.strip("/").split("/")
        params = parse_qs(query)
        if parts == ["api", "agent-harnesses"]:  # fetched once per process for the user agent
            return _json({"standardEnvVars": [], "harnesses": {}})
        if parts[:2] == ["api", "models"] and len(parts) > 2:
            repo_id, rest = self._split_repo(parts[2:], ("revision", "tree", "refs"))
            return self._api(repo_id, [unquote(p) for p in rest], params, token, raw_path)
        repo_id, rest = self._split_repo(parts, ("resolve",))
        if len(rest) >= 3 and rest[0] == "resolve":
            filename = "/".join(unquote(p) for p in rest[2:])
            return self._resolve(repo_id, unquote(rest[1]), filename, token, range_, method)
        raise HubError(404, None, "Sorry, we can't find the page you are looking for.")

    def _split_repo(self, parts: list[str], keywords: tuple[str, ...]) -> tuple[str, list[str]]:
        # Repo ids are `org/name` or a bare `name`; prefer whichever the hub knows.
        two = "/".join(unquote(p) for p in parts[:2])
        if len(parts) >= 2 and (two in self._repos or parts[1] not in keywords):
            return two, parts[2:]
        return unquote(parts[0]), parts[1:]

    def _access(self, repo_id: str, token: str | None, *, files: bool) -> Repo:
        if token is not None and token not in self._tokens:
            raise HubError(401, None, "Invalid credentials in Authorization header")
        repo, rule = self._repos.get(repo_id), self._rules.get(repo_id)
        if repo is None or (rule is not None and not rule.gated and token != rule.token):
            raise HubError(404 if token else 401, "RepoNotFound", "Repository not found")
        if rule is not None and rule.gated and files and token != rule.token:
            if token is None:
                raise HubError(401, "GatedRepo", f"Access to model {repo_id} is restricted. You must "
                               "have access to it and be authenticated to access it. Please log in.")
            raise HubError(403, "GatedRepo", f"Access to model {repo_id} is restricted and you are not "
                           f"in the authorized list. Visit {self.url}/{repo_id} to ask for access.")
        return repo

    @staticmethod
    def _commit(repo: Repo, revision: str) -> Commit:
        commit = repo.resolve(revision)
        if commit is None:
            raise HubError(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return commit

    def _api(self, repo_id: str, rest: list[str], params: dict[str, list[str]],
             token: str | None, raw_path: str) -> Answer:
        repo = self._access(repo_id, token, files=False)
        if not rest:
            return _json(self._model_info(repo, self._commit(repo, "main"), params))
        if rest[0] == "revision" and len(rest) == 2:
            return _json(self._model_info(repo, self._commit(repo, rest[1]), params))
        if rest[0] == "tree" and len(rest) >= 2:
            return self._tree(repo, self._commit(repo, rest[1]), "/".join(rest[2:]), params, raw_path)
        if rest == ["refs"]:
            return _json(_refs(repo))
        raise HubError(404, None, "Sorry, we can't find the page you are looking for.")

    def _model_info(self, repo: Repo, commit: Commit, params: dict[str, list[str]]) -> dict[str, Any]:
        rule = self._rules.get(repo.repo_id)
        blobs = params.get("blobs", ["false"])[0].lower() in ("true", "1")
        info = _model_info(repo.repo_id, commit, blobs)
        info["private"] = rule is not None and not rule.gated
        info["gated"] = "manual" if rule is not None and rule.gated else False
        expand = params.get("expand")
        if expand:
            info = {k: v for k, v in info.items() if k in ("_id", "id", *expand)}
        return info

    def _tree(self, repo: Repo, commit: Commit, path: str, params: dict[str, list[str]], raw_path: str) -> Answer:
        recursive = params.get("recursive", ["false"])[0].lower() in ("true", "1")
        expand = params.get("expand", ["false"])[0].lower() in ("true", "1")
        entries = _tree_entries(commit, path, recursive, expand)
        if entries is None:
            raise HubError(404, "EntryNotFound", f"{path} does not exist on \"{commit.sha}\"", commit.sha)
        size = 50 if expand else self.tree_page_size
        start = int(params.get("cursor", ["0"])[0])
        answer = _json(entries[start : start + size])
        if start + size < len(entries):
            query = urlencode({"recursive": str(recursive).lower(), "expand": str(expand).lower(),
                               "cursor": start + size})
            answer.headers["Link"] = f'<{self.url}{raw_path}?{query}>; rel="next"'
        return answer

    def _resolve(self, repo_id: str, revision: str, filename: str, token: str | None,
                 range_: str | None, method: str) -> Answer:
        repo = self._access(repo_id, token, files=True)
        commit = self._commit(repo, revision)
        file = commit.files.get(filename)
        if file is None:
            raise HubError(404, "EntryNotFound", "Entry not found", commit.sha)
        failure = self._failures.get((repo_id, filename))
        if failure is not None:
            raise HubError(failure, None, f"injected HTTP {failure}")
        headers = {
            "X-Repo-Commit": commit.sha,
            "ETag": f'"{file.etag}"',
            "Accept-Ranges": "bytes",
            "Content-Type": _content_type(file),
        }
        if file.is_lfs:
            headers["X-Linked-Etag"] = f'"{file.etag}"'
            headers["X-Linked-Size"] = str(file.size)
            headers["Content-Disposition"] = f'inline; filename="{filename.rsplit("/", 1)[-1]}"'
        start, end = _parse_range(range_, file.size, commit.sha)
        status = 200
        if range_ is not None:
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{file.size}"
        cut = self._take_drop(repo_id, filename) if method == "GET" else None
        hold = self._take_hold(repo_id, filename) if method == "GET" else None
        return Answer(status, headers, file=file, span=(start, end), cut_after=cut, hold_after=hold)

    def _take_hold(self, repo_id: str, filename: str) -> int | None:
        with self._lock:
            return self._holds.pop((repo_id, filename), None)

    def _take_drop(self, repo_id: str, filename: str) -> int | None:
        with self._lock:
            drop = self._drops.get((repo_id, filename))
            if drop is None or drop[1] <= 0:
                return None
            drop[1] -= 1
            return drop[0]

    @property
    def bytes_per_second(self) -> int | None:
        return self._bytes_per_second


def _json(data: Any) -> Answer:
    return Answer(body=json.dumps(data).encode(), headers={"Content-Type": "application/json; charset=utf-8"})


def _content_type(file: HubFile) -> str:
    if file.is_lfs:
        return "application/octet-stream"
    return mimetypes.guess_type(file.path)[0] or "text/plain; charset=utf-8"


def _parse_range(header: str | None, size: int, commit: str) -> tuple[int, int]:
    """[start, end) for a `bytes=a-b`, `bytes=a-` or `bytes=-n` header."""
    if header is None:
        return 0, size
    try:
        unit, spec = header.split("=", 1)
        first, last = spec.split("-", 1)
        if unit.strip() != "bytes" or "," in spec:
            raise ValueError(header)
        if first == "":
            start, end = max(size - int(last), 0), size
        else:
            start, end = int(first), min(int(last) + 1, size) if last else size
    except ValueError:
        start, end = size, size
    if start >= size or start >= end:
        raise HubError(416, None, f"Range Not Satisfiable: bytes */{size}", commit)
    return start, end


def _model_info(repo_id: str, commit: Commit, blobs: bool) -> dict[str, Any]:
    files = list(commit.files.values())
    config = _read_json(commit.files.get("config.json")) or {}
    tokenizer_config = _read_json(commit.files.get("tokenizer_config.json")) or {}
    info: dict[str, Any] = {
        "_id": hashlib.sha1(repo_id.encode()).hexdigest()[:24],
        "id": repo_id,
        "modelId": repo_id,
        "author": repo_id.split("/")[0] if "/" in repo_id else None,
        "sha": commit.sha,
        "lastModified": DATE,
        "createdAt": DATE,
        "private": False,
        "gated": False,
        "disabled": False,
        "downloads": 0,
        "likes": 0,
        "library_name": "transformers" if config else None,
        "tags": ["transformers", "safetensors", config.get("model_type", ""), "text-generation"],
        "pipeline_tag": "text-generation",
        "config": {
            "architectures": config.get("architectures"),
            "model_type": config.get("model_type"),
            "tokenizer_config": {k: v for k, v in tokenizer_config.items() if k.endswith("_token")},
        },
        "siblings": [_sibling(f, blobs) for f in files],
        "spaces": [],
        "usedStorage": sum(f.size for f in files),
    }
    safetensors = _safetensors_info(files)
    if safetensors:
        info["safetensors"] = safetensors
    return info


def _sibling(file: HubFile, blobs: bool) -> dict[str, Any]:
    if not blobs:
        return {"rfilename": file.path}
    sibling: dict[str, Any] = {"rfilename": file.path, "blobId": file.blob_id, "size": file.size}
    if file.is_lfs:
        pointer = _lfs_pointer(file.etag, file.size)
        sibling["lfs"] = {"sha256": file.sha256, "size": file.size, "pointerSize": len(pointer)}
    return sibling


def _read_json(file: HubFile | None) -> dict[str, Any] | None:
    if file is None or file.size > LFS_MIN_SIZE:
        return None
    try:
        return json.loads(b"".join(file.chunks(0, file.size, CHUNK_SIZE)))
    except ValueError:
        return None


def _safetensors_info(files: list[HubFile]) -> dict[str, Any] | None:
    """Parameter counts per dtype from the safetensors headers, as the hub reports them."""
    counts: dict[str, int] = {}
    for file in files:
        if not file.path.endswith(".safetensors") or file.size < 8:
            continue
        for dtype, numel in _safetensors_header(file):
            counts[dtype] = counts.get(dtype, 0) + numel
    return {"parameters": counts, "total": sum(counts.values())} if counts else None


def _safetensors_header(file: HubFile) -> list[tuple[str, int]]:
    """(dtype, element count) per tensor; nothing for a file that is no safetensors file."""
    (length,) = struct.unpack("<Q", b"".join(file.chunks(0, 8, 8)))
    if length > min(file.size - 8, 100_000_000):
        return []
    try:
        header = json.loads(b"".join(file.chunks(8, 8 + length, CHUNK_SIZE)))
        tensors = [t for name, t in header.items() if name != "__metadata__"]
        return [(t["dtype"], math.prod(t["shape"])) for t in tensors]
    except (ValueError, TypeError, KeyError, AttributeError):
        return []


def _tree_entries(commit: Commit, path: str, recursive: bool, expand: bool) -> list[dict[str, Any]] | None:
    """Tree entries under `path` (None if it is no directory), folders included, sorted."""
    prefix = f"{path}/" if path else ""
    dirs: set[str] = set()
    files: list[HubFile] = []
    for file in commit.files.values():
        if not file.path.startswith(prefix):
            continue
        inner = file.path[len(prefix) :].split("/")
        for depth in range(1, len(inner)):
            if recursive or depth == 1:
                dirs.add(prefix + "/".join(inner[:depth]))
        if recursive or len(inner) == 1:
            files.append(file)
    if path and not files and not dirs:
        return None
    entries = [_folder_entry(d, commit) for d in dirs] + [_file_entry(f, commit, expand) for f in files]
    return sorted(entries, key=lambda e: e["path"])


def _folder_entry(path: str, commit: Commit) -> dict[str, Any]:
    oid = hashlib.sha1(f"{commit.sha}:{path}".encode()).hexdigest()
    return {"type": "directory", "oid": oid, "size": 0, "path": path}


def _file_entry(file: HubFile, commit: Commit, expand: bool) -> dict[str, Any]:
    entry: dict[str, Any] = {"type": "file", "oid": file.blob_id, "size": file.size, "path": file.path}
    if file.is_lfs:
        pointer = _lfs_pointer(file.etag, file.size)
        entry["lfs"] = {"oid": file.sha256, "size": file.size, "pointerSize": len(pointer)}
    if expand:
        entry["lastCommit"] = {"id": commit.sha, "title": f"Upload {file.path}", "date": DATE}
    return entry


def _refs(repo: Repo) -> dict[str, Any]:
    branches = [
        {"name": name, "ref": f"refs/heads/{name}", "targetCommit": sha} for name, sha in repo.refs.items()
    ]
    return {"branches": branches, "converts": [], "tags": [], "pullRequests": []}


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], hub: FakeHub) -> None:
        self.hub = hub
        self._open: set[socket.socket] = set()
        self._open_lock = threading.Lock()
        super().__init__(address, handler)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        with self._open_lock:
            self._open.add(request)
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._open_lock:
                self._open.discard(request)

    def close_connections(self) -> None:
        """Unblock handler threads idling on kept-alive connections."""
        with self._open_lock:
            for sock in self._open:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


class _Dropped(Exception):
    """The connection was cut on purpose (injected drop) or the client went away."""


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server
    timeout = 60

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._handle("GET")

    def do_HEAD(self) -> None:  # noqa: N802
        self._handle("HEAD")

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self._handle("POST")

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet by design
        pass

    def _handle(self, method: str) -> None:
        hub = self.server.hub
        url = urlsplit(self.path)
        auth = self.headers.get("Authorization")
        token = auth.split(" ", 1)[1].strip() if auth and auth.lower().startswith("bearer ") else None
        range_ = self.headers.get("Range")
        record = RequestRecord(method, unquote(url.path), url.query, range_, auth is not None)
        hub.log(record)
        try:
            try:
                if method == "POST":
                    raise HubError(404, None, "Sorry, we can't find the page you are looking for.")
                answer = hub.answer(method, url.path, url.query, token, range_)
            except HubError as error:
                self._send_error(record, error, method)
                return
            self._send_answer(record, answer, method)
        except (_Dropped, OSError):  # OSError: the client went away, or stop() cut the socket
            self.close_connection = True

    def _send_error(self, record: RequestRecord, error: HubError, method: str) -> None:
        body = json.dumps({"error": error.message}).encode()
        headers = {"Content-Type": "application/json; charset=utf-8", "X-Error-Message": error.message}
        if error.code:
            headers["X-Error-Code"] = error.code
        if error.commit:
            headers["X-Repo-Commit"] = error.commit
        self._send_head(record, error.status, headers, len(body))
        if method != "HEAD":
            self.wfile.write(body)

    def _send_head(self, record: RequestRecord, status: int, headers: dict[str, str], length: int) -> None:
        record.status = status
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(length))
        self.end_headers()

    def _send_answer(self, record: RequestRecord, answer: Answer, method: str) -> None:
        if answer.file is None:
            self._send_head(record, answer.status, answer.headers, len(answer.body))
            if method != "HEAD":
                self.wfile.write(answer.body)
            return
        start, end = answer.span
        self._send_head(record, answer.status, answer.headers, end - start)
        if method == "HEAD":
            return
        hold = answer.hold_after
        if hold is not None and hold < end - start:
            self._send_body(record, answer.file, start, start + hold, answer.cut_after)
            self.server.hub.wait_released()
            start += hold
        self._send_body(record, answer.file, start, end, answer.cut_after)

    def _send_body(self, record: RequestRecord, file: HubFile, start: int, end: int, cut: int | None) -> None:
        hub = self.server.hub
        rate = hub.bytes_per_second
        chunk_size = CHUNK_SIZE if not rate else max(1, min(CHUNK_SIZE, rate // 10))
        for chunk in file.chunks(start, end, chunk_size):
            if cut is not None and record.bytes_sent + len(chunk) >= cut:
                self.wfile.write(chunk[: cut - record.bytes_sent])
                record.bytes_sent = cut
                raise _Dropped()
            record.bytes_sent += len(chunk)  # before the write, so a reader never lags the client
            try:
                self.wfile.write(chunk)
            except OSError:
                record.bytes_sent -= len(chunk)
                raise
            # Paced per chunk, so that changing the rate mid-body takes effect at once.
            rate = hub.bytes_per_second
            if rate and hub.stopping.wait(len(chunk) / rate):
                raise _Dropped()
