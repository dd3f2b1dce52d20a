#!/usr/bin/env python
"""Serve model directories through the fake Hugging Face hub until Ctrl-C.

    .venv/bin/python scripts/fake_hub.py --port 8765 --model-dir tiny-models/tiny --repo Qwen/Qwen2.5-0.5B-Instruct
    .venv/bin/python scripts/fake_hub.py --repo org/tiny      # builds a tiny model to serve

Then, in another shell, run the printed `export HF_ENDPOINT=...` line and use ruvllm
or huggingface_hub as usual. `--model-dir` and `--repo` pair up in order; a `--repo`
without a `--model-dir` serves a freshly built tiny model.
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ruvllm_cli.testing.fake_hub import FakeHub  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (default: any free one)")
    parser.add_argument("--model-dir", action="append", default=[], type=Path, help="model directory to serve")
    parser.add_argument("--repo", action="append", default=[], help="repo id ORG/NAME to serve it as")
    parser.add_argument("--revision", default="main", help="branch to commit to (default main)")
    args = parser.parse_args(argv)
    if len(args.model_dir) > len(args.repo):
        parser.error("every --model-dir needs a --repo")
    return args


def _stop_on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    with tempfile.TemporaryDirectory(prefix="fake-hub-") as scratch, FakeHub(args.port) as hub:
        for index, repo_id in enumerate(args.repo):
            if index < len(args.model_dir):
                model_dir = args.model_dir[index]
            else:
                from ruvllm_cli.testing.tiny_model import build_tiny_model

                model_dir = build_tiny_model(Path(scratch) / str(index))
            sha = hub.add_model_dir(repo_id, model_dir, args.revision)
            print(f"serving {repo_id}@{args.revision} ({sha}) from {model_dir}", file=sys.stderr)
        print(f"export HF_ENDPOINT={hub.url}", flush=True)
        print("Ctrl-C to stop", file=sys.stderr)
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
