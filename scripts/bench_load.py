#!/usr/bin/env python
"""Peak memory and time of loading a model, per quantization, each load in a fresh
process: the streamed loader (engine/stream_load.py) quantizing, the same from the
quantized-weight cache (q8/q4k; primed first: it writes into the model's directory),
transformers' path (RUVLLM_STREAM_LOAD=0), and llama.cpp's `llama-bench` on the same weights in GGUF
when --llamacpp DIR is given (a directory where ../shared/tools/llamacpp.sh built
its tools and converted the model: llbuild/bin/llama-bench, f16/Q8_0/Q4_K_M.gguf).

With --llamacpp, GGUF rows follow: each file of --gguf loaded as it loads without -q
(Q8_0 as q8, Q4_K_M as q4k, f16 as none; any other NAME.gguf in DIR, such as one
llama-quantize made, by its weights' types), tensor by tensor (engine/gguf_load.py) and
through transformers' GGUF path (which dequantizes the whole file), beside llama-bench
on the same file; --gguf-only skips the safetensors rows.

Peak is the process's VmHWM (resident high-water mark: anonymous memory and the
file pages it mapped), after `import torch` and after the load; "cached, stock
classes" reads the same cache into transformers' model classes (RUVLLM_NATIVE=0),
whose import the Llama family's own classes (engine/native.py) leave out;
llama.cpp's is GNU time's maximum resident size of a whole `llama-bench -p 0 -n 16`
run. Ratios are taken inside one run of this script.

    .venv/bin/python scripts/bench_load.py [--model DIR] [--quantizations none,f16,q8,q4k]
    .venv/bin/python scripts/bench_load.py --llamacpp ~/.cache/llamacpp --format json
    .venv/bin/python scripts/bench_load.py --llamacpp ~/.cache/llamacpp --gguf-only [--gguf Q8_0,Q4_K_M,f16]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ruvllm_cli.bench.harness import script_model, script_parser  # noqa: E402
from ruvllm_cli.engine.gguf_check import check_gguf  # noqa: E402
from ruvllm_cli.engine.gguf_plan import file_quantization  # noqa: E402

GGUF_NAME = {"f16": "f16.gguf", "q8": "Q8_0.gguf", "q4k": "Q4_K_M.gguf"}
GGUF_LOADS_AS = {"Q8_0": "q8", "Q4_K_M": "q4k", "f16": "none"}  # each file's own default (no -q)

CHILD = r"""
import json, sys, time
from pathlib import Path

