"""The `ruvllm` command: wires the subcommands together and maps errors to exit codes.

Subcommand modules are imported only when their command runs, so `ruvllm --help`
and the model-free commands never import torch.
"""

from __future__ import annotations

import atexit
import difflib
import gc
import importlib
import os
import sys

import click

from ruvllm_cli.cli.context import AppContext, app_context, global_options
from ruvllm_cli.errors import RuvllmError, Terminated

# name -> (module, aliases); each module defines `command`.
COMMANDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "download": ("ruvllm_cli.cli.download", ("dl",)),
    "list": ("ruvllm_cli.cli.list_cmd", ("ls",)),
    "info": ("ruvllm_cli.cli.info", ()),
    "rm": ("ruvllm_cli.cli.rm", ()),
    "alias": ("ruvllm_cli.cli.alias", ()),
    "chat": ("ruvllm_cli.cli.chat", ()),
    "serve": ("ruvllm_cli.cli.serve", ()),
    "benchmark": ("ruvllm_cli.cli.benchmark", ("bench",)),
    "completion": ("ruvllm_cli.cli.completion", ()),
}
ALIASES = {alias: name for name, (_, aliases) in COMMANDS.items() for alias in aliases}
SHORT_HELP = {
    "download": "Download a model into the cache.",
    "list": "List registry models, or the downloaded ones.",
    "info": "Show a model's details, cache status and memory estimates.",
    "rm": "Remove a downloaded model from the cache.",
    "alias": "Add, remove or list your own model aliases.",
    "chat": "Chat with a model in the terminal.",
    "serve": "Serve a model over an OpenAI-compatible HTTP API.",
    "benchmark": "Measure TTFT, throughput, latency and memory.",
    "completion": "Print a shell completion script.",
}


class LazyGroup(click.Group):
    """A group whose commands are imported on first use and reachable by alias."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        name = ALIASES.get(name, name)
        if name not in COMMANDS:
            return None
        module = importlib.import_module(COMMANDS[name][0])
        return module.command

    def resolve_command(self, ctx, args):  # type: ignore[no-untyped-def]
        name = args[0] if args else ""
        if name and not name.startswith("-") and not ctx.resilient_parsing and self.get_command(ctx, name) is None:
            close = difflib.get_close_matches(name, [*COMMANDS, *ALIASES], n=1)
            if close:   # as a misspelt model name gets
                ctx.fail(f"No such command '{name}'. Did you mean '{ALIASES.get(close[0], close[0])}'?")
        # Report the canonical name so `ruvllm dl` shows up as `download` in errors and help.
        _, cmd, rest = super().resolve_command(ctx, args)
        return (cmd.name if cmd else None), cmd, rest

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = []
        for name, (_, aliases) in COMMANDS.items():
            label = f"{name} ({', '.join(aliases)})" if aliases else name
            rows.append((label, SHORT_HELP[name]))
        with formatter.section("Commands"):
            formatter.write_dl(rows)


CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


@click.group(cls=LazyGroup, context_settings=CONTEXT_SETTINGS)
@global_options
@click.pass_context
def cli(ctx: click.Context) -> None:
    """Download, chat with, serve and benchmark local LLMs.

    \b
    Examples:
      ruvllm download qwen
      ruvllm chat qwen
      ruvllm serve qwen --port 8080
      ruvllm benchmark qwen --format json
    """
    app_context(ctx)


def _handle_error(error: BaseException, app: AppContext) -> int:
    out = app.output()
    if isinstance(error, RuvllmError):
        out.error(error.message, error.hint)
        code = error.exit_code
    elif isinstance(error, Terminated):
        out.err.print("Terminated.")
        return 143
    elif isinstance(error, click.exceptions.Abort) or isinstance(error, KeyboardInterrupt):
        out.err.print("Aborted.")
        return 130
    elif isinstance(error, click.ClickException):
        error.show()
        return error.exit_code
    else:
        out.error(f"{type(error).__name__}: {error}", "run with --verbose to see the traceback")
        code = 1
    if app.verbose:
        out.err.print_exception()
    return code


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `ruvllm` console script."""
    atexit.unregister(_quick_exit)   # once, however often main runs in one process
    atexit.register(_quick_exit)
    for name in ("stdout", "stderr"):   # closed by the shell (`>&-`): Python leaves None, which
        if getattr(sys, name) is None:  # print() skips but a write raised AttributeError: discarded, as print does
            setattr(sys, name, open(os.devnull, "w", encoding="utf-8"))
    app = AppContext()
    try:
        # Outside standalone mode click gives a command's click.exceptions.Exit back as
        # main's return value, the exit code (it was dropped: rc 0 after such an Exit(1)).
        code = cli.main(args=argv, prog_name="ruvllm", standalone_mode=False, obj=app)
    except click.exceptions.Exit as done:
        sys.exit(done.exit_code)
    except BaseException as error:  # noqa: BLE001 - this is the one place errors become exit codes
        if isinstance(error, SystemExit):
            raise
        sys.exit(_handle_error(error, app))
    sys.exit(code if isinstance(code, int) else 0)


def _quick_exit() -> None:
    """The last exit handler: the objects alive now go to the collector's permanent
    generation, so the interpreter's teardown does not trace them again and again.
    After a model's load (torch, transformers' template renderer) that teardown took
    0.45 s of every command; files are closed and streams flushed as before, and
    nothing that outlives the process is left to a destructor."""
    gc.freeze()
