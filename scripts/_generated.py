"""What the generators of committed files (gen_completions.py, gen_man.py) share:
write what is stale, or with --check only report it."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

REPO_ROOT = Path(__file__).resolve().parent.parent


def sync(outputs: dict[str, str], root: Path, check: bool, command: str) -> int:
    """Writes `outputs` (relative path -> text) under `root`, or with `check` only
    reports the stale ones, naming `command` to refresh them (exit 1)."""
    stale = [rel for rel, text in outputs.items() if _read(root / rel) != text]
    if check:
        if stale:
            print(f"stale: {', '.join(stale)} (run {command})", file=sys.stderr)
            return 1
        return 0
    for rel in stale:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(outputs[rel], encoding="utf-8")
        print(f"wrote {rel}", file=sys.stderr)
    return 0


def _read(path: Path) -> str | None:
    return path.read_text(encoding="utf-8") if path.is_file() else None


def main(doc: str, render: Callable[[], dict[str, str]], command: str, argv: list[str] | None = None) -> int:
    """The generators' command line: [--check] [--root DIR]."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file is stale")
    parser.add_argument("--root", type=Path, default=REPO_ROOT, help="write under this directory")
    args = parser.parse_args(argv)
    return sync(render(), args.root, args.check, command)
