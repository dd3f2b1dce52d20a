"""Streamed loading of a safetensors checkpoint on a CPU: each weight goes from the
file to its final form (packed, int8, int4, or a plain copy) on its own.

transformers' `from_pretrained` materialises the whole model in 16 or 32 bits before
`quantize_model` converts it, so a load peaked at the unquantized model plus its
converted copy plus the file's mapped pages (3.5 GiB for a 0.6 GiB q8 model). Here the
model is built with its parameters on the meta device, and one module at a time is
read (a fresh memory map per module, released with it), converted through the same
`WeightPlan` that `quantize_model` follows, and put in place: the weights exist in
two forms for one layer at a time, never for the whole model.

Only checkpoints whose tensor names are exactly the model's parameter names stream
(Llama, Qwen2, Mistral, Phi-3 and most decoder-only families); anything else
(renamed or fused keys, fp32-kept modules, CUDA) raises `NotStreamable` and the
loader takes transformers' own path, which also reports missing or damaged weights.
`fill_model` reads through a `WeightSource`: this module's safetensors one, or a GGUF
file's (engine/gguf_load.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from ruvllm_cli.engine.quantize import CHUNK_VALUES, RowBlocks, WeightPlan, set_input_embeddings
from ruvllm_cli.quantization import Quantization

INDEX_FILE = "model.safetensors.index.json"


class NotStreamable(Exception):
    """This checkpoint takes transformers' loading path (the message says why)."""


