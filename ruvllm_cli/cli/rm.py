"""`ruvllm rm`: remove a downloaded model from the cache (planned first, then executed)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import click
from rich.filesize import decimal as format_size
from rich.markup import escape

from ruvllm_cli.cli.completion import complete_downloaded_model
from ruvllm_cli.cli.context import app_context, global_options
from ruvllm_cli.errors import RuvllmError, UsageError

if TYPE_CHECKING:
    from ruvllm_cli.registry.cache import RemovalPlan


@click.command("rm")
@click.argument("model", shell_complete=complete_downloaded_model)
@click.option("-y", "--yes", is_flag=True, help="Remove without asking.")
@click.option("--revision", metavar="REV", help="Remove only this branch, tag or commit (default: all).")
@click.option("--dry-run", is_flag=True, help="Show what would be removed, and remove nothing.")
@click.option("--force", is_flag=True, help="Remove it even while a running `ruvllm serve` uses it or a `ruvllm download` writes it.")
@global_options
def command(model: str, yes: bool, revision: str | None, dry_run: bool, force: bool) -> None:
    """Remove MODEL (an alias or org/name) from the cache: its files and manifests.

    For an alias, whatever `ruvllm download` fetched for it goes: its GGUF repo (every
    quantization) and its safetensors repo. Every downloaded revision goes, unless
    --revision names one.

    \b
    Examples:
      ruvllm rm qwen-0.5b
      ruvllm rm Qwen/Qwen2.5-0.5B-Instruct --revision main -y
      ruvllm rm qwen-0.5b --dry-run
    """
    from ruvllm_cli.registry.cache import ModelCache
    from ruvllm_cli.registry.in_use import users_of
    from ruvllm_cli.registry.locate import download_repos
    from ruvllm_cli.registry.registry import resolve_model

    app = app_context()
    out = app.output()
    ref = resolve_model(model)
    if ref.kind == "local":
        raise UsageError(f"{ref.local_path} is a local path, not a model in the cache",
                         "ruvllm rm removes only downloaded models; delete local files yourself")
    if ref.revision and revision and ref.revision != revision:
        raise UsageError(f"two revisions given: '{ref.revision}' and '{revision}'", "give only one")
    plans = ModelCache(app.cache_dir).plan_removals(download_repos(ref), revision or ref.revision)
    what = " and ".join(_describe(plan) for plan in plans)
    users = users_of((path for plan in plans for path in (*plan.files, *plan.targets())), app.cache_dir)
    downloads = [u for u in users if u.get("command") == "download"]
    users = [u for u in users if u.get("command") != "download"]
    if downloads and not force and not dry_run:
        pids = ", ".join(f"pid {u['pid']}" for u in downloads)
        raise RuvllmError(f"{model} is being downloaded ({pids}): removing its files now fails that download",
                          "wait for it or stop it first, or pass --force")
    if users and not force and not dry_run:
        servers = ", ".join(f"pid {u['pid']} at {u['url']}" for u in users)
        raise RuvllmError(f"{model} is in use by ruvllm serve ({servers}): a server that unloads it loads it "
                          "again from these files", "stop that server first, or pass --force")
    if dry_run or app.verbose:
        for path in (path for plan in plans for path in plan.files):
            out.info(f"  {escape(str(path))}")
    if dry_run:
        out.info(f"Would remove {what}.")
        for user in users:
            out.warn(f"in use by ruvllm serve (pid {user['pid']} at {user['url']})")
        for user in downloads:
            out.warn(f"being downloaded (pid {user['pid']})")
        return
    if not yes and not _confirm(f"Remove {what}?"):
        out.info("Nothing removed.")
        return
    for plan in plans:
        plan.execute()
    out.success(f"Removed {what}.")


def _describe(plan: RemovalPlan) -> str:
    commits = ", ".join(c[:7] for c in plan.commits) or "partial files"
    return f"{plan.repo_id} ({commits}): {len(plan.files)} files, {format_size(plan.bytes)}"


def _confirm(question: str) -> bool:
    if sys.stdin is None or sys.stdin.closed:   # started with stdin closed (`<&-`): input() raised RuntimeError
        raise _no_confirmation()
    try:
        return click.confirm(question, default=False, err=True)
    except click.exceptions.Abort as abort:
        sys.stderr.write("\n")
        # click raises Abort for Ctrl-C too: that one ends as every command's does ("Aborted.", 130).
        if not isinstance(abort.__context__, EOFError):
            raise
        # stdin at its end (a script): refuse rather than guess.
        raise _no_confirmation() from None


def _no_confirmation() -> RuvllmError:
    return RuvllmError("no confirmation (stdin is closed)", "pass -y to remove without asking")
