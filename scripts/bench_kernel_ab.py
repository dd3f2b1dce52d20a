#!/usr/bin/env python
"""One of our C kernels against its own source at another git revision, in one process.

Both sources (the kernel's .c file and common.h: the working tree's, and the ones at
--against) are built with the flags the loader uses, the same random layers run through
both libraries, their outputs are compared bit for bit, and the calls alternate, each
round both sides of every case (this machine's speed drifts between runs by up to 30%,
not within a round: docs/design.md, section 23, found a kernel change this way), the
side that goes first swapping every round, and 256 MiB written before each call so that
neither side finds the other's weights in the CPU's caches, as a decode step does not
(--warm leaves them: a layer called over and over). Prints
the median ms a call of each side and new / old; exits 1 where the outputs differ,
unless --allow-different (a change meant to move the results).

    .venv/bin/python scripts/bench_kernel_ab.py --kernel int4 --against HEAD~1
    .venv/bin/python scripts/bench_kernel_ab.py --kernel f16 --rows 1,16,512 --rounds 12
    .venv/bin/python scripts/bench_kernel_ab.py --kernel q8 --shapes 4864x896 --format json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from ruvllm_cli.engine import kernels  # noqa: E402

KERNEL_DIR = "ruvllm_cli/engine/kernels"
EVICT_BYTES = 256 << 20   # written before each call: past any CPU's last-level cache


def kernel_for(kind: str) -> kernels.Build | None:
    """How the loader built the kernel behind `kind` on this CPU (int4: the one for the
    layout torch packs in), or None where it builds none."""
    from ruvllm_cli.engine.int4_dense import own_kernel

    loaded = {"f16": kernels.half_kernel, "q8": kernels.int8_kernel, "int4": own_kernel}[kind]()
    return None if loaded is None else loaded.build


def sources(revision: str | None, name: str) -> tuple[bytes, bytes]:
    """The kernel's source and common.h at `revision` (None: the working tree)."""
    def read(path: str) -> bytes:
        if revision is None:
            return (REPO / path).read_bytes()
        done = subprocess.run(["git", "show", f"{revision}:{path}"], cwd=REPO, capture_output=True)
        if done.returncode != 0:
            raise SystemExit(f"bench_kernel_ab: no {path} at {revision}: "
                             f"{done.stderr.decode(errors='replace').strip()}")
        return done.stdout

    return read(f"{KERNEL_DIR}/{name}.c"), read(f"{KERNEL_DIR}/{kernels.HEADER}")


def built(kernel: kernels.Build, source: bytes, header: bytes, where: Path, side: str) -> Any:
    compiler = kernels.c_compiler()
    path = where / f"{kernel.name}-{side}.so"
    if compiler is None or not kernels._build(compiler, source, header, path, f"{side} {kernel.name}",
                                              "nothing to compare", kernel.flags):
        raise SystemExit(f"bench_kernel_ab: the {side} {kernel.name}.c did not build")
    return kernel.wrapper(ctypes.CDLL(str(path)))


