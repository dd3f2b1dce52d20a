"""One output object: tables and messages for people, JSON for scripts.

Data (tables, JSON, CSV) goes to stdout; progress, notices and errors go to stderr.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Iterable, Sequence

from rich.console import Console
from rich.markup import escape
from rich.table import Table

PIPED_WIDTH = 1000   # a table's width when stdout is no terminal


class Output:
    def __init__(self, no_color: bool = False, verbose: bool = False) -> None:
        self.verbose = verbose
        self.out = Console(no_color=no_color, highlight=False, soft_wrap=True)
        self.err = Console(stderr=True, no_color=no_color, highlight=False, soft_wrap=True)

    def json(self, data: Any) -> None:
        """Machine-readable data alone on stdout (no colour, no wrapping)."""
        sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
        sys.stdout.flush()

    def table(self, columns: Sequence[str], rows: Iterable[Sequence[Any]], title: str | None = None,
              caption: str | None = None) -> None:
        table = Table(title=title, caption=caption, header_style="bold")
        for column in columns:
            # Folded, never cut with an ellipsis: a repo id or path is only worth
            # printing whole (a pipe gets 80 columns).
            table.add_column(column, overflow="fold")
        for row in rows:
            table.add_row(*("" if cell is None else str(cell) for cell in row))
        # Piped (no terminal, no COLUMNS), a row is as long as its cells need, for grep and cut.
        if not self.out.is_terminal and "COLUMNS" not in os.environ:
            self.out.width = PIPED_WIDTH
        self.out.print(table)

    def print(self, *objects: Any, **kwargs: Any) -> None:
        self.out.print(*objects, **kwargs)

    def info(self, message: str) -> None:
        self.err.print(message)

    def success(self, message: str) -> None:
        self.err.print(f"[green]{message}[/green]")

    def warn(self, message: str) -> None:
        self.err.print(f"[yellow]Warning:[/yellow] {escape(message)}")

    def debug(self, message: str) -> None:
        if self.verbose:
            self.err.print(f"[dim]{message}[/dim]")

    def error(self, message: str, hint: str | None = None) -> None:
        self.err.print(f"[bold red]Error:[/bold red] {escape(message)}")
        if hint:
            self.err.print(f"[dim]Hint: {escape(hint)}[/dim]")
