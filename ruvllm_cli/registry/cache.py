"""The download cache: huggingface_hub's own layout plus a ruvllm manifest per download.

Layout under the cache dir:

    hub/models--<org>--<name>/{blobs,snapshots/<commit>,refs/<branch>}   (huggingface_hub's)
    manifests/<org>--<name>/<commit>.json                              (ours)

A manifest is written only after every file of a download is complete, and a model
counts as downloaded only while its manifest exists and every file it lists is in
the snapshot dir with the recorded size. So a killed or partial download is never
reported as downloaded.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Sequence

from ruvllm_cli import __version__
from ruvllm_cli.fsutil import write_text_atomic
from ruvllm_cli.errors import CacheError, NotDownloadedError
from ruvllm_cli.paths import WEIGHT_CACHE_DIR
from ruvllm_cli.registry.weights import weights_label

DEFAULT_REVISION = "main"
COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
SHORT_COMMIT_RE = re.compile(r"^[0-9a-fA-F]{7,39}$")   # a commit as `download` and `list` print it


@dataclass(frozen=True)
class FileRecord:
    name: str
    size: int


@dataclass(frozen=True)
class DownloadedModel:
    """One complete download: a repo at one commit, verified on disk."""

    repo_id: str
    revision: str
    commit: str
    stored_as: str  # what the weight files are: "safetensors bf16", "GGUF Q4_K_M" (registry/weights.py)
    files: tuple[FileRecord, ...]
    path: Path  # the snapshot dir
    total_bytes: int
    downloaded_at: str

    @property
    def weight_cache_bytes(self) -> int:
        """ruvllm's quantized weights kept beside the download (`rm` removes them with it)."""
        return tree_bytes(self.path / WEIGHT_CACHE_DIR)

    def to_json(self) -> dict[str, Any]:
        return {
            "repo_id": self.repo_id, "revision": self.revision, "commit": self.commit,
            "stored_as": self.stored_as, "path": str(self.path),
            "files": [{"name": f.name, "size": f.size} for f in self.files],
            "total_bytes": self.total_bytes, "weight_cache_bytes": self.weight_cache_bytes,
            "downloaded_at": self.downloaded_at,
        }


@dataclass(frozen=True)
class RemovalPlan:
    """What `rm` would delete; nothing happens until `execute()`."""

    repo_id: str
    commits: tuple[str, ...]
    files: tuple[Path, ...]  # snapshot entries, manifests and leftover partial files
    bytes: int  # disk space freed
    _strategy: Any = field(default=None, repr=False)  # huggingface_hub DeleteCacheStrategy
    _paths: tuple[Path, ...] = field(default=(), repr=False)  # ours: manifests, partial files, locks
    _prune: tuple[Path, ...] = field(default=(), repr=False)  # dirs removed if left empty

    def execute(self) -> None:
        """Deletes the plan; raises CacheError naming a path that stays. The hub client only
        logs a file it may not delete, so what is left on disk decides, not its silence."""
        errors: list[OSError] = []
        if self._strategy is not None:
            errors += _execute_strategy(self._strategy)
        for path in self._paths:
            errors += _remove_path(path)
        for directory in self._prune:
            try:
                directory.rmdir()
            except OSError:
                pass
        left = _left_over(self.targets())
        if left or errors:
            raise _removal_error(self.repo_id, left, errors)

    def targets(self) -> list[Path]:
        """Every path the plan deletes: the hub strategy's and ours (directories whole),
        which `rm` checks against the processes using the cache."""
        kinds = ("files", "repos", "snapshots", "refs", "blobs")   # getattr: `files` is not in every huggingface_hub
        hub = [path for kind in kinds for path in getattr(self._strategy, kind, ())]
        return [*hub, *self._paths]


def repo_folder_name(repo_id: str) -> str:
    """huggingface_hub's folder name for a model repo."""
    return "models--" + repo_id.replace("/", "--")


def is_commit(revision: str) -> bool:
    return bool(COMMIT_RE.match(revision))


