#!/usr/bin/env python
"""ruvllm beside llama.cpp on the same model, in one run, as ratios.

For each quantization, `ruvllm benchmark --format json` (a fresh process per
figure) and llama.cpp's `llama-bench` / `llama-batched-bench` on the same weights
converted to GGUF (f16 <-> F16, q8 <-> Q8_0, q4k <-> Q4_K_M), same thread count:
  batch-1 decode    128-token prompt, 128 new tokens   (llama-bench -p 128 -n 128: tg128)
  prefill           a 512-token prompt's tokens per second, 4 new (llama-bench pp512; --prefill-length),
                    and TTFT: with f16 and q4k both run, q4k's TTFT / f16's
  16 streams        aggregate decode, 128 + 128 each    (llama-batched-bench -npl 16: S_TG)
  deep decode       after a 3,000-token prompt, 64 new  (llama-bench -d 3000 -n 64)
  peak RSS          ruvllm benchmark's peak_rss_mb at batch 1 against GNU time's %M of
                    the llama-bench run
Ratios are ruvllm / llama.cpp (above 1: ruvllm faster, or for RSS, larger).

llama.cpp's tools are not a dependency: `../shared/tools/llamacpp.sh WORKDIR MODEL_DIR`
builds them from source and converts the model (f16.gguf, Q8_0.gguf, Q4_K_M.gguf in
WORKDIR); pass WORKDIR as --llamacpp.

`--isa avx2` measures an AVX2 laptop's paths on an AVX-512 machine: ruvllm runs with
torch, oneDNN, MKL and its own kernels capped at AVX2 (ATEN_CPU_CAPABILITY,
ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS, RUVLLM_MAX_CPU_ISA); give it a llama.cpp
built the same way (cmake -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
-DGGML_AVX512=OFF, its llbuild/ and the GGUF files in the --llamacpp directory). On a
CPU with AVX-512 VNNI, torch's int8 GEMM (`_int_mm`, q8 past 32 rows) returns wrong sums
under that capping: q8's prefill figure there is not an AVX2 laptop's (design section 20).

    .venv/bin/python scripts/bench_peers.py --llamacpp ~/.cache/llamacpp [--model DIR]
        [--quantizations f16,q8,q4k] [--figures decode,prefill,streams,deep] [--isa avx2] [--format json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ruvllm_cli.bench.harness import BENCH_MODEL_CACHE  # noqa: E402

GGUF = {"f16": "f16.gguf", "q8": "Q8_0.gguf", "q4k": "Q4_K_M.gguf"}
AVX2_ONLY = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
             "RUVLLM_MAX_CPU_ISA": "avx2"}
FIGURES = ("decode", "prefill", "streams", "deep")
REPO = Path(__file__).resolve().parents[1]


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def ruvllm(model: Path, quantization: str, threads: int, args: argparse.Namespace, *,
           prompt: int, gen: int, concurrency: int = 1) -> dict[str, Any]:
    """One `ruvllm benchmark` run's metrics and system block."""
    command = [sys.executable, "-m", "ruvllm_cli", "benchmark", str(model), "-q", quantization, "--format", "json",
               "--prompt-length", str(prompt), "--gen-length", str(gen), "--concurrency", str(concurrency),
               "--warmup", str(args.warmup), "-i", str(args.iterations), "--device", "cpu"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads),   # torch's intra-op threads
           **(AVX2_ONLY if args.isa == "avx2" else {})}
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=env, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"bench_peers: ruvllm benchmark failed: {done.stderr.strip().splitlines()[-1:]}")
    result = json.loads(done.stdout)
    return {"metrics": result["metrics"], "system": result["system"]}


def llama_bench(tools: Path, gguf: Path, threads: int, *extra: str) -> tuple[dict[str, float], int]:
    """llama-bench's tokens/s per test ("pp128", "tg128", "tg64@d3000") and its peak RSS in MB."""
    command = ["/usr/bin/time", "-f", "%M", str(tools / "llama-bench"), "-m", str(gguf), "-t", str(threads),
               "-o", "json", *extra]
    done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"bench_peers: llama-bench failed: {done.stderr.strip().splitlines()[-2:]}")
    rates: dict[str, float] = {}
    for row in json.loads(done.stdout):
        name = f"pp{row['n_prompt']}" if row["n_gen"] == 0 else f"tg{row['n_gen']}"
        if row.get("n_depth"):
            name += f"@d{row['n_depth']}"
        rates[name] = float(row["avg_ts"])
    peak_kb = int(done.stderr.strip().splitlines()[-1])
    return rates, peak_kb // 1024


