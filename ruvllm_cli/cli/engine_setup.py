"""Shared by chat, serve and benchmark: MODEL argument + options -> a running engine."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from rich.markup import escape

from ruvllm_cli.cli.context import AppContext
from ruvllm_cli.errors import ModelLoadError, RuvllmError, UsageError
from ruvllm_cli.quantization import Quantization, quantization_of_gguf
from ruvllm_cli.registry.locate import LocatedModel, locate_model

# 16-bit unless asked: q4k prefill runs 2x slower here and q8 costs some accuracy
# (docs/design.md section 4); a GGUF file keeps its own type instead.
DEFAULT_QUANTIZATION = Quantization.F16
NO_BF16_NOTE = ("Loading float32 (-q none): this CPU has no bfloat16 kernels (oneDNN needs AVX-512), so 16-bit "
                "weights would run unpacked and slower; -q f16 loads them 16-bit anyway")

GGUF_ON_CUDA_NOTE = ("Loading float16 (-q f16): on CUDA q8/q4k go through bitsandbytes, which cannot read a GGUF "
                     "file; --device cpu keeps the file's own type")


def default_quantization(located: LocatedModel) -> Quantization:
    """A GGUF file keeps its own quantization, by its file type (a Q4_K_M file must
    not become a 16-bit model in memory); anything else loads 16-bit."""
    return files_quantization(located.path)


def files_quantization(path: Path) -> Quantization:
    """What a model's files load as without -q: a GGUF file its type, else 16-bit
    (default_quantization's rule, for `list`'s estimate too)."""
    if path.suffix == ".gguf":
        return gguf_quantization(path) or DEFAULT_QUANTIZATION
    return DEFAULT_QUANTIZATION


def gguf_quantization(path: Path) -> Quantization | None:
    """The file type's quantization (engine/gguf_plan.py), else its name's; None for a
    file too damaged to say (the loader reports it)."""
    from ruvllm_cli.engine.gguf_check import check_gguf
    from ruvllm_cli.engine.gguf_plan import file_quantization

    try:
        return file_quantization(check_gguf(path))
    except ModelLoadError:
        return quantization_of_gguf(path.name)


def gguf_conflict_note(located: LocatedModel, asked: Quantization) -> str | None:
    """A line when -q asks a GGUF file for another layout than its own: -q wins, and
    the file's blocks are requantized (or dequantized) into it."""
    own = gguf_quantization(located.path) if located.path.suffix == ".gguf" else None
    if own is None or own is asked:
        return None
    ways = {Quantization.F32: "dequantized into float32", Quantization.F16: "turned into 16-bit floats",
            Quantization.Q8_0: "requantized into int8", Quantization.Q4_K_M: "requantized into int4"}
    return (f"-q {asked.value}: the file's blocks are {ways[asked]} where their layout differs "
            f"(without -q it loads as {own.value}; the load line counts each way)")


def load_default(located: LocatedModel, device: str) -> tuple[Quantization, str | None]:
    """What to load with when -q was not given, and a note when that is not the
    files' own type: float32 instead of 16-bit on a CPU with neither bfloat16 kernels
    nor our float16 kernel, float16 for a quantized GGUF file on CUDA."""
    own = default_quantization(located)
    from ruvllm_cli.engine.loader import select_device

    target = select_device(device).type
    if target == "cuda" and located.path.suffix == ".gguf" and own in (Quantization.Q8_0, Quantization.Q4_K_M):
        return Quantization.F16, GGUF_ON_CUDA_NOTE
    if own is not Quantization.F16:
        return own, None
    from ruvllm_cli.engine.loader import half_weights_here
    from ruvllm_cli.engine.quantize import cpu_has_bf16_kernels

    if target != "cpu" or cpu_has_bf16_kernels() or half_weights_here():
        return own, None
    # Float32 files stay what they are: nothing to explain.
    return Quantization.F32, None if _stored_as_float32(located) else NO_BF16_NOTE


def _stored_as_float32(located: LocatedModel) -> bool:
    from ruvllm_cli.registry.weights import safetensors_dtype

    directory = located.path
    return directory.is_dir() and safetensors_dtype(sorted(directory.glob("*.safetensors"))) == "f32"


# The least context `serve` starts with when the KV pool caps it (unless --max-context asks less).
MIN_SERVED_CONTEXT = 256


def _size_text(size: int) -> str:
    return (f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.0f} MiB" if size >= 2**20
            else f"{size / 2**10:.0f} KiB")


