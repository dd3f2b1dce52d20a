"""`ruvllm alias`: the user's own model aliases (set, rm, list), kept in the config dir."""

from __future__ import annotations

import click
from rich.markup import escape

from ruvllm_cli.cli.completion import complete_user_alias
from ruvllm_cli.cli.context import app_context, global_options
from ruvllm_cli.cli.options import quantization_option
from ruvllm_cli.quantization import Quantization
from ruvllm_cli.registry.registry import (add_user_alias, aliases_path, builtin_entries, remove_user_alias,
                                          user_entries)


@click.group("alias")
@global_options
def command() -> None:
    """Add, remove or list your own model aliases.

    A user alias names a Hugging Face repo or a local model; it shows in `ruvllm
    list` and works wherever a model name does. It may shadow a built-in alias.

    \b
    Examples:
      ruvllm alias set tiny Qwen/Qwen2.5-0.5B-Instruct
      ruvllm alias set mytiny ./models/tiny
      ruvllm alias list
      ruvllm alias rm tiny
    """


@command.command("set")
@click.argument("name")
@click.argument("target", metavar="REPO_ID|PATH")
@click.option("--name", "display_name", default=None, help="Display name (default: the repo's name).")
@quantization_option("Recommended quantization for this alias (what `ruvllm download` fetches)",
                     "the built-in entry's for that repo, else q4k")
@click.option("--notes", default=None, help="Free-text notes shown by `list --long` and `info`.")
@global_options
def set_alias(name: str, target: str, display_name: str | None, quantization: Quantization | None,
              notes: str | None) -> None:
    """Point alias NAME at the Hugging Face repo REPO_ID (org/name), or at a local model
    PATH (a directory with config.json, or a .gguf file; kept as an absolute path);
    replaces an existing alias of that name.

    \b
    Examples:
      ruvllm alias set tiny Qwen/Qwen2.5-0.5B-Instruct --name "Tiny Qwen"
      ruvllm alias set coder Qwen/Qwen2.5-Coder-1.5B-Instruct -q q8
      ruvllm alias set mytiny ./models/tiny
    """
    out = app_context().output()
    entry = add_user_alias(name, target, name=display_name, recommended_quantization=quantization, notes=notes)
    shadow = " (shadows the built-in alias)" if name in builtin_entries() else ""
    out.success(f"Alias '{escape(entry.alias)}' -> {escape(entry.target)}{shadow}")


@command.command("rm")
@click.argument("name", shell_complete=complete_user_alias)
@global_options
def remove_alias(name: str) -> None:
    """Remove your alias NAME (built-in aliases cannot be removed).

    \b
    Example:
      ruvllm alias rm tiny
    """
    out = app_context().output()
    removed = remove_user_alias(name)
    out.success(f"Removed alias '{escape(removed.alias)}' ({escape(removed.target)})")
    if name in builtin_entries():
        out.info(f"'{escape(name)}' names the built-in model again.")


@command.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print the aliases as JSON on stdout.")
@global_options
def list_aliases(as_json: bool) -> None:
    """List your own aliases.

    \b
    Examples:
      ruvllm alias list
      ruvllm alias list --json
    """
    out = app_context().output()
    builtin = builtin_entries()
    records = [{**entry.to_dict(), "shadows_builtin": alias in builtin}
               for alias, entry in sorted(user_entries().items())]
    if as_json:
        out.json({"aliases": records, "path": str(aliases_path())})
        return
    if not records:
        out.info("No user aliases yet. Add one with: ruvllm alias set NAME ORG/REPO (or a local directory)")
        return
    rows = [(escape(r["alias"]), escape(r["path"] or r["repo_id"]), escape(r["name"]),
             "yes" if r["shadows_builtin"] else "") for r in records]
    out.table(["Alias", "Repo or path", "Name", "Shadows built-in"], rows, title="User aliases",
              caption=escape(str(aliases_path())))