def layer_call(kind: str, library: Any, weight: torch.Tensor, group: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> the layer's output through `library`, for a layer made from `weight` the way
    the loader makes it (one layer object per library, the same weights)."""
    if kind == "f16":
        from ruvllm_cli.engine.half import HalfLinear, to_blocks

        return HalfLinear(to_blocks(weight), weight.shape[0], None, library)
    if kind == "q8":
        from ruvllm_cli.engine.int8 import Int8Linear
        from ruvllm_cli.engine.quantize import int8_rows

        codes, scales = int8_rows(weight)
        return Int8Linear(codes.contiguous(), scales, None, library)
    from ruvllm_cli.engine.int4_dense import own_linear
    from ruvllm_cli.engine.quantize import Int4Linear

    layer = Int4Linear.from_weight(weight, None, group)
    return lambda x: own_linear(x, layer.qweight, layer.scales_and_zeros, group, None, library)


def main() -> None:
    from ruvllm_cli.engine.quantize import INT4_GROUP

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernel", choices=("int4", "f16", "q8"), default="int4",
                        help="q4k's int4 kernel (the one this CPU runs), f16's or q8's (default: %(default)s)")
    parser.add_argument("--against", default="HEAD", metavar="REV",
                        help="the git revision whose source is 'old' (default: %(default)s)")
    parser.add_argument("--shapes", default="4864x896,896x4864", help="OUTxIN layer shapes "
                        "(default: the 0.5B shape's MLP, %(default)s)")
    parser.add_argument("--rows", default="1,16,512", help="activation rows a call (default: %(default)s)")
    parser.add_argument("--group", type=int, default=INT4_GROUP, help="int4 group (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=8, help="alternated rounds (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="threads (default: 2)")
    parser.add_argument("--warm", action="store_true", help="no cache eviction between calls")
    parser.add_argument("--allow-different", action="store_true", help="exit 0 though the outputs differ")
    parser.add_argument("--format", choices=("text", "json"), default="text")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernel = kernel_for(args.kernel)
    if kernel is None:
        raise SystemExit(f"bench_kernel_ab: no {args.kernel} kernel of ours runs here "
                         "(no C compiler, another CPU, or RUVLLM_COMPILE=0)")
    shapes = [tuple(int(v) for v in shape.split("x")) for shape in args.shapes.split(",")]
    counts = [int(rows) for rows in args.rows.split(",")]
    dtype = torch.bfloat16 if args.kernel == "int4" else torch.float32
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as where:
        libraries = {side: built(kernel, *sources(revision, kernel.name), Path(where), side)
                     for side, revision in (("old", args.against), ("new", None))}
        cases = []
        for n, k in shapes:
            weight = torch.randn(n, k) * 0.02
            calls = {side: layer_call(args.kernel, library, weight, args.group) for side, library in libraries.items()}
            cases += [((n, k, rows), calls, torch.randn(rows, k).to(dtype)) for rows in counts]
        times: dict[tuple[Any, str], list[float]] = {(key, side): [] for key, _, _ in cases for side in libraries}
        rows_out = []
        with torch.inference_mode():
            for key, calls, x in cases:
                old, new = calls["old"](x), calls["new"](x)
                difference = (old.float() - new.float()).abs().max().item() if old.numel() else 0.0
                rows_out.append({"shape": f"{key[0]}x{key[1]}", "rows": key[2], "same_bits": torch.equal(old, new),
                                 "max_difference": difference})
            evict = None if args.warm else torch.zeros(EVICT_BYTES // 4)
            for round_ in range(args.rounds):
                for key, calls, x in cases:
                    for side in ("old", "new") if round_ % 2 == 0 else ("new", "old"):
                        call = calls[side]
                        if evict is not None:
                            evict.add_(1.0)
                        start = time.perf_counter()
                        call(x)
                        times[(key, side)].append(time.perf_counter() - start)
    for row, (key, _, _) in zip(rows_out, cases):
        row["old_ms"] = statistics.median(times[(key, "old")]) * 1e3
        row["new_ms"] = statistics.median(times[(key, "new")]) * 1e3
        row["new_over_old"] = row["new_ms"] / row["old_ms"]
    if args.format == "json":
        print(json.dumps({"kernel": kernel.name, "against": args.against, "rounds": args.rounds,
                          "threads": args.threads, "warm": args.warm, "rows": rows_out}, indent=2))
    else:
        print(f"{kernel.name}.c: {args.against} (old) against the working tree (new), {args.rounds} rounds "
              f"alternated, {args.threads} threads, caches {'warm' if args.warm else 'evicted'}; medians, ms a call")
        for row in rows_out:
            bits = "same bits" if row["same_bits"] else f"DIFFERENT (max {row['max_difference']:.3g})"
            print(f"  {row['shape']:>10} x {row['rows']:>4} rows   old {row['old_ms']:8.3f}   "
                  f"new {row['new_ms']:8.3f}   new/old {row['new_over_old']:.2f}   {bits}")
    if not args.allow_different and not all(row["same_bits"] for row in rows_out):
        sys.exit(1)


if __name__ == "__main__":
    main()
