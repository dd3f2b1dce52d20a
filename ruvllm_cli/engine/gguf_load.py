"""A GGUF file streamed into the final form on a CPU, one tensor at a time.

transformers' own GGUF path dequantizes every tensor of the file to 16 or 32 bits
before our quantizers run, so a 4-bit file grew 4 to 8 times at load. Here the model
is built on the meta device from the file's metadata, and each tensor is read from a
memory map of its own bytes (a block of rows at a time for the vocabulary matrices)
and turned straight into its layout through `fill_model` and `WeightPlan`, the
safetensors stream's own loop: Q4_K blocks become int4 groups without a float in
between, other types are dequantized by the gguf package a block of rows at a time
and quantized again, or kept as floats (gguf_plan.py says which, per tensor).

Names and fixes follow transformers' `modeling_gguf_pytorch_utils` (read, not
imported: its helpers are private): gguf's own name table, llama's q/k rows put
back in order, a tied head where the file has no `output.weight`. Two fixes go
further, because llama.cpp reads the same files that way: a llama file's attention
biases are loaded (transformers' reader drops them), and Llama 3's `rope_freqs`
divide the rotary frequencies. Architectures not mapped here raise NotStreamable and
load through transformers.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from math import prod
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ruvllm_cli.engine.gguf_check import GGUFLayout, TensorInfo, check_gguf
from ruvllm_cli.engine.gguf_plan import EMBEDDING, HEAD, INT4_GROUP, label, summary, unstreamable
from ruvllm_cli.engine.quantize import CHUNK_ROWS, WeightPlan
from ruvllm_cli.engine.stream_load import NotStreamable, fill_model
from ruvllm_cli.quantization import Quantization

# llama.cpp's converter interleaves the two rotary halves of each head's q and k rows
# for llama (transformers' LlamaTensorProcessor undoes it): tensor part -> head count key.
PERMUTED_ROWS = {"llama": {".attn_q.": "num_attention_heads", ".attn_k.": "num_key_value_heads"}}
ROPE_FREQS = "rope_freqs.weight"
Q4_K_BLOCK_BYTES = 144  # f16 d, f16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of codes


@torch.no_grad()
def stream_gguf(path: Path, layout: GGUFLayout, dtype: torch.dtype, quantization: Quantization
                ) -> tuple[Any, str]:
    """The model, built from the GGUF file one tensor at a time, and the one-line
    description of what each tensor became."""
    reason = unstreamable(layout)
    if reason:
        raise NotStreamable(reason)
    model = _skeleton(layout, dtype)
    source = GGUFSource(path, layout, model)
    plan = WeightPlan(quantization, dtype, model.config.hidden_size, int4_group=INT4_GROUP)
    fill_model(model, source, plan)
    source.apply_rope_freqs(model)
    return model, (f"GGUF {label(layout)} {path.name}, tensor by tensor: "
                   f"{summary(layout, quantization, half=plan.half)}; "
                   f"{plan.describe()}")


FIELDS_KEY = "gguf_fields"   # a GGUF file's weight cache keeps its config fields (cache_metadata)


def cache_metadata(layout: GGUFLayout) -> dict[str, str]:
    """What a GGUF file's weight cache keeps beside the weights: its config fields, so a
    cached load builds the model without transformers' key table (its import is 0.6 s)."""
    try:
        return {FIELDS_KEY: json.dumps(gguf_fields(layout))}
    except (TypeError, ValueError):   # a value JSON cannot hold: the cached load reads the table again
        return {}


def cached_skeleton(path: Path, dtype: torch.dtype, layout: GGUFLayout | None = None,
                    fields: dict[str, Any] | None = None) -> Any:
    """The meta model a weight-cache file of this GGUF file fills (engine/weight_cache.py),
    with the file's RoPE factors applied (they are not weights the cache holds);
    `layout` the header already read, `fields` the config fields the cache kept."""
    layout = layout if layout is not None else check_gguf(path)
    model = _skeleton(layout, dtype, fields)
    GGUFSource(path, layout, model).apply_rope_freqs(model)
    return model


