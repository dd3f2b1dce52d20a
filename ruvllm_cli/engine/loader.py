"""Loads a transformers model and tokenizer from a local directory onto a device."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ruvllm_cli.engine import attention, weight_cache
from ruvllm_cli.engine import tokenizer as own_tokenizer
from ruvllm_cli.engine.gguf_check import GGUFLayout, check_gguf
from ruvllm_cli.engine.sampling import model_sampling_defaults
from ruvllm_cli.engine.stream_load import hold_freed_memory, release_freed_memory
from ruvllm_cli.errors import ModelLoadError
from ruvllm_cli.quantization import Quantization
from ruvllm_cli.registry.memory import layout_bytes
from ruvllm_cli.registry.model_config import read_model_dir_config

log = logging.getLogger(__name__)
STREAM_ENV = "RUVLLM_STREAM_LOAD"  # "0": always load through transformers, then quantize


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any
    device: torch.device
    dtype: torch.dtype
    quantization: Quantization
    load_seconds: float
    weight_bytes: int
    eos_token_ids: tuple[int, ...]
    max_context: int
    quantization_path: str  # which load-time path was taken, for the notice line
    streamed: bool = False  # built one module at a time from safetensors (stream_load)
    from_weight_cache: bool = False  # q8/q4k tensors read from the weight cache (weight_cache)
    weight_cache_written: Path | None = None  # the weight cache file this load wrote
    # the creator's recommended sampling (generation_config.json, a GGUF's general.sampling.*;
    # sampling.model_sampling_defaults):
    # what requests that leave a field out get
    sampling_defaults: dict[str, float | int] = field(default_factory=dict)

    @property
    def config(self) -> Any:
        return self.model.config


def select_device(name: str = "auto") -> torch.device:
    """auto: CUDA, then MPS, then CPU. A forced device that is missing is an error."""
    name = name.lower()
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("--device cuda: no CUDA device is available", "use --device cpu or auto")
    if name == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise ModelLoadError("--device mps: MPS is not available here", "use --device cpu or auto")
    return torch.device(name)


def dtype_for(quantization: Quantization, device: torch.device) -> torch.dtype:
    """The activations' dtype. `none` is float32; `f16` is float16 on accelerators and
    bfloat16 on a CPU, except where it keeps float16 weights with float32 activations in
    our own kernel (half_weights_here; engine/half.py); the quantized types keep 16-bit
    activations."""
    if quantization is Quantization.F32:
        return torch.float32
    if device.type != "cpu":
        return torch.float16
    if quantization is Quantization.F16 and half_weights_here():
        return torch.float32
    if quantization is Quantization.Q8_0:
        from ruvllm_cli.engine.quantize import int8_weights_here

        if int8_weights_here():
            return torch.float32   # our int8 kernel takes and gives float32 (engine/int8.py)
    return torch.bfloat16


def half_weights_here() -> bool:
    """Whether `f16` on this CPU means float16 weights in our kernel: our bfloat16
    kernel does not run here, and the float16 one builds and loads. That is every CPU
    without AVX-512 BF16: those without bfloat16 kernels for oneDNN (AVX2), and AVX-512
    ones where oneDNN's bfloat16 is emulated, which ran a 0.5B decode at 0.7x, 16
    streams at 0.6x of float16 in our kernel, with a second copy of a tied head
    (docs/design.md, section 19)."""
    from ruvllm_cli.engine.kernels import half_kernel
    from ruvllm_cli.engine.quantize import bf16_weights_here, cpu_has_bf16_kernels

    own_bf16 = cpu_has_bf16_kernels() and bf16_weights_here()
    return not own_bf16 and half_kernel() is not None


def _pretrained_args(path: Path) -> tuple[dict[str, Any], dict[str, Any] | None, GGUFLayout | None]:
    """from_pretrained's arguments for a model directory or a GGUF file, the
    directory's config.json (None for a GGUF file) and the GGUF file's checked header
    (read once a load: 70 ms warm for a 150k vocabulary's metadata)."""
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"{path}: no such GGUF file")
        layout = check_gguf(path)  # before any reader trusts its counts and offsets
        return {"pretrained_model_name_or_path": path.parent, "gguf_file": path.name}, None, layout
    return {"pretrained_model_name_or_path": path}, read_model_dir_config(path), None


