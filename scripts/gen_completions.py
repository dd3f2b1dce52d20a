"""Write completions/ruvllm.{bash,zsh,fish} from `ruvllm completion <shell>`.

Run from the repo root: `.venv/bin/python scripts/gen_completions.py` (or `--check`
to exit 1, writing nothing, when a committed script differs from a fresh one).
"""

from __future__ import annotations

import sys

import _generated

sys.path.insert(0, str(_generated.REPO_ROOT))

from ruvllm_cli.cli.completion import SHELLS, completion_script  # noqa: E402
from ruvllm_cli.cli.main import cli  # noqa: E402

COMMAND = ".venv/bin/python scripts/gen_completions.py"


def render_completions() -> dict[str, str]:
    """Relative path -> content of every generated completion script."""
    return {f"completions/ruvllm.{shell}": completion_script(cli, shell) for shell in SHELLS}


def main(argv: list[str] | None = None) -> int:
    return _generated.main(__doc__, render_completions, COMMAND, argv)


if __name__ == "__main__":
    sys.exit(main())
