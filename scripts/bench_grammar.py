#!/usr/bin/env python
"""Constrained decoding cost on a Qwen2.5-sized vocabulary: llguidance (through
ruvllm's GrammarCompiler, the engine's path) beside xgrammar 0.2.x, if importable.

No Qwen tokenizer can be downloaded here, so the script builds (once, cached under
--cache) a synthetic byte-level BPE tokenizer of Qwen2.5's size
(`ruvllm_cli.testing.synthetic_vocab`: 151,643 regular tokens, every one the merge of
two earlier ones, that look like a real vocabulary's) + 22 special tokens, logits
151,936 wide. For each schema (flat object, nested depth 6, array of objects with
enum and pattern), it measures:

  * compile + first mask: a fresh compile of the schema, a matcher, its first mask
    (median of --repeats; caches off), and the same with the compiled grammar reused;
  * per-token mask time (median, p95) and accept time while walking a compact JSON
    document of the schema token by token, checking each token is allowed;
  * once per library, masking float32 logits [1 and 8, 151,936] on CPU (ruvllm's
    apply_bitmask for llguidance, xgrammar's own CPU kernel), on one torch thread:
    xgrammar's kernel is single-threaded, and on a busy 2-core machine a 2-thread
    torch op waits ~16 ms for its second thread.

Each library runs in its own process, so neither one's threads disturb the other's
figures. xgrammar is measured, never a dependency: install it in a throwaway venv beside torch 2.13.0+cpu, llguidance and
transformers, and run the script with that Python:

    .venv/bin/python scripts/bench_grammar.py [--repeats 5] [--format json]
    /tmp/xgvenv/bin/python scripts/bench_grammar.py --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ruvllm_cli.bench.harness import BENCH_MODEL_CACHE  # noqa: E402
from ruvllm_cli.testing.synthetic_vocab import REGULAR_TOKENS, synthetic_tokenizer  # noqa: E402

LOGITS_WIDTH = 151_936
SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
)
TOKENIZER_DIR = "qwen25-synthetic-bpe-v1"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---- the synthetic tokenizer -------------------------------------------------------


def build_tokenizer(path: Path) -> None:
    """Write a Qwen2.5-sized byte-level BPE tokenizer (tokenizer.json and config) to `path`."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    backend = synthetic_tokenizer()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    wrapped = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    wrapped.save_pretrained(path)


def load_tokenizer(cache: Path) -> Any:
    from transformers import PreTrainedTokenizerFast

    path = cache / TOKENIZER_DIR
    if not (path / "tokenizer.json").is_file():
        start = time.perf_counter()
        build_tokenizer(path)
        log(f"built the synthetic tokenizer in {time.perf_counter() - start:.1f} s: {path}")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    assert len(tokenizer) == REGULAR_TOKENS + len(SPECIAL_TOKENS), len(tokenizer)
    return tokenizer


def length_histogram(tokenizer: Any) -> str:
    """Share of regular tokens by byte length, e.g. `1:0.2% 2:5.1% ...`."""
    ids = range(REGULAR_TOKENS)
    lengths = Counter(min(len(tokenizer.convert_tokens_to_string([t]).encode()), 13)
                      for t in tokenizer.convert_ids_to_tokens(list(ids)))
    return " ".join(f"{n if n < 13 else '13+'}:{100 * lengths[n] / REGULAR_TOKENS:.1f}%" for n in sorted(lengths))


# ---- schemas and documents ---------------------------------------------------------


def closed(properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False}


def nested(depth: int) -> tuple[dict[str, Any], dict[str, Any]]:
    if depth == 1:
        leaf = closed({"value": {"type": "number"}, "tags": {"type": "array", "items": {"type": "string"}}})
        return leaf, {"value": 3.25, "tags": ["alpha", "beta", "gamma"]}
    schema, document = nested(depth - 1)
    return (closed({"id": {"type": "integer"}, "label": {"type": "string"}, "child": schema}),
            {"id": depth, "label": f"level {depth} of the tree", "child": document})


