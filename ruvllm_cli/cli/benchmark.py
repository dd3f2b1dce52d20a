"""`ruvllm benchmark`: measured TTFT, throughput, latency and memory."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import click

from ruvllm_cli.cli.completion import complete_model
from ruvllm_cli.cli.schema_option import SchemaFile, json_schema_option
from ruvllm_cli.cli.context import AppContext, app_context, global_options
from ruvllm_cli.cli.options import (FiniteFloatRange, device_option, load_quantization_option, lora_options,
                                    prefix_cache_option, prefix_caching, weight_cache_option, compile_option,
                                    threads_option)
from ruvllm_cli.errors import RuvllmError, UsageError, on_sigterm_raise
from ruvllm_cli.quantization import Quantization

if TYPE_CHECKING:
    from ruvllm_cli.engine.engine import LLMEngine
    from ruvllm_cli.engine.grammar import GrammarSpec

# Requests one iteration submits at most: 100,000,000 had filled 20 GB with request
# objects before any failure (the KV pool itself takes a bounded share of memory).
MAX_CONCURRENCY = 1024


@click.command("benchmark")
@click.argument("model", shell_complete=complete_model)
@click.option("--warmup", type=click.IntRange(min=0), default=3, show_default=True,
              help="Iterations run first and discarded.")
@click.option("-i", "--iterations", type=click.IntRange(min=1), default=10, show_default=True,
              help="Measured iterations.")
@click.option("--prompt-length", type=click.IntRange(min=1), default=128, show_default=True,
              help="Prompt length in tokens (exact).")
@click.option("--gen-length", type=click.IntRange(min=1), default=64, show_default=True,
              help="Generated tokens per request (exact; EOS ignored).")
@load_quantization_option()
@click.option("--format", "fmt", type=click.Choice(["table", "json", "csv"]), default="table", show_default=True,
              help="Tables for people; JSON or CSV, alone on stdout, for scripts (fields: docs/benchmark.md).")
@click.option("--concurrency", type=click.IntRange(min=1, max=MAX_CONCURRENCY), default=1, show_default=True,
              help=f"Requests submitted together in each iteration (at most {MAX_CONCURRENCY}).")
@click.option("--output", type=click.Path(dir_okay=False), default=None,
              help="Also write the result, in the same format, to FILE.")
@device_option()
@prefix_cache_option()
@weight_cache_option()
@compile_option()
@threads_option()
@click.option("--compare", "compare_file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="A previous `--format json` result: show each metric beside it; exit 1 on a regression.")
@click.option("--threshold", type=FiniteFloatRange(min=0.0), default=10.0, show_default=True,
              help="Percent by which decode tok/s may fall or median TTFT rise before --compare fails.")
@click.option("--memory-bandwidth", type=FiniteFloatRange(min=0.0, min_open=True), default=None,
              metavar="GBPS", help="Your machine's memory bandwidth in GB/s, to show how close decode gets.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random prompt token ids.")
@json_schema_option("Also run each iteration constrained to the JSON Schema in FILE and report both decode "
                    "speeds and their ratio.")
@lora_options("Each iteration also runs mixed over the base model and the adapters.",
              "4, or the number of --lora adapters when more")
@global_options
def command(model: str, fmt: str, compare_file: str | None, **options: Any) -> None:
    """Benchmark MODEL through the engine and report only measured figures.

    Each iteration submits --concurrency prompts of exactly --prompt-length random
    token ids together and generates exactly --gen-length tokens for each (greedy,
    EOS ignored). JSON and CSV go alone to stdout; progress goes to stderr (one line
    per iteration when it is no terminal). Fields are documented in docs/benchmark.md.

    Each figure's spread over the iterations is reported too; a wide spread, or other
    processes using the CPU during the run, gets a warning, and --compare does not
    count a change within the runs' noise as a regression.

    With --json-schema FILE each iteration runs the workload twice, unconstrained and
    constrained to the schema (alternating which goes first; the schema may end a
    request before --gen-length), and the report adds both decode speeds, their ratio
    and the grammar's mask time per token.

    With --lora NAME=PATH (repeatable) each iteration runs the workload twice, on the
    base model alone and mixed (request i on the base model and the adapters in turn;
    --concurrency must give each one a request), alternating which goes first, and the
    report adds both aggregate decode speeds, their ratio and the adapters' slot loads.

    \b
    Examples:
      ruvllm benchmark qwen
      ruvllm benchmark qwen --format json --concurrency 8 --output run.json
      ruvllm benchmark qwen --compare run.json --threshold 5
      ruvllm benchmark qwen --json-schema person.json
      ruvllm benchmark qwen --concurrency 3 --lora sql=./sql-lora --lora chat=./chat-lora
    """
    from ruvllm_cli.bench.compare import (compare_reports, comparison_warnings, load_previous, print_comparison,
                                          raise_on_regression)
    from ruvllm_cli.bench.noise import noise_warnings

    app = app_context()
    on_sigterm_raise()
    previous = load_previous(compare_file) if compare_file else None
    _check_output_dir(options["output"])
    report = run_benchmark(app, model, fmt=fmt, compare_file=compare_file, **options)
    emit(app, report, fmt, options["output"])
    for warning in noise_warnings(report["noise"]):
        app.output().warn(warning)
    if previous is not None and compare_file is not None:
        comparison = compare_reports(previous, report, options["threshold"])
        out = app.output()
        print_comparison(comparison, out.out if fmt == "table" else out.err, Path(compare_file).name)
        for warning in comparison_warnings(comparison):   # stderr in every format (table mode had them on stdout)
            out.warn(warning)
        raise_on_regression(comparison)


def run_benchmark(app: AppContext, model: str, *, warmup: int, iterations: int, prompt_length: int,
                  gen_length: int, concurrency: int, quantization: Quantization | None, device: str,
                  seed: int, no_prefix_cache: bool = False, no_weight_cache: bool = False, no_compile: bool = False,
                  json_schema: SchemaFile | None = None, lora: Sequence[str] = (), max_loras: int | None = None,
                  max_lora_rank: int | None = None, threads: int | None = None, **rest: Any) -> dict[str, Any]:
    """Load MODEL, run the iterations with progress on stderr, build the report."""
    _check_lora(lora, json_schema, concurrency)
    import torch

    from ruvllm_cli.bench.memory import cuda_max_allocated_mb, peak_rss_mb
    from ruvllm_cli.bench.noise import LoadMonitor, noise_section
    from ruvllm_cli.bench.report import Measurements, build_report, model_section
    from ruvllm_cli.bench.runner import BenchmarkRunner, BenchSettings, check_fits
    from ruvllm_cli.bench.system import system_info
    from ruvllm_cli.cli.engine_setup import locate_adapters, open_engine
    from ruvllm_cli.engine.loader import decode_weight_bytes

    adapters = locate_adapters(app, lora)
    structured = json_schema.spec if json_schema is not None else None
    settings = BenchSettings(warmup, iterations, prompt_length, gen_length, concurrency, seed, structured,
                             tuple(name for name, _ in adapters))
    # A KV pool sized for this workload, so that peak memory reflects the run.
    opened = open_engine(app, model, quantization=quantization, device=device,
                         max_num_seqs=concurrency, max_model_len=prompt_length + gen_length,
                         enable_prefix_caching=prefix_caching(no_prefix_cache), weight_cache=not no_weight_cache,
                         adapters=adapters, max_loras=_slots_for(len(adapters), max_loras),
                         max_lora_rank=max_lora_rank, kernels=not no_compile, threads=threads)
    engine, loaded = opened.engine, opened.loaded
    check_fits(settings, engine.max_model_len)
    compile_s = _compile_grammar(engine, structured, json_schema.path) if json_schema is not None else None
    monitor = LoadMonitor(torch.get_num_threads())
    with _progress(app, settings) as (on_tokens, on_phase, on_done):
        run = BenchmarkRunner(engine, settings, on_tokens).run(*_watched(monitor, on_phase, on_done))
    measured = Measurements(loaded.load_seconds, loaded.weight_bytes, decode_weight_bytes(loaded.model),
                            peak_rss_mb(), cuda_max_allocated_mb(loaded.device), compile_s)
    config = _config_section(settings, engine, device=device,
                             json_schema=json_schema.path if json_schema is not None else None, lora=list(lora),
                             kernels=not no_compile, weight_cache=not no_weight_cache, threads=threads, **rest)
    return build_report(model_section(opened.located, loaded.config, model), config,
                        system_info(loaded), run, measured, noise_section(run.iterations, monitor.result()))


def _check_lora(lora: Sequence[str], json_schema: SchemaFile | None, concurrency: int) -> None:
    """Before anything loads: --lora runs alone, with a request for the base model and
    each adapter in every mixed iteration."""
    if lora and json_schema is not None:
        raise UsageError("--json-schema and --lora cannot be used together: run one benchmark for each")
    if lora and concurrency < 1 + len(lora):
        raise UsageError(f"--lora: the base model and {len(lora)} adapter(s) need --concurrency {1 + len(lora)} "
                         "or more, one request each in every mixed iteration")


def _slots_for(adapters: int, max_loras: int | None) -> int | None:
    """--max-loras as given; unset, enough slots for every adapter of the mix (the
    engine's default when that is more)."""
    from ruvllm_cli.engine.config import EngineConfig

    if max_loras is None and adapters > EngineConfig.max_loras:
        return adapters
    return max_loras


def _watched(monitor: Any, on_phase: Any, on_done: Any) -> tuple[Any, Any]:
    """The progress callbacks, also driving the load monitor over the measured iterations."""

    def phase(name: str, index: int) -> None:
        if name == "iteration" and index == 1:
            monitor.start()
        on_phase(name, index)

    def done(name: str, index: int, sample: Any) -> None:
        if name == "iteration":
            monitor.sample()
        on_done(name, index, sample)

    return phase, done


def _compile_grammar(engine: "LLMEngine", spec: "GrammarSpec", path: str) -> float:
    """Compile the schema for the loaded tokenizer before the run (GrammarError now, not
    mid-run); the seconds it took, building llguidance's tokenizer included."""
    import time

    from ruvllm_cli.cli.schema_option import validate_structured

    start = time.perf_counter()
    validate_structured(engine, spec, path)
    return time.perf_counter() - start


def _config_section(settings: Any, engine: Any, *, device: str, fmt: str, output: str | None,
                    compare_file: str | None, threshold: float, memory_bandwidth: float | None,
                    json_schema: str | None, lora: list[str], kernels: bool, weight_cache: bool,
                    threads: int | None) -> dict[str, Any]:
    """Every option (quantization as in effect), plus the engine settings the run used."""
    return {
        "warmup": settings.warmup, "iterations": settings.iterations, "prompt_length": settings.prompt_length,
        "gen_length": settings.gen_length, "concurrency": settings.concurrency,
        "quantization": engine.loaded.quantization.value, "device": device, "seed": settings.seed,
        "format": fmt, "output": output, "compare": compare_file, "threshold_pct": threshold,
        "memory_bandwidth_gb_s": memory_bandwidth, "sampling": "greedy",
        "prefix_caching": engine.config.enable_prefix_caching, "max_num_seqs": engine.config.max_num_seqs,
        "max_model_len": engine.max_model_len, "kv_cache_blocks": engine.block_manager.num_blocks,
        "block_size": engine.config.block_size, "json_schema": json_schema, "lora": lora,
        "max_loras": engine.config.max_loras, "max_lora_rank": engine.config.max_lora_rank,
        "kernels": kernels, "weight_cache": weight_cache, "threads": threads,
    }


def _check_output_dir(output: str | None) -> None:
    """Fail before a long run, not after it, when --output cannot be written: its
    directory must exist and take a new file (a file made and removed there)."""
    if not output:
        return
    directory = Path(output).resolve().parent
    if not directory.is_dir():
        raise UsageError(f"--output: the directory of {output} does not exist")
    import tempfile

    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".ruvllm-output-check-"):
            pass
    except OSError as error:
        raise UsageError(f"--output: cannot write in {directory}: {error.strerror or error}") from None