ORDER = (Quantization.F32, Quantization.F16, Quantization.Q8_0, Quantization.Q4_K_M)


def memory_needed(path: Path, config: dict[str, Any] | None, device: torch.device,
                  quantization: Quantization, layout: GGUFLayout | None = None,
                  streamed: bool | None = None) -> int:
    """Bytes of memory the loaded weights take at the load's peak, from the files'
    sizes and config.json alone (nothing is read). `streamed`: whether the checkpoint
    loads tensor by tensor (stream_load) or through transformers; None: as
    RUVLLM_STREAM_LOAD says (the loader checks again once it knows)."""
    dtype = dtype_for(quantization, device)
    if config is None:
        return _gguf_memory(path, device, dtype, quantization, layout)
    on_disk = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    file_dtype = _config_dtype(config)
    weights = on_disk // file_dtype.itemsize
    if device.type != "cpu" or not on_disk:
        # The file's dtype to ours: a bf16 checkpoint doubles in float32, and so on.
        return weights * dtype.itemsize
    from ruvllm_cli.engine.quantize import WeightPlan

    embedding, tied, rows, norms, hidden = _shape_counts(config)
    plan = WeightPlan(quantization, dtype, hidden)
    # The loaders' own rule for whether a tied head gets a copy of its own.
    head_copy = embedding if tied and plan.head_copy(embedding // hidden, hidden) else 0
    if quantization in (Quantization.Q8_0, Quantization.Q4_K_M):
        # registry.memory's layout sizes, which `info` shows: measured against
        # `weight_bytes` of the loaded 0.5B shape within 1% (docs/design.md, "Loading").
        # Streamed (stream_load): the quantized model, plus the one tensor being
        # converted; a tied head gets its own quantized copy unless it shares the
        # table. Norms take the activations' dtype; q8 counts a float32 scale per
        # output row in our kernel, fbgemm's scale and zero point (16 bytes) in its.
        loaded = layout_bytes(quantization, weights - norms, embedding, head_copy) + norms * dtype.itemsize
        if quantization is Quantization.Q8_0:
            loaded += rows * (4 if plan.own_int8 else 16)
    elif quantization is Quantization.F16 and dtype == torch.float32:
        loaded = weights * 2   # float16 weights; a tied head shares the embedding's copy (engine/half.py)
    else:
        loaded = (weights + head_copy) * dtype.itemsize  # a tied head's packed copy, where packing works
    if streamed is None:
        streamed = _streaming_on()
    if streamed:
        return int(loaded)
    # transformers' path (design section 9, "transformers' path"): the whole model as
    # built beside what quantizing makes of it. Built in the file's dtype, its weights
    # are the file's mapped pages, all resident by the end; converted, a copy, made
    # while the file is mapped. One embedding table more: q8 widens it whole to
    # quantize it, f16 and none copy it out of the mapping; q4k quantizes it from there.
    build = _build_dtype(config, device, dtype, quantization)
    if build == file_dtype:
        built, held = 0, on_disk
    else:
        held = weights * build.itemsize
        built = on_disk + held
    widens = quantization is Quantization.Q8_0 and build != dtype
    copies = quantization in (Quantization.F16, Quantization.F32) and build == file_dtype
    return int(max(built, held + loaded + (embedding * dtype.itemsize if widens or copies else 0)))


def _gguf_memory(path: Path, device: torch.device, dtype: torch.dtype, quantization: Quantization,
                 layout: GGUFLayout | None = None) -> int:
    """A GGUF file's weights once loaded: each tensor in its layout where it streams
    (gguf_plan), else transformers' path, which dequantizes the whole file first. On
    a CPU that path's peak holds the mapped file, the whole model dequantized in the
    activations' dtype and one tensor (the largest) in float32 as it is dequantized;
    the quantized form comes once the file is let go (design section 9)."""
    from ruvllm_cli.engine import gguf_plan
    from ruvllm_cli.engine.quantize import WeightPlan

    layout = layout if layout is not None else check_gguf(path)
    if device.type != "cpu":
        return path.stat().st_size * (8 if dtype == torch.float32 else 4)   # about: a 4-bit file grows 4x in 16 bits
    if not _gguf_streams(layout):
        sizes = [math.prod(tensor.dims) for tensor in layout.tensors]
        return path.stat().st_size + sum(sizes) * dtype.itemsize + max(sizes, default=0) * 4
    hidden = layout.metadata.get(f"{layout.metadata['general.architecture']}.embedding_length", 1)
    plan = WeightPlan(quantization, dtype, hidden, int4_group=gguf_plan.INT4_GROUP)
    return gguf_plan.loaded_bytes(layout, quantization, dtype.itemsize, plan.head_copy,
                                  int8_row_bytes=4 if plan.own_int8 else 16)


def free_memory(device: torch.device) -> int:
    """Bytes free for new tensors on `device`: the GPU's free memory, else the host's
    available memory, or less where this process's cgroup (a container's --memory, a
    systemd MemoryMax) leaves less: past its limit the kernel kills the process without
    a word, so the memory check must see that limit, not the host's 23 GiB."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    import psutil

    available = int(psutil.virtual_memory().available)
    room = cgroup_room()
    return available if room is None else min(available, room)


def cgroup_room(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes left under this process's cgroup memory limit (v2 or v1), the reclaimable
    page cache counted as room; None where no limit is set or none can be read."""
    for limit_file, usage_file, stat_file, inactive_key in _cgroup_memory_files(proc_cgroup, root):
        try:
            limit_text = limit_file.read_text().strip()
            if limit_text == "max":
                return None
            limit, usage = int(limit_text), int(usage_file.read_text().strip())
        except (OSError, ValueError):
            continue
        if limit >= 1 << 60:   # v1 writes "no limit" as a page-rounded 2^63
            return None
        stats = dict(line.split() for line in _read_lines(stat_file) if len(line.split()) == 2)
        cache = int(stats.get(inactive_key, 0))
        return max(0, limit - (usage - cache))
    return None


def _cgroup_memory_files(proc_cgroup: Path, root: Path) -> list[tuple[Path, Path, Path, str]]:
    """(limit, usage, stat, its inactive page-cache key) for the process's own cgroup,
    then the root of the mount (a container's namespace shows its cgroup as "/")."""
    places: list[tuple[Path, Path, Path, str]] = []
    for line in _read_lines(proc_cgroup):
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        base = root / path.lstrip("/")
        if hierarchy == "0" and not controllers:
            places.append((base / "memory.max", base / "memory.current", base / "memory.stat", "inactive_file"))
        elif "memory" in controllers.split(","):
            v1 = root / "memory" / path.lstrip("/")
            places.append((v1 / "memory.limit_in_bytes", v1 / "memory.usage_in_bytes", v1 / "memory.stat",
                           "total_inactive_file"))
    places.append((root / "memory.max", root / "memory.current", root / "memory.stat", "inactive_file"))
    v1 = root / "memory"
    places.append((v1 / "memory.limit_in_bytes", v1 / "memory.usage_in_bytes", v1 / "memory.stat",
                   "total_inactive_file"))
    return places


def _read_lines(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except OSError:
        return []


def _check_memory(path: Path, config: dict[str, Any] | None, device: torch.device,
                  quantization: Quantization, layout: GGUFLayout | None = None,
                  not_streamed: str | None = None) -> None:
    """Refuse early, with a clear message, a model that cannot fit, naming the
    quantization that would. `not_streamed`: why a checkpoint the first check took
    for streamed goes through transformers instead (a second check, before
    transformers reads the checkpoint)."""
    streamed = None if not_streamed is None else False
    needed = memory_needed(path, config, device, quantization, layout, streamed)
    if not needed:
        return
    free = free_memory(device)
    if needed <= free:
        return
    smaller = ORDER[ORDER.index(quantization) + 1:] if quantization in ORDER else ()
    fits = next(((q, n) for q in smaller
                 if (n := memory_needed(path, config, device, q, layout, streamed)) <= free), None)
    if fits is not None:
        hint = f"--quantization {fits[0].value} needs about {fits[1] / 2**30:.1f} GiB: try it"
    elif smaller:
        least = memory_needed(path, config, device, smaller[-1], layout, streamed)
        hint = f"even --quantization {smaller[-1].value} needs about {least / 2**30:.1f} GiB: try a smaller model"
    else:
        hint = "try a smaller model"
    how = "" if not_streamed is None else \
        f" (it loads through transformers, which holds the whole checkpoint meanwhile: {not_streamed})"
    raise ModelLoadError(f"not enough memory: the weights need about {needed / 2**30:.1f} GiB{how}, "
                         f"{free / 2**30:.1f} GiB is free on {device.type}", hint)


def _shape_counts(config: dict[str, Any]) -> tuple[int, bool, int, int, int]:
    """(weights in the embedding table, whether the LM head is tied to it, output rows
    of all linear layers, norm weights, hidden size), from config.json."""
    from ruvllm_cli.registry.model_config import shape_from_dict

    try:
        shape = shape_from_dict(config)
    except ModelLoadError:
        return 0, False, 0, 0, 1  # from_pretrained will say what is wrong with the config
    attention_rows = (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim + shape.hidden_size
    rows = shape.num_layers * (attention_rows + 2 * shape.intermediate_size + shape.hidden_size)
    norms = (2 * shape.num_layers + 1) * shape.hidden_size
    return (shape.vocab_size * shape.hidden_size, shape.tie_word_embeddings, rows + shape.vocab_size, norms,
            shape.hidden_size)


def _config_dtype(config: dict[str, Any]) -> torch.dtype:
    """The checkpoint's dtype as its config names it (bfloat16 when it says nothing)."""
    name = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    found = getattr(torch, name.replace("torch.", ""), None)
    return found if isinstance(found, torch.dtype) else torch.bfloat16


def _eos_ids(model: Any, tokenizer: Any) -> tuple[int, ...]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))


def load_model(path: str | Path, device: str = "auto",
               quantization: Quantization = Quantization.F16, use_cache: bool = True) -> LoadedModel:
    """Load model + tokenizer from a local directory, with the paged attention; q8/q4k
    read and write the quantized-weight cache unless `use_cache` is False."""
    path = Path(path).expanduser()
    source, config, header = _pretrained_args(path)
    target = select_device(device)
    _check_gguf_device(path, target, quantization)
    dtype = dtype_for(quantization, target)
    _check_memory(path, config, target, quantization, header)
    if target.type == "cpu":
        hold_freed_memory()
    started = time.perf_counter()
    # The tokenizer first: transformers' GGUF reader parses the whole vocabulary (about
    # 250 MiB passing through for 150k tokens), over before the weights arrive.
    caching = use_cache and weight_cache.enabled(quantization, target)
    layout = header if caching else None   # the GGUF tokenizer's copy and weight cache
    tokenizer = _checked_tokenizer(path, use_cache) or (
        _gguf_tokenizer(path, source, layout) if layout is not None else _tokenizer(path, source, config))
    if own_tokenizer.enabled(use_cache) and not isinstance(tokenizer, own_tokenizer.Tokenizer):
        own_tokenizer.save_checked(tokenizer, path)
    extra = _bitsandbytes_options(quantization, target)
    cache = weight_cache.cache_file(path, quantization) if (
        caching and (config is not None or _gguf_streams(layout))) else None
    cached = weight_cache.load(cache, path, dtype, header) if cache is not None else None
    streamed, not_streamed = (cached, None) if cached else _stream(path, config, header, target, dtype, quantization)
    if streamed is not None:
        model, quant_path = streamed
    else:
        if config is not None and target.type == "cpu" and _streaming_on():
            _check_memory(path, config, target, quantization, not_streamed=not_streamed)
        from ruvllm_cli.engine.gguf_load import config_overrides

        overrides = config_overrides(header) if header is not None else {}   # what transformers' reader misses
        model = _from_pretrained(path, source, _build_dtype(config, target, dtype, quantization),
                                 {**extra, **overrides})
        quant_path = _quantize_loaded(model, quantization, target, bool(extra), dtype)
    _check_attention(model)
    if path.suffix == ".gguf" and streamed is None:
        quant_path = (f"GGUF {path.name} through transformers ({not_streamed}), which dequantizes the whole "
                      f"file, then {quant_path}")
    written = None
    if cache is not None and cached is None and weight_cache.save(model, cache, quant_path, _cache_metadata(header)):
        written = cache
    release_freed_memory()
    load_seconds = time.perf_counter() - started
    from ruvllm_cli.engine.quantize import kernel_note

    # The kernels are the machine's choice, not the cached weights': said after the save.
    # Descriptions cached before this note named a kernel in them.
    for before, now in ((" (torch int4pack kernel)", " (torch's int4pack layout)"),
                        (" in ruvllm's AVX2 kernel, ", " in ruvllm's kernel, ")):
        quant_path = quant_path.replace(before, now)
    quant_path += kernel_note(model)
    if cached is not None:
        quant_path += "; read from the quantized-weight cache"
    return LoadedModel(model=model, tokenizer=tokenizer, device=target, dtype=dtype,
                       quantization=quantization, load_seconds=load_seconds,
                       weight_bytes=weight_bytes(model), eos_token_ids=_eos_ids(model, tokenizer),
                       max_context=int(getattr(model.config, "max_position_embeddings", 4096) or 4096),
                       quantization_path=quant_path, streamed=streamed is not None,
                       from_weight_cache=cached is not None, weight_cache_written=written,
                       sampling_defaults=model_sampling_defaults(
                           path, header.metadata if header is not None else None))


def _streaming_on() -> bool:
    """Whether loads may go tensor by tensor at all (RUVLLM_STREAM_LOAD is not 0)."""
    return os.environ.get(STREAM_ENV, "1") != "0"


def _gguf_streams(layout: GGUFLayout) -> bool:
    """Whether a GGUF file loads tensor by tensor (so its weight cache can be read back)."""
    from ruvllm_cli.engine import gguf_plan

    return gguf_plan.unstreamable(layout) is None and _streaming_on()


def _build_dtype(config: dict[str, Any] | None, target: torch.device, dtype: torch.dtype,
                 quantization: Quantization) -> torch.dtype:
    """The dtype transformers' path builds the whole model in. q8 on a CPU (float32
    activations) keeps a 16-bit checkpoint's own dtype: `quantize_model` widens each
    weight as it quantizes it (exactly: the values the streamed loader reads), which
    takes a third off that path's peak at 1.5B (design section 9); everything else is
    built in `dtype`."""
    if config is not None and target.type == "cpu" and quantization is Quantization.Q8_0 and \
            dtype == torch.float32 and _config_dtype(config) in (torch.bfloat16, torch.float16):
        return _config_dtype(config)
    return dtype


def _quantize_loaded(model: Any, quantization: Quantization, target: torch.device, bitsandbytes: bool,
                     dtype: torch.dtype) -> str:
    """transformers' path: the loaded model moved and quantized in place, its
    activations in `dtype`."""
    from ruvllm_cli.engine.quantize import quantize_model

    if not bitsandbytes:
        model.to(target)
    model.eval()
    quant_path = quantize_model(model, quantization, target, dtype)
    if target.type == "cpu":
        # After quantizing: packed and quantized layers are already fresh copies, so
        # only what is left (embeddings, norms, biases, unpacked layers) is copied.
        _own_weights(model)
    return quant_path


def _cache_metadata(header: GGUFLayout | None) -> dict[str, str] | None:
    """What a GGUF file's weight cache keeps for its skeleton (gguf_load.cache_metadata)."""
    if header is None:
        return None
    from ruvllm_cli.engine.gguf_load import cache_metadata

    return cache_metadata(header)


def _stream(path: Path, config: dict[str, Any] | None, header: GGUFLayout | None, device: torch.device,
            dtype: torch.dtype, quantization: Quantization) -> tuple[tuple[Any, str] | None, str | None]:
    """The model loaded one module (or GGUF tensor) at a time (`stream_load`,
    `gguf_load`), or None and why it takes transformers' path: other devices,
    checkpoints whose names differ, GGUF architectures not mapped."""
    from ruvllm_cli.engine.gguf_load import stream_gguf
    from ruvllm_cli.engine.stream_load import NotStreamable, stream_load

    if device.type != "cpu":
        return None, f"on {device.type}"
    if not _streaming_on():
        return None, f"{STREAM_ENV}=0"
    try:
        if config is None:
            return stream_gguf(path, header if header is not None else check_gguf(path), dtype, quantization), None
        return stream_load(path, dtype, quantization), None
    except NotStreamable as error:
        log.debug("streamed load of %s not used: %s", path, error)
        return None, str(error)
    except Exception as error:  # noqa: BLE001 - transformers' path loads it, or says what is wrong
        log.debug("streamed load of %s not used: %s", path, error, exc_info=True)
        return None, f"{type(error).__name__}: {_first_line(error)}"


@contextmanager
def _transformers_errors(path: Path) -> Iterator[None]:
    """Whatever transformers raises on a bad file (tokenizer or model) becomes one
    ModelLoadError line."""
    try:
        yield
    except ValueError as error:
        raise ModelLoadError(f"unsupported model in {path}: {_first_line(error)}") from None
    except OSError as error:
        raise ModelLoadError(f"cannot load the model in {path}: {_first_line(error)}") from None
    except Exception as error:  # noqa: BLE001 - a file transformers cannot build a model from
        raise ModelLoadError(f"cannot load the model in {path}: {_build_failure(error)}",
                             "the file may be damaged: download it again") from error


def quiet_transformers() -> None:
    """transformers' progress bars and advice lines off, before any of its code runs:
    our own output says what is happening, and its advice is not for our users."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def _quiet_gguf_reader() -> None:
    """transformers' GGUF reader draws its own tqdm bar ("Converting and de-quantizing
    GGUF tensors"), which disable_progress_bar does not reach: its module's `tqdm`,
    disabled (the one bar that module draws)."""
    import functools

    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_reader
        from tqdm.auto import tqdm
    except ImportError:   # no gguf package: no GGUF file loads through transformers
        return
    if getattr(gguf_reader, "tqdm", None) is tqdm:
        gguf_reader.tqdm = functools.partial(tqdm, disable=True)


def _checked_tokenizer(path: Path, use_cache: bool) -> own_tokenizer.Tokenizer | None:
    """ruvllm's tokenizer where an earlier load checked it against transformers' for
    this model (engine/tokenizer.py): no transformers import on the way to the prompt."""
    return own_tokenizer.load(path) if own_tokenizer.enabled(use_cache) else None


# The files a tokenizer is built from (transformers' fast and slow tokenizers).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "vocab.txt", "tekken.json")


def _tokenizer(path: Path, source: dict[str, Any], config: dict[str, Any] | None) -> Any:
    """transformers' tokenizer. AutoTokenizer reads the model's config to pick the
    class; for the families of our own model classes it gets their config, since
    AutoConfig would import transformers' modeling stack (docs/design.md, section 8)."""
    if path.is_dir() and not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ModelLoadError(f"no tokenizer in {path}: none of {', '.join(TOKENIZER_FILES)}",
                             "the model's files are incomplete: download it again")
    quiet_transformers()
    from transformers import AutoTokenizer

    from ruvllm_cli.engine import native

    if config is not None and native.unsupported(config) is None:
        source = {**source, "config": native.NativeConfig.from_dict(config, str(path))}
    with _transformers_errors(path):
        return AutoTokenizer.from_pretrained(**source)


def _gguf_tokenizer(path: Path, source: dict[str, Any], layout: GGUFLayout) -> Any:
    """A GGUF file's tokenizer, kept beside its weight cache: transformers builds it from
    the file's metadata in Python (5-6 s and some 250 MiB passing through for a 150k
    vocabulary), a saved copy loads in a fraction of a second. The copy is kept only if
    it loads back as the same tokenizer (weight_cache.save_tokenizer)."""
    quiet_transformers()
    from transformers import AutoTokenizer

    from ruvllm_cli.engine.native import NativeConfig

    saved = weight_cache.tokenizer_dir(path)
    # AutoTokenizer picks the class by the model type; the GGUF architecture names it.
    config = NativeConfig({"model_type": layout.metadata.get("general.architecture", ""),
                           "_name_or_path": ""})
    if saved.is_dir():
        with contextlib.suppress(Exception):   # a damaged copy: build it from the file again
            with _transformers_errors(path):
                return AutoTokenizer.from_pretrained(saved, config=config)
    tokenizer = _tokenizer(path, source, None)
    weight_cache.save_tokenizer(tokenizer, saved, lambda where: AutoTokenizer.from_pretrained(where, config=config))
    return tokenizer


def _from_pretrained(path: Path, source: dict[str, Any], dtype: torch.dtype, extra: dict[str, Any]) -> Any:
    """The model through transformers; a file that lacks weights is refused
    (transformers would fill them with random values)."""
    quiet_transformers()
    if "gguf_file" in source:
        _quiet_gguf_reader()
    from transformers import AutoModelForCausalLM

    with _transformers_errors(path):
        model, info = AutoModelForCausalLM.from_pretrained(
            **source, dtype=dtype, attn_implementation=attention.register(), output_loading_info=True, **extra)
    missing = sorted(info["missing_keys"])
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ModelLoadError(f"{path} lacks weights the model needs: {missing[0]}{more}",
                             "the file is damaged or incomplete: download it again")
    return model


def _check_attention(model: torch.nn.Module) -> None:
    """Refuse what the paged attention does not compute, rather than answer wrongly:
    attention sinks (gpt-oss's per-head `sinks`)."""
    if any(isinstance(getattr(module, "sinks", None), torch.Tensor) for module in model.modules()):
        raise ModelLoadError("this model's attention has sinks (gpt-oss), which ruvllm's paged attention "
                             "does not compute yet")


def _build_failure(error: Exception) -> str:
    text = _first_line(error)
    if "ignore_mismatched_sizes" in text:  # its report of which weights went to the log we silence
        return "its weights do not have the shapes its configuration gives"
    return f"{type(error).__name__}: {text}"


def _first_line(error: BaseException) -> str:
    """The message's first line, with the next one when it only introduces it ("...:")."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    return f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]


@torch.no_grad()
def _own_weights(model: torch.nn.Module) -> None:
    """Copy weights that still map the safetensors file into process memory.

    Matmuls over file-backed pages ran 12% slower here (decode 69 vs 61 ms per token
    on the Qwen2.5-0.5B shape): page-cache pages get no transparent huge pages."""
    copies: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}
    for tensor in [*model.parameters(), *model.buffers()]:   # a table shared by two modules: one copy
        key = (tensor.data_ptr(), tuple(tensor.shape))
        if key not in copies:
            copies[key] = tensor.data.clone()
        tensor.data = copies[key]


def _check_gguf_device(path: Path, device: torch.device, quantization: Quantization) -> None:
    """On CUDA, q8/q4k mean bitsandbytes, which transformers will not combine with a GGUF file."""
    if path.suffix == ".gguf" and device.type == "cuda" and quantization in (Quantization.Q8_0,
                                                                              Quantization.Q4_K_M):
        raise ModelLoadError(f"-q {quantization.value} on CUDA quantizes through bitsandbytes, which cannot read "
                             f"a GGUF file ({path.name})",
                             "load it with -q f16 on the GPU, or with --device cpu, or use the safetensors model")


def _bitsandbytes_options(quantization: Quantization, device: torch.device) -> dict[str, Any]:
    """On CUDA, q8/q4k load through bitsandbytes (8-bit, and 4-bit NF4)."""
    if device.type != "cuda" or quantization not in (Quantization.Q8_0, Quantization.Q4_K_M):
        return {}
    from transformers import BitsAndBytesConfig

    if quantization is Quantization.Q8_0:
        config = BitsAndBytesConfig(load_in_8bit=True)
    else:
        config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                    bnb_4bit_compute_dtype=torch.float16)
    return {"quantization_config": config, "device_map": {"": device.index or 0}}


def decode_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights a decode step reads: weight_bytes less the input embedding's
    tensors that no other module reads (a step reads one row of those a token). A head
    that shares the embedding's storage (q8, q4k, f16 tied) keeps it counted; a head of
    its own beside it (float32's packed copy, an untied model) does not."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embedding is None:
        return weight_bytes(model)
    inside = {id(module) for module in embedding.modules()}
    elsewhere = {tensor.data_ptr() for module in model.modules() if id(module) not in inside
                 for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]}
    own = {tensor.data_ptr(): tensor.numel() * tensor.element_size()
           for tensor in [*embedding.parameters(), *embedding.buffers()] if tensor.data_ptr() not in elsewhere}
    return weight_bytes(model) - sum(own.values()) - getattr(embedding, "quantized_nbytes", 0)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes the model's parameters and buffers really take (tied weights once)."""
    seen: set[int] = set()
    total = sum(getattr(m, "quantized_nbytes", 0) for m in model.modules())
    for tensor in [*model.parameters(), *model.buffers()]:
        key = tensor.data_ptr()
        if key in seen:
            continue
        seen.add(key)
        total += tensor.numel() * tensor.element_size()
    return total
