"""What the engine benchmark scripts in scripts/ share: their common options and the
model they run on (the Qwen2.5-0.5B-shaped random model unless --model names one)."""

from __future__ import annotations

import argparse
from pathlib import Path

BENCH_MODEL_CACHE = Path.home() / ".cache" / "ruvllm-bench-models"


def script_parser(doc: str | None, quantizations: list[str] | None = None) -> argparse.ArgumentParser:
    """An argument parser with --model, --cache, --quantization and --threads."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model directory (default: build the Qwen2.5-0.5B-shaped one)")
    parser.add_argument("--cache", default=str(BENCH_MODEL_CACHE),
                        help="where the built benchmark model is kept (default: %(default)s)")
    parser.add_argument("--quantization", default="f16", choices=quantizations)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    return parser


def script_model(args: argparse.Namespace) -> Path:
    """Sets torch's thread count and returns the model directory to run on (building
    the benchmark model the first time)."""
    import torch

    from ruvllm_cli.testing.tiny_model import cached_tiny_model

    torch.set_num_threads(args.threads)
    return Path(args.model) if args.model else cached_tiny_model(Path(args.cache), bench=True)