@contextmanager
def _progress(app: AppContext, settings: Any) -> Iterator[tuple[Any, Any, Any]]:
    """Progress on stderr: a bar on a terminal, else one line per iteration; yields the
    callbacks (on_tokens, on_phase, on_done)."""
    console = app.output().err
    if console.is_terminal:
        with _progress_bar(console, settings) as (on_tokens, on_phase):
            yield on_tokens, on_phase, lambda phase, index, sample: None
        return
    yield (lambda count: None), (lambda phase, index: None), _progress_line(console, settings)


def _progress_line(console: Any, settings: Any) -> Any:
    """on_done for a stderr that is no terminal (CI logs): one line per iteration."""
    from ruvllm_cli.bench.metrics import summarize

    def done(phase: str, index: int, sample: Any) -> None:
        total = settings.warmup if phase == "warmup" else settings.iterations
        figures = summarize([sample])
        decode, ttft = figures["decode_tokens_per_s"], figures["ttft_ms_mean"]
        rate = f"decode {decode:.2f} tok/s" if decode is not None else "decode n/a"
        console.print(f"{'warm-up' if phase == 'warmup' else 'iteration'} {index}/{total}: {rate}, "
                      f"TTFT {ttft:.1f} ms, {sample.wall_s:.1f} s", highlight=False)

    return done


