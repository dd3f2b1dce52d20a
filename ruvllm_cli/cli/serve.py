"""`ruvllm serve`: an OpenAI-compatible HTTP server on the shared engine."""

from __future__ import annotations

import click

from ruvllm_cli.cli.context import global_options
from ruvllm_cli.cli.options import device_option, quantization_option
from ruvllm_cli.errors import RuvllmError


@click.command("serve")
@click.argument("model")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("-p", "--port", type=click.IntRange(0, 65535), default=8080, show_default=True)
@click.option("--max-concurrent", type=click.IntRange(min=1), default=16, show_default=True,
              help="Sequences decoded together.")
@click.option("--max-context", type=click.IntRange(min=16), default=4096, show_default=True,
              help="Longest prompt plus reply, in tokens.")
@quantization_option()
@click.option("--api-key", envvar="RUVLLM_API_KEY", default=None,
              help="Require `Authorization: Bearer KEY` (env RUVLLM_API_KEY).")
@click.option("--cors-origins", default=None, help="Comma-separated origins allowed by CORS (off by default).")
@device_option()
@global_options
def command(**options: object) -> None:
    """Serve MODEL over an OpenAI-compatible API (/v1/chat/completions, /v1/completions, ...).

    \b
    Examples:
      ruvllm serve qwen
      ruvllm serve qwen --port 8080 --api-key secret
    """
    raise RuvllmError("`serve` is not implemented yet", "follow issue #6")