def batched_bench(tools: Path, gguf: Path, threads: int, streams: int, prompt: int, gen: int) -> float:
    """llama-batched-bench's aggregate generation speed (S_TG) for `streams` sequences."""
    command = [str(tools / "llama-batched-bench"), "-m", str(gguf), "-t", str(threads), "-c",
               str(streams * (prompt + gen) + 16), "-b", "2048", "-ub", "512", "-npp", str(prompt), "-ntg",
               str(gen), "-npl", str(streams), "--output-format", "jsonl"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not rows:
        raise SystemExit(f"bench_peers: llama-batched-bench failed: {done.stderr.strip().splitlines()[-2:]}")
    return float(rows[-1]["speed_tg"])


def measure(quantization: str, args: argparse.Namespace) -> dict[str, Any]:
    gguf = args.llamacpp / GGUF[quantization]
    tools = args.llamacpp / "llbuild" / "bin"
    row: dict[str, Any] = {"quantization": quantization, "gguf": gguf.name}
    if "decode" in args.figures:
        log(f"{quantization}: batch 1, 128 + 128")
        ours = ruvllm(args.model, quantization, args.threads, args, prompt=128, gen=128)
        rates, peak = llama_bench(tools, gguf, args.threads, "-p", "0", "-n", "128", "-r", str(args.iterations))
        row["path"] = ours["system"]["quantization_path"]
        row["decode"] = (ours["metrics"]["decode_tokens_per_s"], rates["tg128"])
        row["peak_rss_mb"] = (ours["metrics"]["peak_rss_mb"], peak)
    if "prefill" in args.figures:
        length = args.prefill_length
        log(f"{quantization}: a {length}-token prompt")
        ours = ruvllm(args.model, quantization, args.threads, args, prompt=length, gen=4)
        rates, _ = llama_bench(tools, gguf, args.threads, "-p", str(length), "-n", "0", "-r", str(args.iterations))
        row["path"] = ours["system"]["quantization_path"]
        row["prefill"] = (ours["metrics"]["prefill_tokens_per_s"], rates[f"pp{length}"])
        row["ttft_ms"] = ours["metrics"]["ttft_ms_p50"]
    if "streams" in args.figures:
        log(f"{quantization}: {args.streams} streams")
        ours = ruvllm(args.model, quantization, args.threads, args, prompt=128, gen=128, concurrency=args.streams)
        row["path"] = ours["system"]["quantization_path"]
        row["streams"] = (ours["metrics"]["decode_tokens_per_s"] * args.streams,
                          batched_bench(tools, gguf, args.threads, args.streams, 128, 128))
    if "deep" in args.figures:
        log(f"{quantization}: decode after {args.depth} tokens")
        ours = ruvllm(args.model, quantization, args.threads, args, prompt=args.depth, gen=64)
        row["path"] = ours["system"]["quantization_path"]
        rates, _ = llama_bench(tools, gguf, args.threads, "-p", "0", "-n", "64", "-d", str(args.depth),
                               "-r", str(args.iterations))
        row["deep"] = (ours["metrics"]["decode_tokens_per_s"], rates[f"tg64@d{args.depth}"])
    return row


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    labels = {"decode": "batch-1 decode tok/s", "prefill": f"prefill tok/s ({args.prefill_length})",
              "streams": f"{args.streams} streams decode tok/s", "deep": f"decode tok/s after {args.depth}",
              "peak_rss_mb": "peak RSS MB"}
    capped = "; ruvllm capped at AVX2 (--isa avx2)" if args.isa == "avx2" else ""
    print(f"threads {args.threads}; ratio = ruvllm / llama.cpp{capped}")
    for row in rows:
        print(f"\n{row['quantization']} (llama.cpp {row['gguf']}; ruvllm: {row.get('path', '?')})")
        for key, label in labels.items():
            if key in row:
                ours, theirs = row[key]
                print(f"  {label:28s} ruvllm {ours:9.1f}   llama.cpp {theirs:9.1f}   ratio {ours / theirs:5.2f}x")
    ttft = {row["quantization"]: row["ttft_ms"] for row in rows if "ttft_ms" in row}
    if "f16" in ttft and "q4k" in ttft:
        print(f"\nTTFT of a {args.prefill_length}-token prompt: q4k {ttft['q4k']:.0f} ms / f16 {ttft['f16']:.0f} ms"
              f" = {ttft['q4k'] / ttft['f16']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llamacpp", type=Path, required=True, help="llamacpp.sh's WORKDIR (tools and GGUF files)")
    parser.add_argument("--model", type=Path, help="the HF model directory the GGUF files were converted from "
                        "(default: the Qwen2.5-0.5B-shaped benchmark model)")
    parser.add_argument("--quantizations", default="f16,q8,q4k")
    parser.add_argument("--figures", default=",".join(FIGURES))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--depth", type=int, default=3000)
    parser.add_argument("--prefill-length", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--isa", choices=["native", "avx2"], default="native",
                        help="avx2: ruvllm's torch, oneDNN, MKL and kernels capped at AVX2 (an AVX2 laptop's paths)")
    parser.add_argument("--format", choices=["table", "json"], default="table")
    args = parser.parse_args()
    args.figures = set(args.figures.split(","))
    if not (args.llamacpp / "llbuild" / "bin" / "llama-bench").is_file():
        raise SystemExit(f"bench_peers: no llama-bench in {args.llamacpp}/llbuild/bin: build it with "
                         f"../shared/tools/llamacpp.sh {args.llamacpp} MODEL_DIR")
    if args.model is None:
        from ruvllm_cli.testing.tiny_model import cached_tiny_model
        args.model = cached_tiny_model(BENCH_MODEL_CACHE, bench=True)
    rows = [measure(q, args) for q in args.quantizations.split(",")]
    if args.format == "json":
        print(json.dumps(rows, indent=2))
    else:
        report(rows, args)


if __name__ == "__main__":
    main()