class ModelCache:
    """Reads and writes the cache layout above; the hub client itself does the transfers."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.hub_dir = self.root / "hub"
        self.manifests_dir = self.root / "manifests"

    # -- paths -------------------------------------------------------------------------
    def repo_dir(self, repo_id: str) -> Path:
        return self.hub_dir / repo_folder_name(repo_id)

    def snapshot_dir(self, repo_id: str, commit: str) -> Path:
        return self.repo_dir(repo_id) / "snapshots" / commit

    def manifest_path(self, repo_id: str, commit: str) -> Path:
        return self._manifest_dir(repo_id) / f"{commit}.json"

    def _manifest_dir(self, repo_id: str) -> Path:
        return self.manifests_dir / repo_id.replace("/", "--")

    # -- queries -----------------------------------------------------------------------
    def downloaded(self) -> list[DownloadedModel]:
        """Every complete download, verified on disk, sorted by repo id then date."""
        if not self.manifests_dir.is_dir():
            return []
        models = (self._load(path) for path in sorted(self.manifests_dir.glob("*/*.json")))
        complete = [model for model in models if model is not None]
        return sorted(complete, key=lambda m: (m.repo_id.lower(), m.downloaded_at))

    def unfinished(self, complete: Sequence[DownloadedModel] | None = None) -> list[tuple[str, int]]:
        """(repo id, bytes) of what downloads left in the cache that is no complete
        download: a whole repo without one (a run killed or interrupted, files since
        deleted or truncated, a damaged manifest), or, beside a complete revision, a
        killed run's `*.incomplete` files and snapshots without a complete manifest (a
        stopped `download ID@dev` with main complete). `list -d` names them, since
        `downloaded` leaves them out."""
        if not self.hub_dir.is_dir():
            return []
        done: dict[str, set[str]] = {}
        for model in self.downloaded() if complete is None else complete:
            done.setdefault(model.repo_id, set()).add(model.commit)
        found = []
        for folder in sorted(p for p in self.hub_dir.glob("models--*") if p.is_dir()):
            repo_id = folder.name.removeprefix("models--").replace("--", "/", 1)
            size = tree_bytes(folder) if repo_id not in done else self._leftover_bytes(repo_id, done[repo_id])
            if size is not None:
                found.append((repo_id, size))
        return found

    def _leftover_bytes(self, repo_id: str, complete: set[str]) -> int | None:
        """The bytes of a repo's orphaned partial files and of the blobs only its
        snapshots outside `complete` hold; None when it has neither."""
        orphans = self.orphaned_incomplete_files(repo_id)
        snapshots = self.repo_dir(repo_id) / "snapshots"
        partial = [d for d in snapshots.iterdir() if d.is_dir() and d.name not in complete] \
            if snapshots.is_dir() else []
        if not orphans and not partial:
            return None
        kept = {p for commit in complete for p in _snapshot_files(snapshots / commit)}
        only = {p for d in partial for p in _snapshot_files(d)} - kept
        return sum(file_size(p) for p in orphans) + sum(file_size(p) for p in only)

    def find(self, repo_id: str, revision: str | None = None) -> DownloadedModel | None:
        """The complete download of `repo_id` at `revision`, or None.

        None means the default branch (main); a branch or tag resolves through
        `hub/models--*/refs/<name>`; a 40-hex commit is looked up directly, and a
        shorter one (7 hex digits and up, as `download` and `list` print them) names
        the one downloaded commit it begins.
        """
        commit = self.resolve_commit(repo_id, revision)
        if commit is None:
            return None
        found = self._load(self.manifest_path(repo_id, commit))
        if found is None and not is_commit(revision or DEFAULT_REVISION):
            # The branch moved to a commit whose download did not finish (disk full
            # before its manifest, files damaged since): its newest complete one serves.
            found = self._newest_complete(repo_id, revision or DEFAULT_REVISION)
        return found

    def _newest_complete(self, repo_id: str, revision: str) -> DownloadedModel | None:
        loaded = (self._load(self.manifest_path(repo_id, str(m["commit"])))
                  for m in self._manifests(repo_id) if m.get("revision") == revision and "commit" in m)
        complete = [model for model in loaded if model is not None]
        return max(complete, key=lambda m: m.downloaded_at) if complete else None

    def is_current(self, model: DownloadedModel) -> bool:
        """Whether `model` is what its branch or tag names locally now, not an older
        commit of a branch that moved (kept until `rm ID@COMMIT`)."""
        found = self.find(model.repo_id, model.revision)
        return found is None or found.commit == model.commit

    def resolve_commit(self, repo_id: str, revision: str | None = None) -> str | None:
        """The commit a revision names locally (refs, then manifests), without the network."""
        revision = revision or DEFAULT_REVISION
        if is_commit(revision):
            return revision
        ref = self.repo_dir(repo_id) / "refs" / revision
        if ref.is_file():
            commit = ref.read_text().strip()
            if is_commit(commit):
                return commit
        return self._commit_from_manifests(repo_id, revision) or self._commit_from_prefix(repo_id, revision)

    def _commit_from_manifests(self, repo_id: str, revision: str) -> str | None:
        matches = [m for m in self._manifests(repo_id) if m.get("revision") == revision]
        matches.sort(key=lambda m: str(m.get("downloaded_at", "")))
        return str(matches[-1]["commit"]) if matches else None

    def _commit_from_prefix(self, repo_id: str, revision: str) -> str | None:
        if not SHORT_COMMIT_RE.match(revision):
            return None
        commits = {str(m.get("commit")) for m in self._manifests(repo_id)}
        found = [commit for commit in commits if commit.startswith(revision.lower())]
        return found[0] if len(found) == 1 else None

    def _manifests(self, repo_id: str) -> list[dict[str, Any]]:
        directory = self._manifest_dir(repo_id)
        data = (_read_json(path) for path in sorted(directory.glob("*.json")))
        return [d for d in data if d is not None]

    def _load(self, manifest: Path) -> DownloadedModel | None:
        """The manifest's model if every file it lists is on disk with its size."""
        data = _read_json(manifest)
        if data is None:
            return None
        try:
            model = _model_from_manifest(data, self.snapshot_dir(data["repo_id"], data["commit"]))
        except (KeyError, TypeError, ValueError):
            return None
        return model if files_complete(model.path, model.files) else None

    # -- writes ------------------------------------------------------------------------
    def write_manifest(self, *, repo_id: str, revision: str | None, commit: str,
                       files: Iterable[FileRecord]) -> DownloadedModel:
        """Records a finished download, with what its weight files are; refuses while any
        listed file is missing or short."""
        records = tuple(files)
        snapshot = self.snapshot_dir(repo_id, commit)
        if not files_complete(snapshot, records):
            raise CacheError(f"refusing to record {repo_id}@{commit[:7]}: some files are missing or incomplete",
                             "run the download again")
        data = {
            "repo_id": repo_id, "revision": revision or DEFAULT_REVISION, "commit": commit,
            "stored_as": weights_label(snapshot, (r.name for r in records)),
            "files": [{"name": r.name, "size": r.size} for r in records],
            "total_bytes": sum(r.size for r in records),
            "downloaded_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "ruvllm_version": __version__,
        }
        _write_json_atomic(self.manifest_path(repo_id, commit), data)
        return _model_from_manifest(data, snapshot)

    def write_ref(self, repo_id: str, revision: str, commit: str) -> None:
        """Points a branch/tag at a commit, as huggingface_hub does (we download by commit)."""
        if is_commit(revision):
            return
        ref = self.repo_dir(repo_id) / "refs" / revision
        ref.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(ref, commit)

    def partly_downloaded(self, repo_id: str, revision: str | None = None) -> bool:
        """Whether a download of `revision` (None: main) began and did not finish, or its
        files changed since: its commit is known (a ref or manifest) with a snapshot or
        manifest left, or (main) a killed run's `*.incomplete` files are there. A revision
        never fetched, or removed, is not."""
        if self.find(repo_id, revision) is not None:
            return False
        commit = self.resolve_commit(repo_id, revision)
        if commit is not None and (self.snapshot_dir(repo_id, commit).is_dir()
                                   or self.manifest_path(repo_id, commit).is_file()):
            return True
        return revision in (None, DEFAULT_REVISION) and bool(self.orphaned_incomplete_files(repo_id))

    def orphaned_incomplete_files(self, repo_id: str) -> list[Path]:
        """`*.incomplete` blobs a killed run left behind: those whose download lock is free."""
        blobs = self.repo_dir(repo_id) / "blobs"
        if not blobs.is_dir():
            return []
        locks = self.hub_dir / ".locks" / repo_folder_name(repo_id)
        return [path for path in sorted(blobs.glob("*.incomplete"))
                if not _lock_held(locks / f"{path.name.split('.')[0]}.lock")]

    def remove_orphaned_incomplete_files(self, repo_id: str) -> list[Path]:
        """Deletes the orphans above; returns what it deleted."""
        removed = []
        for path in self.orphaned_incomplete_files(repo_id):
            try:
                path.unlink()
            except FileNotFoundError:
                continue
            removed.append(path)
        return removed

    # -- removal -----------------------------------------------------------------------
    def plan_removal(self, repo_id: str, revision: str | None = None) -> RemovalPlan:
        """Plans deleting a model: every revision, or only `revision`, with its manifests.

        Raises NotDownloadedError when the cache holds nothing of it.
        """
        (plan,) = self.plan_removals([repo_id], revision)
        return plan

    def plan_removals(self, repo_ids: Sequence[str], revision: str | None = None) -> list[RemovalPlan]:
        """`plan_removal` for each of `repo_ids` the cache holds (an alias's GGUF and safetensors repos).

        Raises NotDownloadedError when it holds none of them.
        """
        plans = [self._plan_repo(repo_id, revision) for repo_id in repo_ids]
        held = [plan for plan in plans if plan.files or plan._paths]
        if not held:
            names = " nor ".join(repo_ids) + (f" at revision {revision}" if revision else "")
            missing = f"{names} is not" if len(repo_ids) == 1 else f"neither {names} is"
            raise NotDownloadedError(f"{missing} in the cache ({self.root})",
                                     "see what is there with: ruvllm list --downloaded")
        return held

    def _plan_repo(self, repo_id: str, revision: str | None) -> RemovalPlan:
        scan, hub_repo = self._scan_repo(repo_id)
        if revision is None:
            return self._plan_whole_repo(repo_id, scan, hub_repo)
        return self._plan_revision(repo_id, revision, scan, hub_repo)

    def _plan_whole_repo(self, repo_id: str, scan: Any, hub_repo: Any) -> RemovalPlan:
        manifest_dir, repo_dir = self._manifest_dir(repo_id), self.repo_dir(repo_id)
        manifests = tuple(sorted(manifest_dir.glob("*.json")))
        commits = {p.stem for p in manifests}
        partial = tuple(self.orphaned_incomplete_files(repo_id))
        strategy = None
        if hub_repo is not None and hub_repo.revisions:
            commits |= {rev.commit_hash for rev in hub_repo.revisions}
            strategy = scan.delete_revisions(*(rev.commit_hash for rev in hub_repo.revisions))
            entries = _snapshot_entries(hub_repo.revisions)
            size = strategy.expected_freed_size + sum(file_size(p) for p in partial)
        else:
            # A repo the scan skipped (a snapshot link to a blob since deleted) or never
            # listed (a killed first download) goes whole with the dirs below: count what
            # is in it, where the plan had said "1 files, 0 bytes".
            entries, size = _snapshot_links(repo_dir), tree_bytes(repo_dir)
        # We also remove the dirs ourselves: a killed first download leaves a repo dir
        # with only partial blobs, which scan_cache_dir does not report.
        locks = self.hub_dir / ".locks" / repo_folder_name(repo_id)
        paths = tuple(p for p in (*manifests, manifest_dir, repo_dir, locks) if p.exists())
        files = (*entries, *manifests, *partial)
        return RemovalPlan(repo_id, tuple(sorted(commits)), files, size, strategy, paths)

    def _plan_revision(self, repo_id: str, revision: str, scan: Any, hub_repo: Any) -> RemovalPlan:
        commit = self.resolve_commit(repo_id, revision)
        if commit is None:
            return RemovalPlan(repo_id, (), (), 0)
        manifest = self.manifest_path(repo_id, commit)
        manifests = (manifest,) if manifest.exists() else ()
        revisions = [r for r in (hub_repo.revisions if hub_repo is not None else ()) if r.commit_hash == commit]
        strategy = scan.delete_revisions(commit) if revisions else None
        size = strategy.expected_freed_size if strategy is not None else 0
        files = (*_snapshot_entries(revisions), *manifests)
        return RemovalPlan(repo_id, (commit,) if files else (), files, size, strategy, manifests,
                           (self._manifest_dir(repo_id),))

    def _scan_repo(self, repo_id: str) -> tuple[Any, Any]:
        """huggingface_hub's scan of the cache (HFCacheInfo) and its entry for the repo, or Nones."""
        if not self.hub_dir.is_dir():
            return None, None
        from huggingface_hub import scan_cache_dir

        scan = scan_cache_dir(self.hub_dir)
        for repo in scan.repos:
            if repo.repo_type == "model" and repo.repo_id == repo_id:
                return scan, repo
        return scan, None