@dataclass
class OpenedEngine:
    engine: Any          # ruvllm_cli.engine.engine.LLMEngine
    located: LocatedModel

    @property
    def loaded(self) -> Any:
        return self.engine.loaded

    def kv_summary(self) -> str:
        """The KV pool: its memory, the tokens it holds, and what sized it."""
        engine = self.engine
        size = engine.kv_cache_bytes
        tokens = engine.block_manager.num_blocks * engine.config.block_size
        if engine.config.kv_cache_memory is not None:
            source = "--kv-cache-memory"
        elif tokens >= engine.config.max_num_seqs * engine.max_model_len:
            source = f"room for {engine.config.max_num_seqs} x {engine.max_model_len} tokens"
        else:
            source = (f"{engine.config.kv_cache_fraction:.0%} of free memory; "
                      "--kv-cache-memory sets it")
        size_text = _size_text(size)
        capped = engine.context_before_kv_cap
        cap = (f"; it caps the context at {engine.max_model_len:,} of {capped:,} tokens" if capped is not None
               else "")
        return f"{size_text}, {tokens:,} tokens of context ({source}){cap}"

    def check_served_context(self) -> None:
        """Refuse to serve a KV pool that caps the context below MIN_SERVED_CONTEXT tokens
        (or the context asked, where less): every chat request would be "too long" (16
        tokens do not hold a chat template's own), under a /health of 200. vLLM refuses
        any pool smaller than its context; a pool that caps a long context to a usable
        one is served, with kv_summary saying so."""
        engine = self.engine
        asked = engine.context_before_kv_cap
        if asked is None:
            return
        floor = min(asked, MIN_SERVED_CONTEXT)
        if engine.max_model_len >= floor:
            return
        block = engine.config.block_size
        need = -(-floor // block) * (engine.kv_cache_bytes // engine.block_manager.num_blocks)
        given = engine.config.kv_cache_memory is not None
        source = "--kv-cache-memory" if given else f"{engine.config.kv_cache_fraction:.0%} of free memory"
        error = UsageError if given else ModelLoadError
        raise error(f"the KV cache ({_size_text(engine.kv_cache_bytes)}, {source}) holds {engine.max_model_len} "
                    f"tokens of context, fewer than the {floor} a server needs to answer requests",
                    f"give --kv-cache-memory {_size_text(need)} or more ({floor} tokens of this model)")

    def context_note(self, asked: int) -> str | None:
        """A line when the context is shorter than --max-context asked because the model
        takes no more (a KV pool that caps it says so in kv_summary)."""
        engine = self.engine
        if engine.max_model_len >= asked or engine.context_before_kv_cap is not None:
            return None
        return (f"--max-context {asked:,} is more than this model takes: its context is "
                f"{engine.max_model_len:,} tokens")

    def describe(self) -> str:
        """One line: model, device, quantization and precision, context."""
        loaded = self.loaded
        return (f"{self.located.served_name} · {loaded.device.type} · {precision(loaded.quantization, loaded.dtype)}"
                f" · context {self.engine.max_model_len} tokens")


def precision(quantization: Quantization, dtype: Any) -> str:
    """`Quantization.precision` of a torch dtype."""
    return quantization.precision(str(dtype).replace("torch.", ""))


_threads_applied: int | None = None


def set_threads(app: AppContext, threads: int) -> None:
    """torch's (and so the C kernels') CPU threads; more than the usable cores only with
    a warning, since every step then waits on threads the cores cannot run at once.
    Once a process: a serve pool opens an engine at each model load, and said it again."""
    import torch

    from ruvllm_cli.bench.noise import usable_cores

    global _threads_applied
    if threads == _threads_applied and torch.get_num_threads() == threads:
        return
    cores = usable_cores()
    if threads > cores:
        app.output().warn(f"--threads {threads} is more than the {cores} CPU cores this process may use: "
                          "each step waits for threads that cannot run at once (slower, not faster)")
    torch.set_num_threads(threads)
    _threads_applied = threads


def open_engine(app: AppContext, model: str, *, quantization: Quantization | None = None,
                device: str = "auto", weight_cache: bool = True, adapters: Sequence[tuple[str, Path]] = (),
                kernels: bool = True, skip_bad_adapters: bool = False, threads: int | None = None,
                before_load: Callable[[LocatedModel], None] | None = None, **engine_options: Any) -> OpenedEngine:
    """Locate MODEL, load it with a spinner on stderr, and build the engine, serving
    the LoRA `adapters` ((name, directory) from `locate_adapters`); with
    `skip_bad_adapters` one that cannot be read or does not fit the model is left out
    with a warning instead of failing the load (a pool's reload: the model must come
    back even when an adapter's directory went away).

    `engine_options` are EngineConfig fields (max_num_seqs, max_model_len, max_loras, ...);
    `kernels=False` (--no-compile) keeps ruvllm's C kernels out, for this process;
    `threads` (--threads) sets torch's and the kernels' CPU threads, for this process;
    `before_load` checks the located model before anything is loaded (what an option
    asks of it that its config.json already rules out)."""
    if threads is not None:
        set_threads(app, threads)
    if not kernels:
        from ruvllm_cli.engine.kernels import turn_off

        turn_off()
    located = locate_model(model, app.cache_dir, quantization)
    if before_load is not None:
        before_load(located)
    out = app.output()
    with out.err.status(f"Loading {located.served_name} ..."):
        from ruvllm_cli.engine.config import EngineConfig
        from ruvllm_cli.engine.engine import LLMEngine
        from ruvllm_cli.engine.loader import load_model

        if quantization is None:
            quantization, note = load_default(located, device)
        else:
            note = gguf_conflict_note(located, quantization)
        if note:
            out.info(f"[dim]{note}[/dim]")
        config_fields = {k: v for k, v in engine_options.items() if v is not None}
        config = EngineConfig(device=device, quantization=quantization, **config_fields)
        loaded = load_model(located.path, config.device, config.quantization, use_cache=weight_cache)
        skip = (lambda name, error: out.warn(f"LoRA adapter {name} left out: {error}")) if skip_bad_adapters \
            else None
        loras = read_adapters(adapters, skip)
        if loras and "max_lora_rank" not in config_fields:
            config = dataclasses.replace(config, max_lora_rank=max(EngineConfig.max_lora_rank,
                                                                   *(a.rank for a in loras)))
        engine = LLMEngine(loaded, config)
        for lora in list(loras):
            try:
                engine.add_lora(lora.name, lora)
            except RuvllmError as error:
                if skip is None:
                    raise
                skip(lora.name, error.message)
                loras.remove(lora)
    opened = OpenedEngine(engine, located)
    fused = "; decode steps fused (C kernels)" if engine.runner.fused is not None else ""
    out.info(f"[dim]Loaded {opened.describe()} in {loaded.load_seconds:.1f} s; "
             f"{loaded.quantization_path}{fused}[/dim]")
    for lora in loras:
        out.info(f"[dim]LoRA adapter {lora.describe()}[/dim]")
    kept = weight_cache_line(loaded.weight_cache_written, app.cache_dir)
    if kept:
        out.info(f"[dim]{escape(kept)}[/dim]")
    return opened


def weight_cache_line(written: Path | None, cache_dir: Path) -> str | None:
    """The line that says a load wrote its quantized weights beside a model of the
    user's own (a directory or GGUF file outside the cache), where nothing else of
    ruvllm's lives; None for a model in the cache (`rm` removes its weights with it)."""
    from rich.filesize import decimal as format_size

    if written is None or written.resolve().is_relative_to(Path(cache_dir).resolve()):
        return None
    size = format_size(written.stat().st_size) if written.is_file() else "n/a"
    return (f"Kept these quantized weights for faster loads in {written.parent} ({size}; "
            "--no-weight-cache keeps none; delete that directory to free the space)")


def locate_adapters(app: AppContext, specs: Sequence[str]) -> list[tuple[str, Path]]:
    """`--lora NAME=PATH` values -> (name, adapter directory); hub ids are fetched
    (a line on stderr says so). Nothing is read yet: call it before loading the
    model, so a wrong path fails at once."""
    from ruvllm_cli.registry.adapters import locate_adapter, parse_lora_specs

    found = []
    for name, spec in parse_lora_specs(specs):
        def fetching(name: str = name, spec: str = spec) -> None:
            app.output().info(f"[dim]Fetching LoRA adapter {name} ({spec}) ...[/dim]")

        found.append((name, locate_adapter(spec, app.cache_dir, on_fetch=fetching)))
    return found


def read_adapters(paths: Sequence[tuple[str, Path]],
                  skip: Callable[[str, str], None] | None = None) -> list[Any]:
    """The adapters read; one that cannot be is an error, or with `skip` reported and left out."""
    from ruvllm_cli.engine.lora import read_adapter

    adapters = []
    for name, path in paths:
        try:
            adapters.append(read_adapter(name, path))
        except RuvllmError as error:
            if skip is None:
                raise
            skip(name, error.message)
    return adapters
