"""What a download shows: a rich progress display on stderr, fed by the hub client.

huggingface_hub accepts `tqdm_class=` in `hf_hub_download`; `DownloadProgress.tqdm_class`
is a class with just enough of tqdm's interface that forwards the client's byte counts
to a rich `Progress` (one task per file plus a total, with bytes, speed and ETA). On a
stderr that is not a terminal (a CI log, a file) there is no live display: a line when
it starts, one every PLAIN_INTERVAL seconds with the bytes so far, and the summary.
"""

from __future__ import annotations

import time
from pathlib import Path
from threading import RLock
from typing import TYPE_CHECKING, Any, ClassVar, Sequence

from rich.console import Console
from rich.filesize import decimal as format_size
from rich.markup import escape

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

    from ruvllm_cli.registry.cache import DownloadedModel, FileRecord


PLAIN_INTERVAL = 10.0   # seconds between progress lines on a stderr that is not a terminal


class DownloadObserver:
    """Receives a download's events. This base shows nothing (library use, tests)."""

    def already_downloaded(self, model: DownloadedModel) -> None: ...
    def not_checked(self, model: DownloadedModel, reason: str) -> None: ...   # the hub could not be asked
    def removed_orphans(self, paths: Sequence[Path], size: int = 0) -> None: ...
    def started(self, repo_id: str, commit: str, files: Sequence[FileRecord],
                pending: Sequence[FileRecord]) -> None: ...
    def file_started(self, record: FileRecord) -> None: ...
    def file_finished(self, record: FileRecord) -> None: ...
    def fetched_ahead(self, record: FileRecord) -> None: ...   # fetched before `started` (the shards' index)
    def finished(self, model: DownloadedModel) -> None: ...
    def bar_opened(self, initial: int) -> None: ...
    def bar_advanced(self, n: int) -> None: ...

    @property
    def tqdm_class(self) -> type:
        """A tqdm stand-in bound to this observer, for the hub client's `tqdm_class=`."""
        return type("BoundBar", (HubBar,), {"observer": self})

    def __enter__(self) -> DownloadObserver:
        return self

    def __exit__(self, *exc: object) -> None: ...


class HubBar:
    """The part of tqdm's interface huggingface_hub's downloads use, forwarded to an observer."""

    observer: ClassVar[DownloadObserver | None] = None
    _lock: ClassVar[Any] = None

    def __init__(self, *args: Any, total: float | None = None, initial: float = 0, desc: str | None = None,
                 disable: bool = False, **kwargs: Any) -> None:
        self.total, self.n, self.desc, self.disable = total, initial, desc, disable
        if self.observer is not None:
            self.observer.bar_opened(int(initial or 0))

    def update(self, n: float | None = 1) -> None:
        n = int(n or 0)
        self.n += n
        if self.observer is not None and n:
            self.observer.bar_advanced(n)

    def update_transfer(self, n: float | None = 1) -> None:
        """Network bytes; the bytes written (`update`) are what the display counts."""

    @property
    def format_dict(self) -> dict[str, Any]:
        return {"n": self.n, "total": self.total, "rate": None}

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None: ...
    def set_transfer_postfix_str(self, s: str = "", refresh: bool = True) -> None: ...
    def set_description(self, desc: str | None = None, refresh: bool = True) -> None: ...
    def set_description_str(self, desc: str | None = None, refresh: bool = True) -> None: ...
    def refresh(self, *args: Any, **kwargs: Any) -> None: ...
    def clear(self, *args: Any, **kwargs: Any) -> None: ...
    def close(self) -> None: ...

    def __enter__(self) -> HubBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @classmethod
    def get_lock(cls) -> Any:
        if cls._lock is None:
            cls._lock = RLock()
        return cls._lock

    @classmethod
    def set_lock(cls, lock: Any) -> None:
        cls._lock = lock