def files_complete(snapshot: Path, files: Iterable[FileRecord]) -> bool:
    """True when every file exists under `snapshot` (through its symlink) with its size."""
    for record in files:
        try:
            if (snapshot / record.name).stat().st_size != record.size:
                return False
        except OSError:
            return False
    return True


def _model_from_manifest(data: dict[str, Any], snapshot: Path) -> DownloadedModel:
    files = tuple(FileRecord(str(f["name"]), int(f["size"])) for f in data["files"])
    return DownloadedModel(
        repo_id=str(data["repo_id"]), revision=str(data.get("revision") or DEFAULT_REVISION),
        commit=str(data["commit"]), files=files,
        # Older manifests recorded the download's -q, not what the files are: read the files.
        stored_as=str(data.get("stored_as") or weights_label(snapshot, (f.name for f in files))),
        path=snapshot, total_bytes=int(data.get("total_bytes", sum(f.size for f in files))),
        downloaded_at=str(data.get("downloaded_at", "")),
    )


def _snapshot_entries(revisions: Iterable[Any]) -> tuple[Path, ...]:
    return tuple(sorted(f.file_path for rev in revisions for f in rev.files))


def _snapshot_files(snapshot: Path) -> set[Path]:
    """The files a snapshot dir holds, its links resolved to their blobs."""
    found = snapshot.rglob("*") if snapshot.is_dir() else ()
    return {p.resolve() for p in found if p.is_file()}


