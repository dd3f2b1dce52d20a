"""File helpers shared by the cache, the alias file and saved chats."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def write_text_atomic(path: Path, text: str, mode: int | None = None) -> None:
    """Readers see the old file or the new one, never half of one: write a temp file
    in the same directory, fsync it, then os.replace. The temp file's name carries
    the writer's pid, so the next write removes those of writers killed midway. The
    file is private to its owner (mkstemp's 0600) unless `mode` says otherwise."""
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_writers_files(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            if mode is not None:
                os.fchmod(handle.fileno(), mode)
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def remove_dead_writers_files(path: Path, names: str | None = None) -> None:
    """Delete `.NAME.PID.*.tmp` files beside `path` whose writer process is gone; with
    `names` (a glob), those of every NAME it matches (files named anew at each write,
    as the chat's timestamped saves: a killed save's temp file matched no later name)."""
    pattern = f".{glob_escape(path.name) if names is None else names}.*.tmp"
    for leftover in path.parent.glob(pattern):
        pid_text = leftover.name[:-len(".tmp")].rsplit(".", 2)[-2]
        if pid_text.isdigit() and not _alive(int(pid_text)):
            with contextlib.suppress(OSError):
                leftover.unlink()


def glob_escape(text: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in text)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True   # someone else's process (or no such pid on this platform): leave it
    return True


def user_file_mode(path: Path) -> int:
    """The mode a file the user names gets when it is written anew: the old file's, else
    what the umask leaves of 0666, as open() would give it."""
    try:
        return path.stat().st_mode & 0o7777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask
