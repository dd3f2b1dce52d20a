"""`ruvllm completion`: print the shell completion script for bash, zsh or fish.

The scripts are Click's own: the shell runs `ruvllm` with `_RUVLLM_COMPLETE=<shell>_complete`
and the words typed so far, and Click answers with the candidates (subcommands, options,
choices, paths). So completion always matches the installed version of the commands.
"""

from __future__ import annotations

import click
from click.shell_completion import CompletionItem, get_completion_class

from ruvllm_cli.cli.context import global_options

PROG_NAME = "ruvllm"
# Click derives this name from PROG_NAME (`_{PROG}_COMPLETE`); main() passes prog_name="ruvllm",
# so `python -m ruvllm_cli` answers the same variable as the console script.
COMPLETE_VAR = "_RUVLLM_COMPLETE"
SHELLS = ("bash", "zsh", "fish")


def completion_script(cli: click.Command, shell: str) -> str:
    """The completion script that makes `shell` complete the `ruvllm` command `cli`.

    Raises ValueError for a shell outside SHELLS.
    """
    if shell not in SHELLS:
        raise ValueError(f"no completion script for {shell!r}; choose one of {SHELLS}")
    completer = get_completion_class(shell)
    assert completer is not None, f"click has no completion class for {shell}"
    return completer(cli, {}, PROG_NAME, COMPLETE_VAR).source()


def complete_model(ctx: click.Context | None, param: click.Parameter | None,
                   incomplete: str) -> list[CompletionItem]:
    """Completes a MODEL argument: registry aliases (built-in and the user's own), then
    the downloaded models' repo ids. Reads only the registry and the cache's manifests
    (no torch, no network).

    Use as `@click.argument("model", shell_complete=complete_model)`. When nothing matches,
    the shell completes file names instead, for local model directories and .gguf files.
    """
    return _model_items(ctx, incomplete) or [CompletionItem(incomplete, type="file")]


def complete_downloaded_model(ctx: click.Context | None, param: click.Parameter | None,
                              incomplete: str) -> list[CompletionItem]:
    """Completes `rm`'s MODEL: what there is to remove, the aliases with a repo in the
    cache and the downloaded repo ids (not every registry alias, as it had)."""
    return _model_items(ctx, incomplete, downloaded_only=True)


def _model_items(ctx: click.Context | None, incomplete: str, downloaded_only: bool = False) -> list[CompletionItem]:
    """The aliases starting with `incomplete` (with `downloaded_only`, those with a repo
    in the cache), then the downloaded repo ids that do."""
    from ruvllm_cli.errors import RuvllmError
    from ruvllm_cli.registry.registry import builtin_entries, load_registry

    try:
        registry = load_registry()
    except RuvllmError:  # a broken user aliases file must not break the shell
        registry = builtin_entries()
    downloaded = _downloaded(ctx)
    present = {repo_id for repo_id, _ in downloaded}
    items = [CompletionItem(alias, help=entry.name) for alias, entry in registry.items()
             if alias.startswith(incomplete) and (not downloaded_only or {entry.repo_id, entry.gguf_repo} & present)]
    items += [CompletionItem(repo_id, help=f"downloaded, {stored_as}")
              for repo_id, stored_as in downloaded if repo_id.lower().startswith(incomplete.lower())]
    return items


def _downloaded(ctx: click.Context | None) -> list[tuple[str, str]]:
    """(repo id, what its files are) of each model in the cache, once per repo."""
    from ruvllm_cli.cli.context import app_context
    from ruvllm_cli.paths import resolve_cache_dir
    from ruvllm_cli.registry.cache import ModelCache

    try:
        cache_dir = app_context(ctx).cache_dir if ctx is not None else resolve_cache_dir(None)
        models = ModelCache(cache_dir).downloaded()
    except Exception:  # noqa: BLE001 - an unreadable cache must not break the shell
        return []
    found = {model.repo_id: model.stored_as for model in models}
    return sorted(found.items(), key=lambda item: item[0].lower())


def complete_user_alias(ctx: click.Context | None, param: click.Parameter | None,
                        incomplete: str) -> list[CompletionItem]:
    """Completes the NAME of `alias rm`: the user's own aliases."""
    from ruvllm_cli.errors import RuvllmError
    from ruvllm_cli.registry.registry import user_entries

    try:
        entries = user_entries()
    except RuvllmError:
        return []
    return [CompletionItem(alias, help=entry.target) for alias, entry in entries.items()
            if alias.startswith(incomplete)]


@click.command("completion")
@click.argument("shell", metavar="SHELL", type=click.Choice(SHELLS))
@global_options
@click.pass_context
def command(ctx: click.Context, shell: str) -> None:
    """Print the completion script for SHELL (bash, zsh or fish) on stdout.

    \b
    Examples:
      eval "$(ruvllm completion bash)"        # in ~/.bashrc
      eval "$(ruvllm completion zsh)"         # in ~/.zshrc, after compinit
      ruvllm completion fish > ~/.config/fish/completions/ruvllm.fish
    """
    click.echo(completion_script(ctx.find_root().command, shell), nl=False)
