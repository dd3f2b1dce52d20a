"""Write completions/ruvllm.{bash,zsh,fish} from `ruvllm completion <shell>`.

Run from the repo root: `.venv/bin/python scripts/gen_completions.py` (or `--check`
to exit 1, writing nothing, when a committed script differs from a fresh one).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from ruvllm_cli.cli.completion import SHELLS, completion_script  # noqa: E402
from ruvllm_cli.cli.main import cli  # noqa: E402

COMMAND = ".venv/bin/python scripts/gen_completions.py"


def render_completions() -> dict[str, str]:
    """Relative path -> content of every generated completion script."""
    return {f"completions/ruvllm.{shell}": completion_script(cli, shell) for shell in SHELLS}


def sync(outputs: dict[str, str], root: Path, check: bool) -> int:
    """Writes `outputs` under `root`, or with `check` only reports the stale ones (exit 1)."""
    stale = [rel for rel, text in outputs.items() if _read(root / rel) != text]
    if check:
        if stale:
            print(f"stale: {', '.join(stale)} (run {COMMAND})", file=sys.stderr)
            return 1
        return 0
    for rel in stale:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(outputs[rel], encoding="utf-8")
        print(f"wrote {rel}", file=sys.stderr)
    return 0


def _read(path: Path) -> str | None:
    return path.read_text(encoding="utf-8") if path.is_file() else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file is stale")
    parser.add_argument("--root", type=Path, default=REPO_ROOT, help="write under this directory")
    args = parser.parse_args(argv)
    return sync(render_completions(), args.root, args.check)


if __name__ == "__main__":
    sys.exit(main())
