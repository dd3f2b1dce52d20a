#!/usr/bin/env python
"""What `serve --replicas` costs and gives, against the single-process server, on real
`ruvllm serve` processes (docs/design.md section 16):

1. latency added per request: the same sequential streamed requests against `serve
   MODEL` and `serve MODEL --replicas 1 --threads-per-replica T` (T torch threads
   both, --threads; OMP_NUM_THREADS for the single process);
   medians of TTFT, inter-token latency and end-to-end time, and their differences;
2. start-up: seconds from launch until /health answers 200, for both and for
   `--replicas 2`;
3. routing: with `--replicas 2`, 4 long shared prefixes asked in turn: the share of
   requests after the first of each prefix with >= 90% of the prompt cached, and the
   router's own decisions from /health.

Run it on a quiet machine; JSON on stdout, progress on stderr:

    .venv/bin/python scripts/make_tiny_model.py --out models/bench --bench
    .venv/bin/python scripts/bench_replicas.py models/bench -q none --requests 40
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """`ruvllm serve MODEL *extra` on a free port, until `stop`."""

    def __init__(self, args: argparse.Namespace, *extra: str) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        command = [sys.executable, "-m", "ruvllm_cli", "serve", args.model, "--port", self.url.rsplit(":", 1)[1],
                   "-q", args.quantization, "--served-model-name", "bench", "--max-context", "4096", *extra]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               # The same torch threads on both sides: the single process reads it at start,
               # a replica gets --threads-per-replica (and Ray sets it to the replica's CPUs).
               "OMP_NUM_THREADS": str(args.threads)}
        started = time.monotonic()
        self.process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                        text=True)
        self.healthy_after = self._wait_healthy(started)

    def _wait_healthy(self, started: float) -> float:
        while time.monotonic() - started < 600:
            if self.process.poll() is not None:
                sys.exit(f"the server exited: {self.process.communicate()[1]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.monotonic() - started
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        sys.exit("the server never became healthy")

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.communicate(timeout=120)


def timed_request(url: str, prompt: list[int], new_tokens: int) -> dict[str, float]:
    """One streamed completion: TTFT, mean inter-token latency and end-to-end, in ms."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    start = time.perf_counter()
    stamps = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                stamps.append(time.perf_counter())
    end = time.perf_counter()
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"ttft_ms": (stamps[0] - start) * 1e3, "itl_ms": statistics.mean(gaps) * 1e3 if gaps else 0.0,
            "e2e_ms": (end - start) * 1e3}


def latency(server: Server, args: argparse.Namespace) -> dict[str, float]:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 400) for _ in range(args.prompt_tokens)] for _ in range(args.requests + 3)]
    runs = [timed_request(server.url, p, args.new_tokens) for p in prompts]
    runs = runs[3:]   # warm-up
    return {key: round(statistics.median(r[key] for r in runs), 2) for key in runs[0]}


def routing(server: Server, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(1)
    prefixes = [[rng.randrange(3, 400) for _ in range(args.prefix_tokens)] for _ in range(4)]
    hits = later = 0
    for turn in range(args.turns):
        for prefix in prefixes:
            prompt = prefix + [rng.randrange(3, 400) for _ in range(16)]
            body = {"model": "bench", "prompt": prompt, "max_tokens": 2}
            usage = httpx.post(server.url + "/v1/completions", json=body, timeout=300).json()["usage"]
            if turn:
                later += 1
                hits += usage["prompt_tokens_details"]["cached_tokens"] >= 0.9 * usage["prompt_tokens"]
    return {"requests_after_first": later, "with_90pct_cached": hits, "hit_rate": round(hits / later, 3),
            "router": httpx.get(server.url + "/health").json()["routing"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("-q", "--quantization", default="none")
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prefix-tokens", type=int, default=1024)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads of each engine")
    args = parser.parse_args()
    report: dict[str, Any] = {}
    for name, extra in (("single", ()), ("replicas_1", ("--replicas", "1", "--threads-per-replica", str(args.threads)))):
        print(f"{name}: starting", file=sys.stderr)
        server = Server(args, *extra)
        report[name] = {"healthy_after_s": round(server.healthy_after, 1), **latency(server, args)}
        server.stop()
        print(f"{name}: {report[name]}", file=sys.stderr)
    report["added_ms"] = {k: round(report["replicas_1"][k] - report["single"][k], 2)
                          for k in ("ttft_ms", "itl_ms", "e2e_ms")}
    server = Server(args, "--replicas", "2", "--threads-per-replica", str(max(1, args.threads // 2)))
    report["replicas_2"] = {"healthy_after_s": round(server.healthy_after, 1), **routing(server, args)}
    server.stop()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