@contextmanager
def _progress_bar(console: Any, settings: Any) -> Iterator[tuple[Any, Any]]:
    """A rich progress bar counting generated tokens; yields its callbacks.

    No refresh thread: the bar is redrawn on the engine's own thread between
    iterations and at most once a second within one, so drawing it never competes
    with a measured step for the GIL."""
    import time

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("tokens"), TimeElapsedColumn(), console=console,
                        transient=True, auto_refresh=False)
    task = progress.add_task("warm-up", total=settings.total_tokens)
    last_refresh = [time.monotonic()]

    def refresh() -> None:
        progress.refresh()
        last_refresh[0] = time.monotonic()

    def on_tokens(count: int) -> None:
        progress.advance(task, count)
        if time.monotonic() - last_refresh[0] >= 1.0:
            refresh()

    def on_phase(phase: str, index: int) -> None:
        total = settings.warmup if phase == "warmup" else settings.iterations
        label = "warm-up" if phase == "warmup" else "iteration"
        progress.update(task, description=f"{label} {index}/{total}")
        refresh()

    with progress:
        yield on_tokens, on_phase


def write_output(path: Path, text: str) -> None:
    """--output: a file is replaced whole (a full disk had left half a report in place
    of the last one, which --compare then could not read); a FIFO or a device
    (/dev/stdout) is written as it is."""
    from ruvllm_cli.fsutil import user_file_mode, write_text_atomic

    target = path.resolve() if path.is_symlink() else path
    if target.exists() and not target.is_file():
        target.write_text(text, encoding="utf-8")
    else:
        write_text_atomic(target, text, mode=user_file_mode(target))


def emit(app: AppContext, report: dict[str, Any], fmt: str, output: str | None) -> None:
    """The report on stdout in `fmt` (data alone for json/csv), and to --output too."""
    from ruvllm_cli.bench.formatters import print_tables, to_csv, to_json, to_text

    if fmt == "table":
        print_tables(report, app.output().out)
        text = to_text(report) if output else ""
    else:
        text = to_json(report) if fmt == "json" else to_csv(report)
        sys.stdout.write(text)
        sys.stdout.flush()
    if output:
        try:
            write_output(Path(output), text)
        except OSError as error:
            raise RuvllmError(f"cannot write {output}: {error.strerror or error}") from None
        app.output().info(f"[dim]Wrote {output}[/dim]")