def gguf_config(layout: GGUFLayout) -> Any:
    """The transformers config of the file (what `AutoConfig.from_pretrained(gguf_file=)`
    builds, without its second parse of the vocabulary)."""
    from transformers import AutoConfig

    fields = gguf_fields(layout)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def gguf_fields(layout: GGUFLayout) -> dict[str, Any]:
    """The file's config.json, as it were: its metadata by transformers' own GGUF key
    table, with model_type."""
    from transformers.integrations import GGUF_CONFIG_MAPPING

    metadata = layout.metadata
    arch = metadata["general.architecture"]
    fields: dict[str, Any] = {}
    for prefix in ("general", arch, "tokenizer"):
        for key, field in GGUF_CONFIG_MAPPING.get(prefix, {}).items():
            value = metadata.get(f"{prefix}.{key}")
            if field not in (None, -1) and value is not None and not isinstance(value, tuple):
                fields[field] = value  # (arrays are (item type, count) pairs in check_gguf's metadata)
    names = {tensor.name for tensor in layout.tensors}
    fields["tie_word_embeddings"] = HEAD not in names
    tokens = metadata.get("tokenizer.ggml.tokens")
    if "vocab_size" not in fields and isinstance(tokens, tuple):
        fields["vocab_size"] = tokens[1]
    if arch == "llama":  # llama.cpp loads these when the file has them; transformers' reader drops them
        fields["attention_bias"] = "blk.0.attn_q.bias" in names
        fields["mlp_bias"] = "blk.0.ffn_gate.bias" in names
    fields.update(config_overrides(layout))
    return fields


# Families whose transformers config has a head size of its own by default, not hidden / heads.
_HEAD_DIM_DEFAULTS = ("qwen3", "qwen3moe", "gemma2", "gemma3")
# llama.cpp's 27B Gemmas (by their layer count) scale attention by hidden / heads, not by the key length.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def config_overrides(layout: GGUFLayout) -> dict[str, Any]:
    """Config fields llama.cpp reads from a file's metadata and transformers' GGUF reader
    does not: a head size other than hidden / heads (Qwen3's `attention.key_length`), and
    Gemma 2/3's attention scale (`query_pre_attn_scalar`, which the reader left at its
    default 256: a Gemma 2 of head size 64 attended at the wrong scale)."""
    metadata = layout.metadata
    arch = metadata.get("general.architecture")
    key_length = metadata.get(f"{arch}.attention.key_length")
    hidden, heads = metadata.get(f"{arch}.embedding_length"), metadata.get(f"{arch}.attention.head_count")
    if not all(isinstance(value, int) and not isinstance(value, bool) and value > 0
               for value in (key_length, hidden, heads)):
        return {}
    overrides: dict[str, Any] = {}
    if key_length != hidden // heads or arch in _HEAD_DIM_DEFAULTS:   # Qwen3Config's default is 128
        overrides["head_dim"] = key_length
    if arch in _GEMMA_27B_LAYERS:
        big = metadata.get(f"{arch}.block_count") == _GEMMA_27B_LAYERS[arch]
        overrides["query_pre_attn_scalar"] = hidden // heads if big else key_length
    return overrides


def _skeleton(layout: GGUFLayout, dtype: torch.dtype, fields: dict[str, Any] | None = None) -> Any:
    """The model with its parameters on the meta device (stream_load's `_skeleton`):
    our own classes for the Llama family (engine/native.py), transformers' for the rest."""
    from ruvllm_cli.engine import attention, native

    try:
        fields = dict(fields) if fields is not None else gguf_fields(layout)
        if native.unsupported(fields) is None:   # no AutoConfig: it imports transformers' modeling stack
            return native.NativeForCausalLM(native.NativeConfig.from_dict(fields), dtype, device="meta").eval()
        from accelerate import init_empty_weights
        from transformers import AutoModelForCausalLM

        config = gguf_config(layout)
        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attention.register())
    except Exception as error:  # noqa: BLE001 - metadata transformers rejects: its own path says how
        raise NotStreamable(f"its metadata builds no model here: {error}") from None
    model.tie_weights()
    return model