def _snapshot_links(repo_dir: Path) -> tuple[Path, ...]:
    """The entries of a repo's snapshot dirs as they are on disk, dangling links included."""
    snapshots = repo_dir / "snapshots"
    found = snapshots.rglob("*") if snapshots.is_dir() else ()
    return tuple(sorted(p for p in found if p.is_symlink() or p.is_file()))


def _lock_held(lock_path: Path) -> bool:
    """Whether another process holds huggingface_hub's download lock (non-blocking probe)."""
    if not lock_path.exists():
        return False
    from filelock import FileLock, Timeout

    lock = FileLock(str(lock_path), timeout=0)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        return True
    except OSError:
        return False
    lock.release()
    return False


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    write_text_atomic(path, json.dumps(data, indent=2) + "\n")


def file_size(path: Path) -> int:
    """A file's size, 0 where it cannot be read (gone meanwhile)."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


def tree_bytes(folder: Path) -> int:
    """The bytes of the files under `folder`, links not followed (a hub repo's snapshot
    links point at its own blobs, which count once)."""
    return sum(file_size(p) for p in folder.rglob("*") if p.is_file() and not p.is_symlink()) \
        if folder.is_dir() else 0


def _remove_path(path: Path) -> list[OSError]:
    """Deletes a file or tree; returns the error that stopped it (nothing: done)."""
    import shutil

    try:
        if path.is_symlink() or path.is_file():
            path.unlink(missing_ok=True)
        elif path.is_dir():
            shutil.rmtree(path)
    except FileNotFoundError:
        pass
    except OSError as error:
        return [error]
    return []


def _execute_strategy(strategy: Any) -> list[OSError]:
    """Runs huggingface_hub's DeleteCacheStrategy, which logs (with a traceback) a path it
    may not delete and goes on: its errors come back instead, and its log stays quiet."""
    import logging

    caught = _DeletionErrors()
    logger = logging.getLogger("huggingface_hub.utils._cache_manager")
    logger.addFilter(caught)
    try:
        strategy.execute()
    except OSError as error:   # anything but a PermissionError ends it: a read-only file system
        caught.errors.append(error)
    finally:
        logger.removeFilter(caught)
    return caught.errors


class _DeletionErrors:
    """A logging filter that keeps the errors of the hub's "Couldn't delete" records and drops every record."""

    def __init__(self) -> None:
        self.errors: list[OSError] = []

    def filter(self, record: Any) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, OSError):
            self.errors.append(error)
        return False


def _exists(path: Path) -> bool:
    return path.is_symlink() or path.exists()


def _left_over(paths: Iterable[Path]) -> list[Path]:
    """What stays of `paths`: the files under a directory, or the directory when it shows none."""
    left: list[Path] = []
    for path in (p for p in dict.fromkeys(paths) if _exists(p)):
        tree = path.is_dir() and not path.is_symlink()
        inside = sorted(p for p in path.rglob("*") if p.is_symlink() or not p.is_dir()) if tree else []
        left += inside or [path]
    return list(dict.fromkeys(left))


def _removal_error(repo_id: str, left: list[Path], errors: list[OSError]) -> CacheError:
    """Names the first path that stays (an rmtree error names a file relative to its dir only)."""
    reason = (errors[0].strerror or type(errors[0]).__name__) if errors else "it is still there"
    path = left[0] if left else Path(errors[0].filename or repo_id)
    more = f" (and {len(left) - 1} more)" if len(left) > 1 else ""
    return CacheError(f"could not remove all of {repo_id}: {path}: {reason}{more}",
                      f"make {path.parent} writable (or its file system), then run ruvllm rm again")