def cases() -> list[tuple[str, dict[str, Any], Any]]:
    flat = closed({"name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string"},
                   "active": {"type": "boolean"}, "score": {"type": "number"}})
    item = closed({"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                   "status": {"enum": ["in_stock", "backorder", "discontinued"]},
                   "qty": {"type": "integer", "minimum": 0}, "price": {"type": "number"}})
    orders = closed({"items": {"type": "array", "items": item, "minItems": 1}})
    statuses = ["in_stock", "backorder", "discontinued"]
    order_doc = {"items": [{"sku": f"ABC-{1000 + 37 * i}", "status": statuses[i % 3], "qty": i * 3,
                            "price": 9.99 + i} for i in range(8)]}
    deep, deep_doc = nested(6)
    return [
        ("flat object (5 fields)", flat,
         {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com", "active": True, "score": 97.5}),
        ("nested depth 6", deep, deep_doc),
        ("array of 8 objects, enum+pattern", orders, order_doc),
    ]


# ---- measurements ------------------------------------------------------------------


@dataclass
class Figures:
    library: str
    schema: str
    tokens: int
    compile_first_mask_ms: float      # median, fresh compile + matcher + first mask
    compile_first_mask_cold_ms: float  # the first of those runs
    cached_first_mask_ms: float       # compiled grammar reused: matcher + first mask
    mask_p50_us: float
    mask_p95_us: float
    mask_max_us: float
    accept_p50_us: float
    rejected: int                     # document tokens the mask did not allow (must be 0)
    completed: bool                   # the grammar accepted the document and then EOS


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def bit_set(bitmask: Any, token_id: int) -> bool:
    return bool((int(bitmask[0, token_id // 32]) >> (token_id % 32)) & 1)


def timed(call: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = call()
    return time.perf_counter() - start, result


class Llguidance:
    """llguidance through the engine's own GrammarCompiler (caching off for the cold runs)."""

    name = "llguidance"

    def __init__(self, tokenizer: Any, threads: int) -> None:
        import llguidance
        import torch

        from ruvllm_cli.engine.grammar import GrammarCompiler

        self.version = llguidance.__version__
        self.setup_s, self.cold = timed(lambda: GrammarCompiler(tokenizer, LOGITS_WIDTH, max_cached=0))
        self.warm = GrammarCompiler(tokenizer, LOGITS_WIDTH)
        self.bitmask = torch.zeros(1, self.cold.layout.words, dtype=torch.int32)
        self.eos = tokenizer.eos_token_id

    def first_mask(self, schema: dict[str, Any], cached: bool) -> None:
        from ruvllm_cli.engine.grammar import GrammarSpec

        compiler = self.warm if cached else self.cold
        compiler.compile(GrammarSpec.json_schema(schema)).matcher().fill_bitmask(self.bitmask, 0)

    def apply(self, logits: Any, bitmask: Any) -> None:
        from ruvllm_cli.engine.grammar import apply_bitmask

        apply_bitmask(logits, bitmask)

    def walk(self, schema: dict[str, Any], ids: list[int]) -> tuple[list[float], list[float], int, bool]:
        from ruvllm_cli.engine.grammar import GrammarSpec

        matcher = self.warm.compile(GrammarSpec.json_schema(schema)).matcher()
        masks, accepts, rejected = [], [], 0
        for token_id in ids:
            masks.append(timed(lambda: matcher.fill_bitmask(self.bitmask, 0))[0])
            rejected += not bit_set(self.bitmask, token_id)
            accepts.append(timed(lambda: matcher.accept(token_id))[0])
        matcher.fill_bitmask(self.bitmask, 0)
        return masks, accepts, rejected, bit_set(self.bitmask, self.eos) and matcher.accept(self.eos)


class Xgrammar:
    """xgrammar 0.2.x: compact JSON (no whitespace, "," and ":"), as llguidance here."""

    name = "xgrammar"

    def __init__(self, tokenizer: Any, threads: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.version = metadata.version("xgrammar")
        self.setup_s, info = timed(lambda: xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=LOGITS_WIDTH))
        self.cold = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self.warm = xgr.GrammarCompiler(info, max_threads=threads)
        self.bitmask = xgr.allocate_token_bitmask(1, LOGITS_WIDTH)
        self.eos = tokenizer.eos_token_id

    def compiled(self, schema: dict[str, Any], cached: bool) -> Any:
        compiler = self.warm if cached else self.cold
        return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))

    def first_mask(self, schema: dict[str, Any], cached: bool) -> None:
        self.xgr.GrammarMatcher(self.compiled(schema, cached)).fill_next_token_bitmask(self.bitmask)

    def apply(self, logits: Any, bitmask: Any) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)

    def walk(self, schema: dict[str, Any], ids: list[int]) -> tuple[list[float], list[float], int, bool]:
        matcher = self.xgr.GrammarMatcher(self.compiled(schema, True))
        masks, accepts, rejected = [], [], 0
        for token_id in ids:
            masks.append(timed(lambda: matcher.fill_next_token_bitmask(self.bitmask))[0])
            rejected += not bit_set(self.bitmask, token_id)
            accepts.append(timed(lambda: matcher.accept_token(token_id))[0])
        matcher.fill_next_token_bitmask(self.bitmask)
        return masks, accepts, rejected, bit_set(self.bitmask, self.eos) and matcher.accept_token(self.eos)


def measure(library: Any, name: str, schema: dict[str, Any], ids: list[int], repeats: int) -> Figures:
    cold = [timed(lambda: library.first_mask(schema, cached=False))[0] for _ in range(repeats)]
    library.first_mask(schema, cached=True)  # fills the cache
    cached = statistics.median(timed(lambda: library.first_mask(schema, cached=True))[0] for _ in range(repeats))
    masks, accepts, rejected, completed = library.walk(schema, ids)
    return Figures(library.name, name, len(ids), 1e3 * statistics.median(cold), 1e3 * cold[0], 1e3 * cached,
                   1e6 * statistics.median(masks), 1e6 * percentile(masks, 0.95), 1e6 * max(masks),
                   1e6 * statistics.median(accepts), rejected, bool(completed))


def apply_times(library: Any, rows_list: tuple[int, ...] = (1, 8), repeats: int = 20) -> dict[str, float]:
    """Median ms to mask float32 logits [rows, 151936] with a random bitmask, on one CPU thread."""
    import torch

    generator = torch.Generator().manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    times = {}
    for rows in rows_list:
        logits = torch.randn(rows, LOGITS_WIDTH, generator=generator)
        bitmask = torch.randint(-2**31, 2**31 - 1, (rows, (LOGITS_WIDTH + 31) // 32), dtype=torch.int32,
                                generator=generator)
        library.apply(logits, bitmask)  # warm-up
        times[f"rows_{rows}_ms"] = 1e3 * statistics.median(timed(lambda: library.apply(logits, bitmask))[0]
                                                           for _ in range(repeats))
    torch.set_num_threads(threads)
    return times


LIBRARIES = {"llguidance": Llguidance, "xgrammar": Xgrammar}


def measure_library(name: str, tokenizer: Any, args: argparse.Namespace) -> dict[str, Any] | None:
    """All figures for one library, or None when it is not importable here."""
    try:
        library = LIBRARIES[name](tokenizer, args.threads)
    except ImportError as error:
        log(f"{name}: not importable here ({error}); skipped")
        return None
    log(f"{name} {library.version}: tokenizer setup {library.setup_s:.2f} s")
    rows = []
    for schema_name, schema, document in cases():
        ids = tokenizer.encode(json.dumps(document, separators=(",", ":")), add_special_tokens=False)
        rows.append(asdict(measure(library, schema_name, schema, ids, args.repeats)))
        log(f"measured {name}: {schema_name}")
    return {"version": library.version, "tokenizer_setup_s": library.setup_s, "apply": apply_times(library),
            "load_average": os.getloadavg(), "rows": rows}


def measure_in_child(name: str, args: argparse.Namespace) -> dict[str, Any] | None:
    """`measure_library` in a fresh process: one library's threads (xgrammar keeps a
    pool) must not slow the other's measurements down."""
    command = [sys.executable, __file__, "--libraries", name, "--format", "json", "--cache", args.cache,
               "--threads", str(args.threads), "--repeats", str(args.repeats)]
    result = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(result.stdout)["libraries"].get(name)


# ---- output ------------------------------------------------------------------------

COLUMNS = [("library", "library", "{}"), ("schema", "schema", "{}"), ("tokens", "doc tokens", "{}"),
           ("compile_first_mask_ms", "compile+1st mask ms", "{:.1f}"),
           ("compile_first_mask_cold_ms", "(first run) ms", "{:.1f}"),
           ("cached_first_mask_ms", "cached 1st mask ms", "{:.2f}"),
           ("mask_p50_us", "mask p50 us", "{:.0f}"), ("mask_p95_us", "mask p95 us", "{:.0f}"),
           ("mask_max_us", "mask max us", "{:.0f}"), ("accept_p50_us", "accept p50 us", "{:.0f}"),
           ("rejected", "rejected", "{}"), ("completed", "ok", "{}")]


def table(rows: list[Figures]) -> str:
    cells = [[title for _, title, _ in COLUMNS]]
    cells += [[fmt.format(getattr(row, key)) for key, _, fmt in COLUMNS] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths)) for line in cells]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def report(libraries: dict[str, Any], load_before: tuple[float, ...], threads: int) -> str:
    lines = []
    for name, figures in libraries.items():
        apply = ", ".join(f"{key.split('_')[1]} row(s) {ms:.2f} ms" for key, ms in figures["apply"].items())
        lines.append(f"{name} {figures['version']}: tokenizer setup {figures['tokenizer_setup_s']:.2f} s; "
                     f"masking float32 logits [rows, {LOGITS_WIDTH}] on 1 thread: {apply}")
    order = [name for name, _, _ in cases()]
    rows = sorted((Figures(**row) for figures in libraries.values() for row in figures["rows"]),
                  key=lambda row: order.index(row.schema))
    lines.append(table(rows))
    loads = ", ".join(f"{name} {figures['load_average'][0]:.2f}" for name, figures in libraries.items())
    lines.append(f"load average (1 min) before {load_before[0]:.2f}, after each library: {loads}; "
                 f"{threads} threads; each library in its own process")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache", default=str(BENCH_MODEL_CACHE),
                        help="where the synthetic tokenizer is kept (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="torch and xgrammar compile threads (default: 2)")
    parser.add_argument("--repeats", type=int, default=5, help="cold compiles per schema (default: 5)")
    parser.add_argument("--libraries", default="llguidance,xgrammar", help="default: %(default)s")
    parser.add_argument("--format", choices=["table", "json"], default="table")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    tokenizer = load_tokenizer(Path(args.cache))
    log(f"tokenizer: {len(tokenizer)} tokens, logits {LOGITS_WIDTH}; bytes per regular token "
        f"{length_histogram(tokenizer)}")
    names = [name for name in args.libraries.split(",") if name in LIBRARIES]
    if len(names) == 1:
        measured = {names[0]: measure_library(names[0], tokenizer, args)}
    else:
        measured = {name: measure_in_child(name, args) for name in names}
    libraries = {name: figures for name, figures in measured.items() if figures is not None}
    if args.format == "json":
        print(json.dumps({"libraries": libraries, "load_average_before": load_before}, indent=2))
    else:
        print(report(libraries, load_before, args.threads))


if __name__ == "__main__":
    main()