def status():
    return {k: int(v.split()[0]) // 1024 for k, v in
            (line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
            if k in ("VmHWM", "VmRSS", "RssAnon", "RssFile")}

import atexit, gc
atexit.register(gc.freeze)   # the exit `ruvllm` has (cli/main.py: the teardown's collections skipped)
started = time.perf_counter()
import torch  # noqa: F401
imported = status()
import_s = time.perf_counter() - started
torch.set_num_threads(int(sys.argv[3]))
from ruvllm_cli.engine.loader import load_model
from ruvllm_cli.quantization import parse_quantization
loaded = load_model(sys.argv[1], "cpu", parse_quantization(sys.argv[2]))
after = status()
print(json.dumps({"import_mib": imported["VmHWM"], "import_s": import_s, "peak_mib": after["VmHWM"],
                  "rss_after_mib": after["VmRSS"], "anon_after_mib": after["RssAnon"],
                  "weights_mib": loaded.weight_bytes / 2**20, "load_s": loaded.load_seconds,
                  "streamed": loaded.streamed, "from_cache": loaded.from_weight_cache,
                  "path": loaded.quantization_path}))
"""


MODES = {"streamed": {"RUVLLM_STREAM_LOAD": "1", "RUVLLM_WEIGHT_CACHE": "0"},
         "transformers": {"RUVLLM_STREAM_LOAD": "0", "RUVLLM_WEIGHT_CACHE": "0"},
         "cached": {"RUVLLM_STREAM_LOAD": "1", "RUVLLM_WEIGHT_CACHE": "1"},
         # the same cache read into transformers' model classes (engine/native.py off)
         "cached_stock": {"RUVLLM_STREAM_LOAD": "1", "RUVLLM_WEIGHT_CACHE": "1", "RUVLLM_NATIVE": "0"}}


def ruvllm_load(model: Path, quantization: str, mode: str, threads: int) -> dict[str, Any] | None:
    if mode.startswith("cached"):
        if quantization not in ("q8", "q4k"):
            return None
        first = _child(model, quantization, mode, threads)
        if first["from_cache"]:
            return first
    return _child(model, quantization, mode, threads)


def _child(model: Path, quantization: str, mode: str, threads: int) -> dict[str, Any]:
    env = dict(os.environ, **MODES[mode])
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", CHILD, str(model), quantization, str(threads)],
                          capture_output=True, text=True, env=env, check=False)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"loading {quantization} failed:\n{done.stderr[-2000:]}")
    # run_s: the whole process, interpreter start to exit, as llama-bench's run is timed
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "run_s": wall}


def llamacpp_load(tools: Path, quantization: str, threads: int) -> dict[str, Any] | None:
    """GNU time's peak RSS of a short llama-bench run (load, 16 generated tokens)."""
    return llamacpp_run(tools, tools / GGUF_NAME.get(quantization, "-"), threads)


def llamacpp_run(tools: Path, gguf: Path, threads: int) -> dict[str, Any] | None:
    bench = tools / "llbuild" / "bin" / "llama-bench"
    if not gguf.is_file() or not bench.is_file():
        return None
    started = time.perf_counter()
    done = subprocess.run(["/usr/bin/time", "-f", "%M", str(bench), "-m", str(gguf), "-p", "0", "-n", "16",
                           "-r", "1", "-t", str(threads)], capture_output=True, text=True, check=False)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        return None
    return {"peak_mib": int(done.stderr.strip().splitlines()[-1]) / 1024, "run_s": wall, "gguf": gguf.name}


def gguf_rows(tools: Path, names: list[str], threads: int) -> list[dict[str, Any]]:
    """Each GGUF file loaded as it loads without -q: tensor by tensor, through
    transformers, and by llama-bench."""
    rows = []
    for name in names:
        path = tools / f"{name}.gguf"
        if not path.is_file():
            raise SystemExit(f"{path}: no such GGUF file (llamacpp.sh converts f16, Q8_0 and Q4_K_M; "
                             "llbuild/bin/llama-quantize makes others from f16.gguf)")
        quantization = GGUF_LOADS_AS.get(name) or file_quantization(check_gguf(path)).value
        rows.append({"gguf": path.name, "quantization": quantization,
                     "streamed": _child(path, quantization, "streamed", threads),
                     "cached": ruvllm_load(path, quantization, "cached", threads),
                     "transformers": _child(path, quantization, "transformers", threads),
                     "llamacpp": llamacpp_run(tools, path, threads)})
    return rows


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--quantizations", default="none,f16,q8,q4k")
    parser.add_argument("--llamacpp", type=Path, help="llamacpp.sh's WORKDIR (tools and GGUF files)")
    parser.add_argument("--gguf", default="Q8_0,Q4_K_M", help="GGUF files of --llamacpp to load (Q8_0,Q4_K_M,f16)")
    parser.add_argument("--gguf-only", action="store_true", help="only the GGUF rows")
    parser.add_argument("--format", choices=["table", "json"], default="table")
    args = parser.parse_args()
    if args.gguf_only and not args.llamacpp:
        parser.error("--gguf-only needs --llamacpp DIR")
    model = None if args.gguf_only else script_model(args)
    rows = [] if model is None else [
        {"quantization": quantization,
         **{mode: ruvllm_load(model, quantization, mode, args.threads) for mode in MODES},
         "llamacpp": llamacpp_load(args.llamacpp, quantization, args.threads) if args.llamacpp else None}
        for quantization in args.quantizations.split(",")]
    ggufs = gguf_rows(args.llamacpp, args.gguf.split(","), args.threads) if args.llamacpp else []
    if args.format == "json":
        print(json.dumps({"model": str(model), "threads": args.threads, "rows": rows, "gguf_rows": ggufs},
                         indent=2))
        return
    if model is not None:
        print_rows(model, rows, args.threads)
    if ggufs:
        print_gguf_rows(args.llamacpp, ggufs, args.threads)


def print_gguf_rows(tools: Path, rows: list[dict[str, Any]], threads: int) -> None:
    print(f"{tools} · GGUF files · {threads} threads · MiB of peak resident memory (VmHWM)")
    print("file          quant  weights  peak: tensor by tensor / cached / transformers' path  llama.cpp  "
          "ours (cached) / llama.cpp  run s: tensor by tensor / cached / transformers  llama.cpp  cached/llama.cpp")
    for row in rows:
        s, c, t, ll = row["streamed"], row["cached"], row["transformers"], row["llamacpp"]
        print(f"{row['gguf']:12s}  {row['quantization']:5s}  {s['weights_mib']:7.0f}  "
              f"{s['peak_mib']:21d} / {_cell(c, 'peak_mib', '6d')} / {t['peak_mib']:6d}  "
              f"{_cell(ll, 'peak_mib', '9.0f')}  {_ratio(s, ll, 'peak_mib', 6)} ({_ratio(c, ll, 'peak_mib', 5)})  "
              f"{s['run_s']:22.1f} / {_cell(c, 'run_s', '6.1f')} / {t['run_s']:5.1f}  {_cell(ll, 'run_s', '9.1f')}  "
              f"{_ratio(c, ll, 'run_s', 15)}")
        for mode, load in (("tensor by tensor", s), ("transformers", t)):
            print(f"       {mode}: {load['path']}")


def print_rows(model: Path, rows: list[dict[str, Any]], threads: int) -> None:
    print(f"{model} · {threads} threads · MiB of peak resident memory (VmHWM) · run s: a whole process, "
          f"start to exit (llama.cpp: llama-bench -p 0 -n 16)")
    print("quant  import  weights  peak: streamed / cached / cached, stock classes / transformers' path  "
          "llama.cpp  streamed/llama.cpp  cached/llama.cpp  run s: streamed / cached / cached, stock classes / "
          "transformers  llama.cpp  cached/llama.cpp")
    for row in rows:
        s, c, k, t, ll = (row[name] for name in ("streamed", "cached", "cached_stock", "transformers", "llamacpp"))
        print(f"{row['quantization']:5s}  {s['import_mib']:6d}  {s['weights_mib']:7.0f}  "
              f"{s['peak_mib']:14d} / {_cell(c, 'peak_mib', '6d')} / {_cell(k, 'peak_mib', '21d')} / "
              f"{t['peak_mib']:6d}  {_cell(ll, 'peak_mib', '9.0f')}  {_ratio(s, ll, 'peak_mib', 17)}  "
              f"{_ratio(c, ll, 'peak_mib', 15)}  {s['run_s']:14.1f} / {_cell(c, 'run_s', '6.1f')} / "
              f"{_cell(k, 'run_s', '21.1f')} / {t['run_s']:5.1f}  {_cell(ll, 'run_s', '9.1f')}  "
              f"{_ratio(c, ll, 'run_s', 15)}")
        if not s["streamed"]:
            print(f"       (not streamed: {s['path']})")


def _cell(row: dict[str, Any] | None, key: str, spec: str) -> str:
    width = int("".join(ch for ch in spec.split(".")[0] if ch.isdigit()) or 0)
    return format(row[key], spec) if row else f"{'n/a':>{width}s}"


def _ratio(ours: dict[str, Any] | None, theirs: dict[str, Any] | None, key: str, width: int) -> str:
    return f"{ours[key] / theirs[key]:{width}.2f}x" if ours and theirs else f"{'n/a':>{width + 1}s}"

if __name__ == "__main__":
    main()