def checkpoint_files(path: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it."""
    from safetensors import safe_open

    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise NotStreamable(f"unreadable {INDEX_FILE}: {error}") from None
        return {name: path / file for name, file in weight_map.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise NotStreamable("no safetensors files")
    names: dict[str, Path] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt", device="cpu") as handle:
                names.update(dict.fromkeys(handle.keys(), file))
        except Exception as error:  # noqa: BLE001 - a damaged header: transformers' path reports it
            raise NotStreamable(f"{file.name}: {error}") from None
    return names


def _read(files: dict[str, Path], names: list[str]) -> dict[str, torch.Tensor]:
    """The named tensors, mapped from their files (pages are read when first touched,
    and leave the process's memory when the tensors are dropped)."""
    from safetensors import safe_open

    tensors: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(files[name], []).append(name)
    for file, file_names in by_file.items():
        with safe_open(file, framework="pt", device="cpu") as handle:
            for name in file_names:
                tensors[name] = handle.get_tensor(name)
    return tensors


class FileRows:
    """A 2-D tensor of a safetensors file, read a block of rows at a time, each block
    through a mapping of its own: the quantizers see the whole matrix (as a
    `quantize.RowBlocks`) while at most one block of its file pages is resident
    (the 0.5B shape's embedding table is 272 MiB in bf16)."""

    def __init__(self, file: Path, name: str, dtype: torch.dtype) -> None:
        from safetensors import safe_open

        self.file, self.name, self.dtype = file, name, dtype
        with safe_open(file, framework="pt", device="cpu") as handle:
            rows, columns = handle.get_slice(name).get_shape()
        self.shape = (rows, columns)

    def blocks(self, rows: int) -> Iterator[torch.Tensor]:
        from safetensors import safe_open

        for start in range(0, self.shape[0], rows):
            with safe_open(self.file, framework="pt", device="cpu") as handle:
                block = handle.get_slice(self.name)[start:start + rows]
            yield block.to(self.dtype)


class SafetensorsSource:
    """A safetensors checkpoint as a `WeightSource`: its tensor names are the model's."""

    def __init__(self, path: Path) -> None:
        self.files = checkpoint_files(path)

    def names(self) -> set[str]:
        return set(self.files)

    def tensor(self, name: str, dtype: torch.dtype | None) -> torch.Tensor:
        """The named tensor in `dtype` (None: as stored, a view of the file's pages)."""
        tensor = _read(self.files, [name])[name]
        return tensor if dtype is None else tensor.to(dtype)

    def matrix(self, name: str, dtype: torch.dtype | None, plan: WeightPlan) -> torch.Tensor | RowBlocks:
        """A weight matrix for `plan`: block by block where it is quantized (row blocks
        are all its quantizers need), else whole."""
        if plan.quantized and dtype is not None:
            rows = FileRows(self.files[name], name, dtype)
            if rows.shape[0] * rows.shape[1] > CHUNK_VALUES:   # a float32 copy of it whole would be transient
                return rows
        return self.tensor(name, dtype)


class WeightSource(Protocol):
    """Where `fill_model` reads the weights, by the model's own parameter names."""

    def names(self) -> set[str]: ...

    def tensor(self, name: str, dtype: torch.dtype | None) -> torch.Tensor: ...

    def matrix(self, name: str, dtype: torch.dtype | None, plan: WeightPlan) -> torch.Tensor | RowBlocks: ...


def _skeleton(path: Path, dtype: torch.dtype) -> Any:
    """The model with every parameter on the meta device; buffers computed at
    construction (rotary frequencies) are real. Our own classes for the Llama family
    (engine/native.py), transformers' for the rest."""
    from ruvllm_cli.engine import native

    model = native.skeleton(path, dtype)
    return model if model is not None else _stock_skeleton(path, dtype)


def _stock_skeleton(path: Path, dtype: torch.dtype) -> Any:
    from ruvllm_cli.engine.loader import quiet_transformers

    quiet_transformers()
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from ruvllm_cli.engine import attention

    config = AutoConfig.from_pretrained(path)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attention.register())
    if getattr(model, "_keep_in_fp32_modules", None) or getattr(model, "_keep_in_fp32_modules_strict", None):
        raise NotStreamable(f"{type(model).__name__} keeps some modules in float32")
    if (path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(path)
    model.tie_weights()  # as the config says: a tied head is the embedding's parameter
    return model


@torch.no_grad()
def stream_load(path: Path, dtype: torch.dtype, quantization: Quantization) -> tuple[Any, str]:
    """The model, built from `path`'s safetensors one module at a time, and the
    one-line description `quantize_model` would give of it."""
    source = SafetensorsSource(path)
    model = _skeleton(path, dtype)
    plan = WeightPlan(quantization, dtype, model.config.hidden_size)
    fill_model(model, source, plan)
    return model, plan.describe()


def check_names(model: nn.Module, names: set[str]) -> None:
    """NotStreamable unless the checkpoint holds exactly the model's parameters."""
    params = dict(model.named_parameters())          # tied parameters once, under their first name
    missing = sorted(set(params) - names)
    unexpected = sorted(names - set(dict(model.named_parameters(remove_duplicate=False))))
    if missing or unexpected:
        raise NotStreamable(f"checkpoint names differ from the model's: {(missing + unexpected)[:3]}")


@torch.no_grad()
def fill_model(model: Any, source: WeightSource, plan: WeightPlan) -> None:
    """Put every parameter of the meta-device `model` in place from `source`, one
    module at a time, each weight turned straight into its form under `plan`."""
    check_names(model, source.names())
    embeddings, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and head.weight is embeddings.weight
    if tied and plan.unties_head:
        model.config.tie_word_embeddings = False
    for module_name, module in list(model.named_modules()):
        own = list(module.named_parameters(recurse=False))
        if not own or (module is head and tied):
            continue  # a tied head is built with the embedding, from the same tensor
        prefix = f"{module_name}." if module_name else ""
        if isinstance(module, nn.Linear):
            _load_linear(model, module_name, module, source, plan)
            release_freed_memory()
        elif module is embeddings:
            _load_embedding(model, module_name, module, source, plan, head if tied else None)
            release_freed_memory()
        else:
            for name, param in own:
                tensor = _checked(prefix + name, source.tensor(prefix + name, param.dtype), param)
                module._parameters[name] = _plain(tensor, param.dtype)
    if tied and not plan.unties_head:
        model.tie_weights()
    model.eval()


def release_freed_memory() -> None:
    """Hand the allocator's freed pages back to the system. glibc keeps them: 170 MiB
    of a 0.5B q8 load's temporaries stayed resident after the load, and during a
    GGUF q8 load the heap grew by each layer's temporaries (a peak of 1,351 MiB against
    1,090 with this after each weight matrix; 0.3 s for the model's 169)."""
    _glibc_call("malloc_trim", 0)


def _glibc_call(name: str, *args: int) -> None:
    """glibc's `name(*args)` on Linux; elsewhere (musl, other systems) nothing."""
    import ctypes
    import sys

    if sys.platform.startswith("linux"):
        try:
            getattr(ctypes.CDLL("libc.so.6"), name)(*args)
        except (OSError, AttributeError):  # not glibc: nothing to do
            pass


# glibc's mallopt parameters, and the values the engine sets (hold_freed_memory).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 64 << 20
_policy = {"hold": True}


def keep_returning_freed_memory() -> None:
    """For a process that loads and unloads several models (the server's model pool):
    hold_freed_memory does nothing there, so an unloaded model's memory goes back
    (tests/server/test_multi_model.py holds RSS within 10% over load/unload cycles; with
    the thresholds fixed it grew 11%)."""
    _policy["hold"] = False


def hold_freed_memory() -> None:
    """Keep a step's freed temporaries in the heap for the next step. glibc serves
    blocks over its mmap threshold from fresh mappings, returned on free, and only
    raises that threshold as mapped blocks are freed: a process whose first large
    frees came late kept mapping, faulting and zeroing a prompt's 10 MiB temporaries
    anew (0.5B q8, 512-token prompt, two runs alternated: 908-980 ms, 664k page
    faults over 7 prompts; with 32/64 MiB thresholds 670-681 ms, 145k; transformers'
    classes 675-680 ms). The loader still hands pages back after each weight
    (release_freed_memory)."""
    if _policy["hold"]:
        _glibc_call("mallopt", _M_MMAP_THRESHOLD, MMAP_THRESHOLD)
        _glibc_call("mallopt", _M_TRIM_THRESHOLD, TRIM_THRESHOLD)


def _checked(name: str, found: Any, param: torch.Tensor) -> Any:
    """`found` (a tensor or a block reader), if its shape is the parameter's; the
    meta model does not check what replaces its parameters."""
    if tuple(found.shape) != tuple(param.shape):
        raise NotStreamable(f"{name} has shape {tuple(found.shape)} where the config gives {tuple(param.shape)}")
    return found


def _plain(tensor: torch.Tensor, dtype: torch.dtype) -> nn.Parameter:
    # A copy in process memory, never a view of the file's pages (design: _own_weights).
    return nn.Parameter(tensor.to(dtype, copy=True), requires_grad=False)


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def _load_linear(model: nn.Module, name: str, linear: nn.Linear, source: WeightSource,
                 plan: WeightPlan) -> None:
    dtype = linear.weight.dtype
    weight = _checked(f"{name}.weight", source.matrix(f"{name}.weight", plan.read_dtype(dtype), plan), linear.weight)
    bias = None if linear.bias is None else _checked(f"{name}.bias", source.tensor(f"{name}.bias", dtype),
                                                      linear.bias)
    replacement = plan.linear(weight, bias)
    if replacement is not None:
        _set_module(model, name, replacement)
        return
    assert isinstance(weight, torch.Tensor)  # only quantized plans read by blocks
    linear.weight = _plain(weight, dtype)   # as stored, or in the model's dtype
    if bias is not None:
        linear.bias = _plain(bias, dtype)


def _load_embedding(model: Any, name: str, embedding: nn.Module, source: WeightSource,
                    plan: WeightPlan, tied_head: nn.Linear | None) -> None:
    dtype = embedding.weight.dtype
    weight = _checked(f"{name}.weight", source.matrix(f"{name}.weight", plan.read_dtype(dtype), plan),
                      embedding.weight)
    if tied_head is not None and plan.unties_head:
        head_name = next(n for n, m in model.named_modules() if m is tied_head)
        if tied_head.bias is not None:
            raise NotStreamable("a tied LM head with a bias")
        head = plan.tied_head(weight)
        if head is None:
            raise NotStreamable("the LM head's weights do not fit the plan's layout")
        _set_module(model, head_name, head)
    replacement = plan.embedding(weight, getattr(embedding, "padding_idx", None))
    if replacement is not None:
        set_input_embeddings(model, replacement)
    else:
        assert isinstance(weight, torch.Tensor)  # only quantized plans read by blocks
        embedding.weight = _plain(weight, dtype)
