"""Global options shared by every command, accepted before or after the subcommand."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import click

from ruvllm_cli.paths import resolve_cache_dir

if TYPE_CHECKING:
    from ruvllm_cli.cli.output import Output


@dataclass
class AppContext:
    verbose: bool = False
    no_color: bool = bool(os.environ.get("NO_COLOR"))
    cache_dir_option: str | None = None

    @property
    def cache_dir(self) -> Path:
        return resolve_cache_dir(self.cache_dir_option)

    def output(self) -> "Output":
        from ruvllm_cli.cli.output import Output

        return Output(no_color=self.no_color, verbose=self.verbose)


def app_context(ctx: click.Context | None = None) -> AppContext:
    ctx = ctx or click.get_current_context()
    root = ctx.find_root()
    if root.obj is None:
        root.obj = AppContext()
    return root.obj


def _setter(field: str) -> Callable[[click.Context, click.Parameter, Any], None]:
    def callback(ctx: click.Context, param: click.Parameter, value: Any) -> None:
        # The root takes command line or environment; a subcommand only its own command
        # line, so its copy of an env var cannot undo `ruvllm --cache-dir A list`.
        from_command_line = ctx.get_parameter_source(param.name) is click.core.ParameterSource.COMMANDLINE
        if value not in (None, False) and (ctx.parent is None or from_command_line):
            setattr(app_context(ctx), field, value)

    return callback


def global_options(f: Callable) -> Callable:
    """Adds -v/--verbose, --no-color, --cache-dir and -V/--version to a group or a
    command (global options go before or after the command: `ruvllm list -V` too)."""
    from ruvllm_cli import __version__

    options = [
        click.option("-v", "--verbose", is_flag=True, expose_value=False, is_eager=True,
                     callback=_setter("verbose"), help="Show progress details and tracebacks of errors."),
        click.option("--no-color", is_flag=True, expose_value=False, is_eager=True,
                     callback=_setter("no_color"), help="Turn all colour off (also: NO_COLOR)."),
        click.option("--cache-dir", type=click.Path(file_okay=False), expose_value=False, is_eager=True,
                     callback=_setter("cache_dir_option"), envvar="RUVLLM_CACHE_DIR",
                     help="Model cache directory (env RUVLLM_CACHE_DIR; default: the platform cache dir)."),
        click.version_option(__version__, "-V", "--version", prog_name="ruvllm"),
    ]
    for option in reversed(options):
        f = option(f)
    return f