def gguf_names(model: nn.Module, arch: str) -> dict[str, str]:
    """Model parameter name -> the file's tensor name, by gguf's own name table (as
    transformers' `get_gguf_hf_weights_map`)."""
    import gguf

    arch_id = next(key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == arch)
    table = gguf.get_tensor_name_map(arch_id, model.config.num_hidden_layers)
    names = {}
    for name, _ in model.named_parameters(remove_duplicate=False):
        module, _, kind = name.rpartition(".")
        mapped = table.get_name(module)
        if mapped is None:
            raise NotStreamable(f"no GGUF name for {name}")
        names[name] = f"{mapped}.{kind}"
    return names


def _row_order(tensor: TensorInfo, arch: str, config: Any) -> np.ndarray | None:
    """Where each of the model's rows is in the file, for tensors the converter permuted."""
    for part, heads_key in PERMUTED_ROWS.get(arch, {}).items():
        if part in tensor.name:
            rows, heads = tensor.dims[-1], getattr(config, heads_key)
            if rows % (2 * heads):
                raise NotStreamable(f"{tensor.name} has {rows} rows, not a whole number per head")
            return np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(-1)
    return None


class GGUFTensor:
    """One tensor of the file, in the model's row order. Each read maps the file anew
    and copies out a block of rows, so the file's pages leave the process with the
    mapping; as a `quantize.RowBlocks` it hands the quantizers float32 rows, and Q4_K
    tensors also their own int4 groups."""

    def __init__(self, file: Path, start: int, info: TensorInfo, order: np.ndarray | None) -> None:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        self.file, self.start, self.name, self.order = file, start, info.name, order
        self.ggml_type = GGMLQuantizationType(info.ggml_type)
        block, block_bytes = GGML_QUANT_SIZES[self.ggml_type]
        self.rows, self.columns = prod(info.dims[1:]), info.dims[0]
        self.row_bytes = self.columns // block * block_bytes
        self.shape = (self.rows, self.columns)

    def raw(self, start: int, stop: int) -> np.ndarray:
        """The blocks of rows [start, stop), as bytes [rows, row_bytes]."""
        data = np.memmap(self.file, np.uint8, "r", offset=self.start, shape=(self.rows, self.row_bytes))
        if self.order is not None and self.rows > 1:
            return data[self.order[start:stop]]     # fancy indexing copies
        return np.array(data[start:stop])

    def values(self, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) dequantized to float32 by the gguf package."""
        from gguf import quants

        return torch.from_numpy(np.ascontiguousarray(quants.dequantize(self.raw(start, stop), self.ggml_type)))

    def whole(self, dtype: torch.dtype) -> torch.Tensor:
        """The tensor in the model's shape ([rows, columns], or [columns] for a vector),
        filled a block of rows at a time: no float32 copy of a vocabulary matrix on the
        way to bf16."""
        if self.rows == 1:
            vector = self.values(0, 1).reshape(-1)
            return (vector if self.order is None else vector[torch.from_numpy(self.order)]).to(dtype)
        out = torch.empty(self.shape, dtype=dtype)
        for start in range(0, self.rows, CHUNK_ROWS):
            out[start:start + CHUNK_ROWS] = self.values(start, start + CHUNK_ROWS)
        return out

    def blocks(self, rows: int) -> Iterator[torch.Tensor]:
        for start in range(0, self.rows, rows):
            yield self.values(start, start + rows)

    def int4_groups(self, rows: int, group: int) -> Iterator[tuple[torch.Tensor, ...]] | None:
        """The file's own 4-bit codes, scales and lows per group of 32 (Q4_K), exactly."""
        if self.ggml_type.name != "Q4_K" or group != INT4_GROUP:
            return None
        return (q4_k_groups(self.raw(start, start + rows)) for start in range(0, self.rows, rows))


