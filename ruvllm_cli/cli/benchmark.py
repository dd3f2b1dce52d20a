"""`ruvllm benchmark`: measured TTFT, throughput, latency and memory."""

from __future__ import annotations

import click

from ruvllm_cli.cli.context import global_options
from ruvllm_cli.cli.options import device_option, quantization_option
from ruvllm_cli.errors import RuvllmError


@click.command("benchmark")
@click.argument("model")
@click.option("--warmup", type=click.IntRange(min=0), default=3, show_default=True)
@click.option("-i", "--iterations", type=click.IntRange(min=1), default=10, show_default=True)
@click.option("--prompt-length", type=click.IntRange(min=1), default=128, show_default=True,
              help="Prompt length in tokens (exact).")
@click.option("--gen-length", type=click.IntRange(min=1), default=64, show_default=True,
              help="Generated tokens per request (exact; EOS ignored).")
@quantization_option()
@click.option("--format", "fmt", type=click.Choice(["table", "json", "csv"]), default="table", show_default=True)
@click.option("--concurrency", type=click.IntRange(min=1), default=1, show_default=True,
              help="Requests run at once.")
@click.option("--output", type=click.Path(dir_okay=False), default=None, help="Also write the result to FILE.")
@device_option()
@global_options
def command(**options: object) -> None:
    """Benchmark MODEL through the engine and report only measured figures.

    \b
    Examples:
      ruvllm benchmark qwen
      ruvllm benchmark qwen --format json --concurrency 8
    """
    raise RuvllmError("`benchmark` is not implemented yet", "follow issue #7")
