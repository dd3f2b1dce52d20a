#!/usr/bin/env python
"""Scheduling policies under overload, through `ruvllm serve` as users run it.

200 long low-priority requests (48 tokens) and 50 short high-priority ones (8
tokens), all sent at once (the low ones first), streamed, against the tiny model with
a KV cache of 60% of what a 16-request batch needs (preemption is forced).
`--prompt-words` lengthens the prompt, which makes recompute cost more.
For fcfs and priority, each with recompute and swap, and a run with room for every
request (no preemption) as the baseline: p95 TTFT of both classes, their ratio, the
wall time and what preemption cost beside the baseline, and the preemptions.

    .venv/bin/python scripts/bench_priority.py [--model DIR] [--prompt-words 120]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from ruvllm_cli.bench.overload import HIGH, LOW, run_overload  # noqa: E402
from ruvllm_cli.registry.memory import estimate_kv_bytes_per_token, kv_dtype_bytes  # noqa: E402
from ruvllm_cli.registry.model_config import read_model_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = [("fcfs", "recompute", False), ("fcfs", "recompute", True), ("fcfs", "swap", True),
           ("priority", "recompute", True), ("priority", "swap", True)]
LOW_TOKENS = 48


def block_bytes(model: Path) -> int:
    """One 16-token KV block of `model` in float32 (-q none)."""
    return 16 * estimate_kv_bytes_per_token(read_model_config(model), kv_dtype_bytes("none"))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def serve(model: Path, policy: str, mode: str, blocks: int | None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "ruvllm_cli", "serve", str(model), "--port", str(port), "-q", "none",
               "--device", "cpu", "--served-model-name", "tiny", "--max-queue", "300", "--max-concurrent", "16",
               "--scheduling-policy", policy, "--preemption-mode", mode, "--max-context", "512"]
    if blocks is not None:
        command += ["--kv-cache-memory", str(blocks * block_bytes(model)), "--swap-space",
                    str(256 * block_bytes(model))]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(process.communicate()[1])
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    process.kill()
    raise SystemExit("the server did not start")


def preemptions(url: str) -> str:
    found = re.findall(r'ruvllm_preemptions_total\{mode="(\w+)",priority="(-?\d+)"\} ([\d.]+)',
                       httpx.get(url + "/metrics").text)
    return ", ".join(f"{int(float(n))} {mode} (priority {p})" for mode, p, n in found) or "none"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="a model directory (default: the tests' tiny model)")
    parser.add_argument("--prompt-words", type=int, default=8, help="words in every prompt")
    args = parser.parse_args()
    prompt = " ".join(["lighthouse", "keeper", "story", "sea"] * (args.prompt_words // 4 + 1))
    if args.model is None:
        from ruvllm_cli.testing.tiny_model import cached_tiny_model

        args.model = cached_tiny_model(Path(os.environ.get("TMPDIR", "/tmp")) / "ruvllm-bench-models")
    baseline, prompt_tokens = None, 0
    print("| policy | preemption | KV blocks | high p95 TTFT s | low p95 TTFT s | high / low | wall s | "
          "lost to preemption | preemptions |")
    print("|---|---|---|---|---|---|---|---|---|")
    for policy, mode, scarce in CONFIGS:
        blocks = None
        if scarce:   # 60% of 16 requests' blocks, measured on the first request's prompt
            blocks = int(0.6 * 16 * -(-(prompt_tokens + LOW_TOKENS) // 16))
        process, url = serve(args.model, policy, mode, blocks)
        try:
            if not scarce:
                prompt_tokens = httpx.post(url + "/v1/completions", json={
                    "model": "tiny", "prompt": prompt, "max_tokens": 1}).json()["usage"]["prompt_tokens"]
            result = asyncio.run(run_overload(url, "tiny", prompt=prompt, low_tokens=LOW_TOKENS))
            counted = preemptions(url)
        finally:
            process.send_signal(signal.SIGTERM)
            process.communicate(timeout=30)
        if result.failures:
            print(f"{policy}/{mode}: {len(result.failures)} requests failed: {result.failures[0]}", file=sys.stderr)
            return 1
        baseline = result.wall if blocks is None else baseline
        lost = "-" if blocks is None else f"{result.wall - baseline:+.1f} s"
        high, low = result.p95(HIGH), result.p95(LOW)
        print(f"| {policy} | {mode} | {blocks or 'all'} | {high:.2f} | {low:.2f} | {high / low:.2f} | "
              f"{result.wall:.1f} | {lost} | {counted} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
