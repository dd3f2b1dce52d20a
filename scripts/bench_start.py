"""How long `ruvllm chat` takes to start, as a user meets it: in a real pseudo-terminal,
the time from launching the process to its prompt ("You>"), and from sending a first
message to the reply's statistics line (`--max-tokens 1`: the template, the prompt's prefill and one
token); and the whole of a piped run (`echo hi | ruvllm chat MODEL --max-tokens 1`),
process start to exit. Caches primed first (one discarded run per quantization: the
weight cache and the checked tokenizer beside the model), so these are cached starts.

With --both-tokenizers each measurement runs twice, alternating: ruvllm's checked
tokenizer (engine/tokenizer.py) and transformers' (RUVLLM_OWN_TOKENIZER=0), so the
difference is measured inside one run (the machine's speed moves between runs).

    .venv/bin/python scripts/bench_start.py --model models/bench --quantizations q8,q4k,f16 --rounds 3
    .venv/bin/python scripts/bench_start.py --model models/bench --both-tokenizers --format json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PROMPT = "You>"
STATS = r"\d+ tokens? · TTFT"   # the line under a reply
VARIANTS = {"ruvllm": {}, "transformers": {"RUVLLM_OWN_TOKENIZER": "0"}}


def interactive(model: Path, quantization: str, env: dict[str, str], timeout: float) -> tuple[float, float]:
    """(seconds to the prompt, seconds from sending "hi" to the next prompt)."""
    import pexpect

    argv = ["-m", "ruvllm_cli", "chat", str(model), "-q", quantization, "--max-tokens", "1"]
    started = time.perf_counter()
    child = pexpect.spawn(sys.executable, argv, env=env, encoding="utf-8", codec_errors="replace",
                          dimensions=(24, 100), timeout=timeout)
    try:
        child.expect_exact(PROMPT)
        to_prompt = time.perf_counter() - started
        sent = time.perf_counter()
        child.sendline("hi")
        child.expect(STATS)
        reply = time.perf_counter() - sent
        child.expect_exact(PROMPT)
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    return to_prompt, reply


def piped(model: Path, quantization: str, env: dict[str, str], timeout: float) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "ruvllm_cli", "chat", str(model), "-q", quantization, "--max-tokens", "1"],
                   input="hi\n", capture_output=True, text=True, env=env, timeout=timeout, check=True)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--model", type=Path, default=Path("models/bench"))
    parser.add_argument("--quantizations", default="q8,q4k,f16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--both-tokenizers", action="store_true",
                        help="also measure with transformers' tokenizer (RUVLLM_OWN_TOKENIZER=0), alternating")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--format", choices=("table", "json"), default="table")
    args = parser.parse_args()
    base = {**os.environ, "TERM": "xterm", "PROMPT_TOOLKIT_NO_CPR": "1", "RUVLLM_WEIGHT_CACHE": "1"}
    variants = list(VARIANTS) if args.both_tokenizers else ["ruvllm"]
    results: dict[tuple[str, str], dict[str, list[float]]] = {}
    for quantization in args.quantizations.split(","):
        piped(args.model, quantization, base, args.timeout)   # primes the caches
        for _ in range(args.rounds):
            for variant in variants:
                env = {**base, **VARIANTS[variant]}
                to_prompt, reply = interactive(args.model, quantization, env, args.timeout)
                whole = piped(args.model, quantization, env, args.timeout)
                row = results.setdefault((quantization, variant), {"to_prompt_s": [], "first_reply_s": [],
                                                                   "piped_run_s": []})
                row["to_prompt_s"].append(to_prompt)
                row["first_reply_s"].append(reply)
                row["piped_run_s"].append(whole)
                print(f"{quantization} {variant}: prompt {to_prompt:.2f} s, reply {reply:.2f} s, piped {whole:.2f} s",
                      file=sys.stderr)
    rows = [{"quantization": q, "tokenizer": v, **{k: statistics.median(x) for k, x in r.items()},
             "runs": {k: [round(s, 3) for s in x] for k, x in r.items()}} for (q, v), r in results.items()]
    if args.format == "json":
        print(json.dumps({"model": str(args.model), "rounds": args.rounds, "rows": rows}, indent=2))
        return
    print(f"{args.model} · cached starts · medians of {args.rounds} · seconds")
    print(f"{'quant':6} {'tokenizer':12} {'to the prompt':>14} {'first reply':>12} {'piped run':>10}")
    for row in rows:
        print(f"{row['quantization']:6} {row['tokenizer']:12} {row['to_prompt_s']:14.2f} {row['first_reply_s']:12.2f} "
              f"{row['piped_run_s']:10.2f}")


if __name__ == "__main__":
    main()