def q4_k_groups(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K rows (bytes [r, K/256*144]) as codes 0..15 [r, K] (uint8), scales and lows
    [r, K/32] (float32) with w = code * scale + low: gguf's `Q4_K.dequantize_blocks`
    stopped before it multiplies (the same products, so the same float32 values)."""
    from gguf.quants import Q4_K

    rows = raw.shape[0]
    blocks = raw.reshape(-1, Q4_K_BLOCK_BYTES)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16])
    scales = d * sc.astype(np.float32)
    lows = -(dmin * m.astype(np.float32))
    # Each 32 bytes hold two sub-blocks: the low nibbles, then the high ones.
    codes = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    codes = (codes & np.uint8(0x0F)).reshape(rows, -1)
    return (torch.from_numpy(codes), torch.from_numpy(scales.reshape(rows, -1)),
            torch.from_numpy(lows.reshape(rows, -1)))


class GGUFSource:
    """A GGUF file as stream_load's `WeightSource`, by the model's parameter names."""

    def __init__(self, path: Path, layout: GGUFLayout, model: nn.Module) -> None:
        arch = layout.metadata["general.architecture"]
        in_file = {tensor.name: tensor for tensor in layout.tensors}
        params = dict(model.named_parameters(remove_duplicate=False))
        self.tensors: dict[str, GGUFTensor] = {}
        mapped = gguf_names(model, arch)
        for name, file_name in mapped.items():
            info = in_file.get(file_name)
            if info is not None:
                _check_tensor(info, tuple(params[name].shape))
                order = _row_order(info, arch, model.config)
                self.tensors[name] = GGUFTensor(path, layout.data_start + info.offset, info, order)
        extra = sorted(set(in_file) - set(mapped.values()) - {ROPE_FREQS})
        if extra:
            raise NotStreamable(f"the file's tensor {extra[0]} has no place in the model")
        rope = in_file.get(ROPE_FREQS)
        self.rope_freqs = None if rope is None else GGUFTensor(path, layout.data_start + rope.offset, rope, None)

    def names(self) -> set[str]:
        return set(self.tensors)

    def tensor(self, name: str, dtype: torch.dtype | None) -> torch.Tensor:
        return self.tensors[name].whole(dtype or torch.float32)   # None ("as stored"): dequantized to float32

    def matrix(self, name: str, dtype: torch.dtype | None, plan: WeightPlan) -> torch.Tensor | GGUFTensor:
        """Quantized plans read it a block of rows at a time (or take its int4 groups); others whole."""
        return self.tensors[name] if plan.quantized else self.tensor(name, dtype)

    def apply_rope_freqs(self, model: nn.Module) -> None:
        """Llama 3's frequency factors: llama.cpp divides each rotary frequency by its factor."""
        if self.rope_freqs is None:
            return
        rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
        factors = self.rope_freqs.whole(torch.float32)
        inv_freq = getattr(rotary, "inv_freq", None)
        if inv_freq is None or inv_freq.shape != factors.shape:
            raise NotStreamable(f"{ROPE_FREQS} does not fit the model's rotary frequencies")
        rotary.inv_freq = inv_freq / factors.to(inv_freq.dtype)
        rotary.original_inv_freq = rotary.inv_freq.clone()


def _check_tensor(info: TensorInfo, shape: tuple[int, ...]) -> None:
    """NotStreamable unless the tensor fills the parameter (its type was checked with
    the file's: gguf_plan.unstreamable)."""
    if tuple(reversed(info.dims)) != shape:
        raise NotStreamable(f"{info.name} has the shape {tuple(reversed(info.dims))}, the model wants {shape}")
    if info.name == EMBEDDING and len(shape) != 2:
        raise NotStreamable(f"{info.name} is not a matrix")
