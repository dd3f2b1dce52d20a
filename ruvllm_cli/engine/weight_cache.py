"""The quantized-weight cache: q8/q4k models saved after their first load, so later
loads read int8/int4 tensors instead of quantizing again.

One safetensors file per quantization in `<model dir>/.ruvllm-weights/`, named by
the quantization, `LAYOUT` (bumped whenever a quantized module's tensors change
meaning) and a key of the checkpoint's files (names, sizes, modification times) and
config.json, so a changed checkpoint or a new layout never reads a stale file. A
GGUF file's go beside it, in the same directory, named also by the file's name and
keyed by its size and time: without them every start requantized the file's blocks
(15 s for the 0.5B shape's Q4_K_M, minutes at 7B). The
file is written under a temporary name and renamed into place: a killed write
leaves at most a temporary file, never a partial cache file that a load would use.
Removing the model (`ruvllm rm`) removes its directory and so its cache.

A cache file holds every module's tensors under the module's name (int8 codes and
scales for fbgemm's layers, whose packed form cannot be saved, is re-packed at load),
and in its metadata each quantized module's kind and settings, and the activations'
dtype it was built for. An embedding that shares a tied head's int8 table is saved
as a reference to the head, and shares it again when loaded.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ruvllm_cli.engine.int8 import Int8Linear, int8_linear
from ruvllm_cli.engine.quantize import (DynamicInt8Linear, Int4Embedding, Int4Linear, Int4TiedEmbedding,
                                        Int8Embedding, set_input_embeddings)
from ruvllm_cli.paths import WEIGHT_CACHE_DIR
from ruvllm_cli.quantization import Quantization

log = logging.getLogger(__name__)

# 3: an untied q8 table's scales in the activations' dtype (float32 beside our int8 kernel);
# 4: a tied q4k head in groups of 32, its embedding reading the head's packed table;
# 5: q4k's linear layers in groups of 64, every int4 group's scale and low fitted (quantize.int4_groups).
LAYOUT = 5
CACHE_DIR = WEIGHT_CACHE_DIR
ENV = "RUVLLM_WEIGHT_CACHE"  # "0": neither read nor write the cache
CACHED = (Quantization.Q8_0, Quantization.Q4_K_M)
KINDS = {cls.__name__: cls for cls in (DynamicInt8Linear, Int8Linear, Int4Linear, Int8Embedding, Int4Embedding,
                                       Int4TiedEmbedding)}
SHARES = "shares"   # an embedding's setting: the name of the int8 or int4 head whose table it reads


def enabled(quantization: Quantization, device: torch.device) -> bool:
    return quantization in CACHED and device.type == "cpu" and os.environ.get(ENV, "1") != "0"


def cache_file(model_path: Path, quantization: Quantization) -> Path:
    """Where this checkpoint's (a model directory's or a GGUF file's) weights at
    `quantization` are cached. q4k's key holds how torch packs int4 codes here
    (`int4_dense.pack_signature`): torch's packed bytes differ by CPU capability, so a
    model directory shared by an AVX-512 and an AVX2 machine (or a process under
    another ATEN_CPU_CAPABILITY) never reads the other's file as its own."""
    packing = _packing(quantization)
    if model_path.suffix == ".gguf":
        stat = model_path.stat()
        key = hashlib.sha256(f"{model_path.name}\0{stat.st_size}\0{stat.st_mtime_ns}{packing}".encode()).hexdigest()
        file_tag = hashlib.sha256(model_path.name.encode()).hexdigest()[:8]   # no "-": save() globs by prefix
        return model_path.parent / CACHE_DIR / f"{quantization.value}.gguf{file_tag}-layout{LAYOUT}-{key[:16]}.safetensors"
    digest = hashlib.sha256()
    for file in sorted(model_path.glob("*.safetensors")) + [model_path / "config.json"]:
        stat = file.stat()
        digest.update(f"{file.name}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
    digest.update((model_path / "config.json").read_bytes() + packing.encode())
    return model_path / CACHE_DIR / f"{quantization.value}-layout{LAYOUT}-{digest.hexdigest()[:16]}.safetensors"


def _packing(quantization: Quantization) -> str:
    """What, beyond the checkpoint, a quantization's cached tensors depend on: q4k's
    packed int4 layout ("" for the others: int8 codes are plain rows)."""
    if quantization is not Quantization.Q4_K_M:
        return ""
    from ruvllm_cli.engine.int4_dense import pack_signature
    from ruvllm_cli.engine.quantize import INT4_INNER_K_TILES

    return f"\0int4pack {pack_signature(INT4_INNER_K_TILES)}"


def tokenizer_dir(gguf_path: Path) -> Path:
    """Where a GGUF file's tokenizer is kept (saved by transformers), keyed as its weights."""
    weights = cache_file(gguf_path, Quantization.Q8_0)   # "q8.gguf<name hash>-layout<n>-<key>.safetensors"
    return weights.with_name("tokenizer." + weights.stem.split(".", 1)[1])


def save_tokenizer(tokenizer: Any, where: Path, load: Any) -> None:
    """Save `tokenizer` (transformers') to the directory `where` if it loads back, by
    `load(directory)`, as the same tokenizer: class, backend (its whole JSON), special
    tokens, chat template and a probe's ids; else keep nothing. Written under a
    temporary name and renamed into place; a failure only costs the next load time."""
    import shutil

    temporary = where.with_name(f".{where.name}.{os.getpid()}.tmp")
    try:
        where.parent.mkdir(exist_ok=True)
        for stale in where.parent.glob(f"{where.name.split('-')[0]}-*"):
            shutil.rmtree(stale, ignore_errors=True)   # this file's copies for older versions of it
        tokenizer.save_pretrained(temporary)
        if _same_tokenizer(tokenizer, load(temporary)):
            os.replace(temporary, where)
        else:
            log.info("the tokenizer of %s was not kept: it does not load back the same", where)
    except Exception as error:  # noqa: BLE001 - a read-only directory, a tokenizer that cannot be saved
        log.info("the tokenizer was not kept in %s: %s", where.parent, error)
    finally:
        shutil.rmtree(temporary, ignore_errors=True)


def _same_tokenizer(a: Any, b: Any) -> bool:
    """The same class, backend JSON and chat template, and the same answers to the probes
    ruvllm's own tokenizer is checked with (engine/tokenizer.py, `differs`)."""
    from ruvllm_cli.engine.tokenizer import differs

    return (type(a) is type(b) and a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()
            and a.chat_template == b.chat_template and differs(a, b) is None)


def _module_tensors(module: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A quantized module's tensors and settings, from which `_rebuild` makes it again."""
    if isinstance(module, DynamicInt8Linear):
        qweight, bias = torch.ops.quantized.linear_unpack(module.packed)
        tensors = {"codes": qweight.int_repr(), "scales": qweight.q_per_channel_scales().float()}
        if bias is not None:
            tensors["bias"] = bias
        return tensors, {}
    if isinstance(module, Int4Linear):
        tensors = {"qweight": module.qweight, "scales_and_zeros": module.scales_and_zeros}
        if module.bias is not None:
            tensors["bias"] = module.bias.detach()
        return tensors, {"group_size": module.group_size, "in_features": module.in_features,
                         "out_features": module.out_features}
    if isinstance(module, Int8Linear):
        tensors = {"qweight": module.qweight, "scales": module.scales}
        if module.bias is not None:
            tensors["bias"] = module.bias.detach()
        return tensors, {}
    settings = {"padding_idx": module.padding_idx, "num_embeddings": module.num_embeddings,
                "embedding_dim": module.embedding_dim}
    if isinstance(module, Int4Embedding):
        settings["group_size"] = module.group_size
    return dict(module.named_buffers()), settings


def _rebuild(kind: str, tensors: dict[str, torch.Tensor], settings: dict[str, Any]) -> nn.Module:
    cls = KINDS[kind]
    module = cls.__new__(cls)
    nn.Module.__init__(module)
    if cls is DynamicInt8Linear:
        module._build_from_codes(tensors["codes"], tensors["scales"], tensors.get("bias"))
        return module
    if cls is Int8Linear:
        layer = int8_linear(tensors["qweight"], tensors["scales"], tensors.get("bias"))
        if layer is None:
            raise ValueError("ruvllm's int8 kernel does not run here")
        return layer
    if cls is Int4Linear:
        module.in_features, module.out_features = settings["in_features"], settings["out_features"]
        module.group_size = settings["group_size"]
        module.register_buffer("qweight", tensors["qweight"])
        module.register_buffer("scales_and_zeros", tensors["scales_and_zeros"])
        bias = tensors.get("bias")
        module.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        return module
    for name, tensor in tensors.items():
        module.register_buffer(name, tensor)
    for name, value in settings.items():
        setattr(module, name, value)
    return module


def save(model: nn.Module, path: Path, description: str, extra: dict[str, str] | None = None) -> bool:
    """Write the loaded model's weights to `path` (atomically), and say whether it was
    written; a failure to write (read-only model directory, full disk) only costs the
    next load its speed.
    `extra`: metadata the load hands back to the skeleton (a GGUF file's config fields)."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    kinds: dict[str, list[Any]] = {}
    heads = {m.qweight.data_ptr(): n for n, m in model.named_modules() if isinstance(m, (Int8Linear, Int4Linear))}
    for name, module in model.named_modules():
        if isinstance(module, (Int8Embedding, Int4TiedEmbedding)) and module.qweight.data_ptr() in heads:
            kinds[name] = [type(module).__name__, {SHARES: heads[module.qweight.data_ptr()],
                                                   "padding_idx": module.padding_idx}]
            continue
        if type(module).__name__ in KINDS:
            own, settings = _module_tensors(module)
            kinds[name] = [type(module).__name__, settings]
            tensors.update({f"{name}.{key}": value.contiguous() for key, value in own.items()})
            continue
        for key, param in module.named_parameters(recurse=False):
            tensors[f"{name}.{key}" if name else key] = param.detach().contiguous()
    dtype = str(next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32))
    metadata = {"ruvllm_layout": str(LAYOUT), "modules": json.dumps(kinds), "description": description,
                "dtype": dtype,
                "tie_word_embeddings": json.dumps(bool(getattr(model.config, "tie_word_embeddings", False))),
                **(extra or {})}
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(exist_ok=True)
        for stale in path.parent.glob(f"{path.name.split('-')[0]}-*.safetensors"):
            stale.unlink(missing_ok=True)  # this quantization's files for older checkpoints or layouts
        save_file(tensors, temporary, metadata=metadata)
        with open(temporary, "rb") as written:
            os.fsync(written.fileno())
        os.replace(temporary, path)
        return True
    except OSError as error:
        log.info("the quantized weights were not cached in %s: %s", path.parent, error)
        with contextlib.suppress(OSError):
            temporary.unlink(missing_ok=True)
        return False


@torch.no_grad()
def load(path: Path, model_path: Path, dtype: torch.dtype, layout: Any = None) -> tuple[Any, str] | None:
    """The model rebuilt from a cache file, or None when there is none (or it does
    not fit this model: then it is ignored). `layout`: a GGUF file's header, as the
    load already read it."""
    from ruvllm_cli.engine.stream_load import _set_module

    if not path.is_file():
        return None
    try:
        reader = _Reader(path)
        metadata, names = reader.metadata, reader.names
        if metadata.get("ruvllm_layout") != str(LAYOUT) or metadata.get("dtype") != str(dtype):
            return None  # another layout, or built for other activations (kernels differ per machine)
        kinds: dict[str, list[Any]] = json.loads(metadata["modules"])
        model = _skeleton(model_path, dtype, layout, metadata)
        if json.loads(metadata["tie_word_embeddings"]) is False:
            model.config.tie_word_embeddings = False
        modules = dict(model.named_modules())
        embeddings_name = _name_of(model.get_input_embeddings(), modules)
        head_name = _name_of(model.get_output_embeddings(), modules)
        # The vocabulary matrices first: their transient copies (fbgemm packs a copy of
        # the codes) then come on top of an almost empty model, not of a loaded one.
        order = sorted(kinds, key=lambda name: name not in (embeddings_name, head_name))

        def place(name: str, module: nn.Module) -> None:
            if name == embeddings_name:
                set_input_embeddings(model, module)
            else:
                _set_module(model, name, module)

        # fbgemm's packing is most of a q8 load and runs 1.7x faster on two threads
        # here: the layers after the vocabulary ones are rebuilt by a small pool, with
        # a bounded number in flight (their codes are mapped file pages until packed).
        workers = max(1, torch.get_num_threads())
        with ThreadPoolExecutor(workers, thread_name_prefix="ruvllm-unpack") as pool:
            pending: deque[tuple[str, Future[nn.Module]]] = deque()
            for name in order:
                kind, settings = kinds[name]
                if SHARES in settings:
                    continue  # placed below, once its head is
                prefix = f"{name}."
                # fbgemm packs int8 codes into a copy of its own: they need no copy of ours.
                tensors = reader.read([n for n in names if n.startswith(prefix) and "." not in n[len(prefix):]],
                                      copy=kind != DynamicInt8Linear.__name__)
                own = {n[len(prefix):]: t for n, t in tensors.items()}
                if name in (embeddings_name, head_name):
                    place(name, _rebuild(kind, own, settings))
                    continue
                pending.append((name, pool.submit(_rebuild, kind, own, settings)))
                while len(pending) > 2 * workers:
                    done_name, future = pending.popleft()
                    place(done_name, future.result())
            for done_name, future in pending:
                place(done_name, future.result())
        for name, (kind, settings) in kinds.items():
            if SHARES in settings:
                place(name, KINDS[kind].sharing(model.get_submodule(settings[SHARES]), settings["padding_idx"]))
        for name, module in dict(model.named_modules()).items():
            if type(module).__name__ in KINDS:
                continue
            own = [key for key, _ in module.named_parameters(recurse=False)]
            keys = [f"{name}.{key}" if name else key for key in own]
            if not keys:
                continue
            missing = [k for k in keys if k not in names]
            if missing:
                raise KeyError(f"no tensor {missing[0]}")
            tensors = reader.read(keys)
            for key, full in zip(own, keys):
                module._parameters[key] = nn.Parameter(tensors[full], requires_grad=False)
    except Exception as error:  # noqa: BLE001 - a damaged or foreign file: quantize again instead
        log.info("the weight cache %s was not used: %s: %s", path, type(error).__name__, error)
        return None
    model.eval()
    return model, metadata["description"]


def _skeleton(model_path: Path, dtype: torch.dtype, layout: Any, metadata: dict[str, str]) -> Any:
    """The model the cache file fills: a model directory's or a GGUF file's (from the
    config fields the first load saved, without transformers' GGUF key table)."""
    if model_path.suffix == ".gguf":
        from ruvllm_cli.engine.gguf_load import FIELDS_KEY, cached_skeleton

        fields = json.loads(metadata[FIELDS_KEY]) if FIELDS_KEY in metadata else None
        return cached_skeleton(model_path, dtype, layout, fields)
    from ruvllm_cli.engine.stream_load import _skeleton as directory_skeleton

    return directory_skeleton(model_path, dtype)


def _name_of(module: nn.Module | None, modules: dict[str, nn.Module]) -> str | None:
    return next((name for name, candidate in modules.items() if candidate is module), None)


_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I8": torch.int8, "U8": torch.uint8,
           "I16": torch.int16, "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool}


class _Reader:
    """A cache file's tensors read with `pread` into fresh process memory: one copy, and
    no mapped file pages beside it. Through a mapping, each module's file pages counted
    in the process's resident memory beside its copy until the mapping went, which put
    the last modules' twice into the load's peak."""

    def __init__(self, path: Path) -> None:
        self.path = path
        file_size = path.stat().st_size
        with open(path, "rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            if size > file_size - 8:
                raise ValueError(f"a header of {size} bytes in a file of {file_size}")
            self.header: dict[str, Any] = json.loads(handle.read(size))
        self.start = 8 + size
        self.metadata: dict[str, str] = self.header.pop("__metadata__", None) or {}
        self.names = set(self.header)
        if max((info["data_offsets"][1] for info in self.header.values()), default=0) > file_size - self.start:
            raise ValueError("the file ends before its last tensor (a damaged or cut file)")

    def read(self, names: list[str], copy: bool = True) -> dict[str, torch.Tensor]:
        """The named tensors; `copy=False` gives views of the file's pages instead
        (fbgemm packs int8 codes into a copy of its own: they need no copy of ours)."""
        if not copy:
            from safetensors import safe_open

            with safe_open(self.path, framework="pt", device="cpu") as handle:
                return {name: handle.get_tensor(name) for name in names}
        tensors = {}
        fd = os.open(self.path, os.O_RDONLY)
        try:
            for name in names:
                tensors[name] = self._tensor(fd, name)
        finally:
            os.close(fd)
        return tensors

    def _tensor(self, fd: int, name: str) -> torch.Tensor:
        info = self.header[name]
        begin, end = info["data_offsets"]
        tensor = torch.empty(info["shape"], dtype=_DTYPES[info["dtype"]])
        room = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
        if len(room) != end - begin:
            raise ValueError(f"{name}: {end - begin} bytes in the file for {len(room)}")
        done = 0
        while done < len(room):   # pread may return less than asked (a 2 GiB cap per call)
            got = os.preadv(fd, [room[done:]], self.start + begin + done)
            if got <= 0:
                raise ValueError(f"{name}: the file ends {len(room) - done} bytes early")
            done += got
        return tensor

