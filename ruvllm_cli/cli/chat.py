"""`ruvllm chat`: an interactive REPL on the shared engine."""

from __future__ import annotations

import click

from ruvllm_cli.cli.context import global_options
from ruvllm_cli.cli.options import device_option, quantization_option
from ruvllm_cli.errors import RuvllmError


@click.command("chat")
@click.argument("model")
@click.option("-s", "--system", help="System prompt.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=512, show_default=True,
              help="Most tokens per reply.")
@click.option("-t", "--temperature", type=click.FloatRange(0.0, 2.0), default=0.7, show_default=True)
@click.option("--top-p", type=click.FloatRange(0.0, 1.0, min_open=True), default=None)
@click.option("--seed", type=int, default=None, help="Sampling seed, for reproducible replies.")
@quantization_option()
@device_option()
@global_options
def command(**options: object) -> None:
    """Chat with MODEL in the terminal, streaming each reply as it is generated.

    \b
    Examples:
      ruvllm chat qwen
      ruvllm chat qwen -s "You are terse." -t 0.2
      echo "hello" | ruvllm chat qwen --max-tokens 32
    """
    raise RuvllmError("`chat` is not implemented yet", "follow issue #5")