class DownloadProgress(DownloadObserver):
    """Progress on stderr: live bars on a terminal, summary lines always; `verbose` lists files."""

    def __init__(self, console: Console | None = None, *, verbose: bool = False, live: bool | None = None) -> None:
        self.console = console or Console(stderr=True)
        self.verbose = verbose
        self.live = self.console.is_terminal if live is None else live
        self._progress: Progress | None = None
        self._total_task: TaskID | None = None
        self._file_task: TaskID | None = None
        self._files: Sequence[FileRecord] = ()
        self._pending: Sequence[FileRecord] = ()
        self._done_bytes = 0  # finished pending files
        self._current_bytes = 0  # the file in flight
        self._transferred = 0  # bytes the client really wrote this run
        self._current_transferred = False
        self._fetched: list[FileRecord] = []
        self._ahead = 0   # files fetched before the others (fetched_ahead)
        self._linked: list[FileRecord] = []
        self._start = time.monotonic()
        self._last_line = self._start

    # -- events ----------------------------------------------------------------------------
    def already_downloaded(self, model: DownloadedModel) -> None:
        self.console.print(f"{escape(_label(model))} is already downloaded: {escape(str(model.path))} "
                           f"({format_size(model.total_bytes)}, {_files(len(model.files))})")
        self.console.print("[dim]Nothing fetched; use --force to fetch it again.[/dim]")

    def not_checked(self, model: DownloadedModel, reason: str) -> None:
        self.console.print(f"Could not check the hub for a newer commit of {escape(model.repo_id)}@"
                           f"{escape(model.revision)}: {escape(reason)}; using the downloaded one.")

    def removed_orphans(self, paths: Sequence[Path], size: int = 0) -> None:
        if paths:
            from ruvllm_cli.registry.download import NO_RESUME

            self.console.print(f"Removed {_files(len(paths), 'partial file')} ({format_size(size)}) a stopped "
                               f"download left behind: {NO_RESUME}, so those files start over.")
            for path in paths if self.verbose else ():
                self.console.print(f"[dim]  removed {escape(str(path))}[/dim]")

    def started(self, repo_id: str, commit: str, files: Sequence[FileRecord],
                pending: Sequence[FileRecord]) -> None:
        self._files, self._pending, self._start = files, pending, time.monotonic()
        self._last_line = self._start
        if self.verbose or self.live or pending:
            size = format_size(sum(r.size for r in pending))
            self.console.print(f"Downloading {escape(repo_id)} (commit {commit[:7]}): "
                               f"{len(pending)} of {_files(len(files))} to fetch, {size}")
        if self.verbose:
            for record in files:
                if record not in pending:
                    self.console.print(f"[dim]  have    {escape(record.name)} ({format_size(record.size)})[/dim]")

    def file_started(self, record: FileRecord) -> None:
        self._current_bytes, self._current_transferred = 0, False
        if self._progress is not None:
            self._file_task = self._progress.add_task(escape(record.name), total=record.size)

    def bar_opened(self, initial: int) -> None:
        self._current_transferred = True
        if initial:
            self.bar_advanced(initial)

    def bar_advanced(self, n: int) -> None:
        self._current_transferred = True
        self._transferred += n
        self._current_bytes = max(0, self._current_bytes + n)
        self._show(self._current_bytes)
        if not self.live and time.monotonic() - self._last_line >= PLAIN_INTERVAL:
            self._plain_line()

    def file_finished(self, record: FileRecord) -> None:
        (self._fetched if self._current_transferred else self._linked).append(record)
        self._done_bytes += record.size
        self._current_bytes = 0
        self._show(record.size)
        self._file_task = None
        if self.verbose:
            verb = "fetched" if self._current_transferred else "linked "
            self.console.print(f"[dim]  {verb} {escape(record.name)} ({format_size(record.size)})[/dim]")

    def fetched_ahead(self, record: FileRecord) -> None:
        self._fetched.append(record)
        self._transferred += record.size
        self._ahead += 1

    def finished(self, model: DownloadedModel) -> None:
        self._stop()
        elapsed = max(time.monotonic() - self._start, 1e-6)
        have = len(self._files) - len(self._pending) - self._ahead + len(self._linked)
        speed = f" in {elapsed:.1f}s ({format_size(int(self._transferred / elapsed))}/s)" if self._fetched else ""
        self.console.print(f"Fetched {_files(len(self._fetched))} ({format_size(self._transferred)}){speed}; "
                           f"{have} already in the cache.")
        self.console.print(f"[green]Downloaded {escape(_label(model))}[/green] to {escape(str(model.path))} "
                           f"({format_size(model.total_bytes)}, {_files(len(model.files))})")

    # -- display ---------------------------------------------------------------------------
    def __enter__(self) -> DownloadProgress:
        if self.live and self._pending:
            self._progress = _make_progress(self.console)
            total = sum(r.size for r in self._pending)
            self._total_task = self._progress.add_task("[bold]total[/bold]", total=total)
            self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop()

    def _show(self, file_bytes: int) -> None:
        if self._progress is None:
            return
        if self._file_task is not None:
            self._progress.update(self._file_task, completed=file_bytes)
        if self._total_task is not None:
            self._progress.update(self._total_task, completed=self._done_bytes + self._current_bytes)

    def _plain_line(self) -> None:
        """`  41.2 MB of 123.4 MB (33%), 4.1 MB/s`: a log's view of the download so far."""
        now = time.monotonic()
        self._last_line = now
        total = sum(r.size for r in self._pending)
        done = self._done_bytes + self._current_bytes
        speed = format_size(int(self._transferred / max(now - self._start, 1e-6)))
        share = f" ({100 * done // total}%)" if total else ""
        self.console.print(f"  {format_size(done)} of {format_size(total)}{share}, {speed}/s", highlight=False)

    def _stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def _files(count: int, noun: str = "file") -> str:
    """`1 file`, `6 files` ("file(s)" had said both)."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _make_progress(console: Console) -> Progress:
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                               TransferSpeedColumn)

    return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                    TimeRemainingColumn(), console=console, transient=False)


def _label(model: DownloadedModel) -> str:
    return f"{model.repo_id}@{model.revision} (commit {model.commit[:7]}, {model.stored_as})"
