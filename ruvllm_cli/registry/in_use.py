"""Which models a running `ruvllm serve` uses, or a `ruvllm download` is writing: each
leaves a record of its models' paths in the cache directory while it runs, so that
`ruvllm rm` on that cache can refuse to pull the files from under it (a server that
unloads a model loads it again from them; a download's partial files had been deleted
under it, and it failed). The record lives with the files it protects, not in the data
directory: a server run as a service (another user, another HOME or
RUVLLM_DATA_DIR) on a shared --cache-dir is seen by every `rm` of that cache.
Records of processes that are gone are ignored and cleared. Torch-free."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Iterable


def run_dir(cache_dir: Path) -> Path:
    return Path(cache_dir) / "in-use"


def register(paths: Iterable[Path], url: str, cache_dir: Path, command: str = "serve") -> Callable[[], None]:
    """Record that this process serves `paths` at `url` (or, `command` "download",
    writes them); returns what removes the record."""
    record = run_dir(cache_dir) / f"{command}-{os.getpid()}.json"
    partial = record.with_suffix(".tmp")
    _live_records(cache_dir)   # clears the records a killed server left
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps({"pid": os.getpid(), "url": url, "command": command,
                                       "paths": [str(Path(p).absolute()) for p in paths]}))
        os.replace(partial, record)
    except OSError:   # a cache we cannot write: serve all the same, unprotected
        return lambda: None

    def unregister() -> None:
        record.unlink(missing_ok=True)
        try:
            record.parent.rmdir()   # the last server on this cache leaves it as it found it
        except OSError:
            pass   # another server's record is there

    return unregister


def users_of(files: Iterable[Path], cache_dir: Path) -> list[dict[str, Any]]:
    """The running servers on `cache_dir` (records: pid, url, paths) that serve any of
    `files`, or a model inside a directory among them."""
    wanted = [Path(f).absolute() for f in files]
    return [data for data, paths in _live_records(cache_dir)
            if any(_within(f, p) or _within(p, f) for f in wanted for p in paths)]


def _live_records(cache_dir: Path) -> list[tuple[dict[str, Any], list[Path]]]:
    """The records of servers still running (record, its paths); those of servers that
    are gone are deleted on the way."""
    live = []
    records = run_dir(cache_dir)
    for record in sorted(records.glob("*-*.json")) if records.is_dir() else []:
        try:
            data = json.loads(record.read_text())
            pid, paths = int(data["pid"]), [Path(p) for p in data["paths"]]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if not _alive(pid):
            record.unlink(missing_ok=True)   # its server is gone
            continue
        live.append((data, paths))
    return live


def _within(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True   # someone else's process, alive
    return True
