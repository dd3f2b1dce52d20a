"""Memory estimates for running a model on a CPU, from its parameter count and shape (no torch).

    weights    = linear-layer params x linear bytes + embedding-table params x table bytes,
                 in ruvllm's own layouts (LAYOUT_BYTES; the loader's memory check uses them):
                 q8 1 byte, q4k 4-bit codes with a 16-bit scale and zero per group of 64
                 (tables and a GGUF file's weights: 32), f16 2 bytes, none 4 bytes (a tied
                 LM head then takes a packed copy of the table). Without the shape's hidden
                 and vocabulary sizes every parameter counts as a linear layer's. From a
                 GGUF file (what `download` fetches for an alias that names one) q4k takes
                 groups of 32 everywhere.
    kv_cache   = 2 (K and V) x layers x kv_heads x head_dim x kv_dtype_bytes x context
                 (the cache is kept in 16-bit, or in 32-bit when the model runs unquantized F32)
    overhead   = 2% of weights + 320 MiB: `import torch` (218 MiB), a 150k-token tokenizer,
                 the model's objects and a step's buffers; measured (docs/design.md, section 9)
    total      = weights + kv_cache + overhead

The KV-cache term needs the shape; without one it is reported as unknown (None) and left
out of the total.
"""

from __future__ import annotations

from typing import Any, Protocol

from ruvllm_cli.quantization import INT4_GROUP, TIED_INT4_GROUP, Quantization, parse_quantization

OVERHEAD_FRACTION = 0.02
OVERHEAD_BASE_BYTES = 320 * 1024**2
DEFAULT_CONTEXT = 4096

# Bytes a weight takes once loaded on a CPU, in ruvllm's layouts (engine/quantize.py):
# (linear layers, embedding table). q8: int8 codes (our kernel adds a float32 scale per
# output row, which the loader counts); q4k: 4-bit codes + a bf16 scale and zero per
# group of INT4_GROUP (linear layers, 64) or TIED_INT4_GROUP (tables, 32); f16: float16 weights (float32 activations);
# none: float32. A tied LM head shares the table, except under none (a packed copy).
LAYOUT_BYTES: dict[Quantization, tuple[float, float]] = {
    Quantization.Q8_0: (1.0, 1.0), Quantization.Q4_K_M: (0.5 + 4 / INT4_GROUP, 0.5 + 4 / TIED_INT4_GROUP),
    Quantization.F16: (2.0, 2.0), Quantization.F32: (4.0, 4.0)}
# A GGUF file's weights load in its own block width: q4k in groups of 32 everywhere
# (engine/gguf_plan.py; "GGUF straight in" in docs/design.md).
GGUF_LAYOUT_BYTES = {**LAYOUT_BYTES, Quantization.Q4_K_M: (0.5 + 4 / 32, 0.5 + 4 / 32)}


class KVShape(Protocol):
    num_layers: int
    num_kv_heads: int
    head_dim: int


def kv_dtype_bytes(quantization: Quantization | str) -> int:
    return 4 if parse_quantization(quantization) is Quantization.F32 else 2


def layout_bytes(quantization: Quantization, params: int | float, embedding: int | float = 0,
                 head_copy: int | float = 0, gguf: bool = False) -> float:
    """Bytes `params` weights take in our layouts at `quantization`, `embedding` of them
    the embedding table's, plus a tied head's own copy of `head_copy` weights (a linear
    layer's layout): the rule `info`'s estimates and the loader's memory check share."""
    linear, table = (GGUF_LAYOUT_BYTES if gguf else LAYOUT_BYTES)[quantization]
    return (params - embedding) * linear + embedding * table + head_copy * linear


def estimate_weight_bytes(params: int | float, quantization: Quantization | str, shape: Any = None,
                          gguf: bool = False) -> int:
    """Bytes the weights take loaded at `quantization`: the embedding table apart where
    `shape` gives its size (hidden_size and vocab_size; a ModelShape or a registry entry);
    `gguf`: loaded from a GGUF file of that quantization (q4k's groups of 32)."""
    quant = parse_quantization(quantization)
    hidden, vocab = getattr(shape, "hidden_size", None), getattr(shape, "vocab_size", None)
    embedding = hidden * vocab if hidden and vocab else 0
    head_copy = embedding if quant is Quantization.F32 and getattr(shape, "tie_word_embeddings", False) else 0
    return int(round(layout_bytes(quant, params, embedding, head_copy, gguf)))


def estimate_kv_bytes_per_token(shape: KVShape, dtype_bytes: int = 2) -> int:
    """KV-cache bytes one token takes across all layers: 2 x layers x kv_heads x head_dim x dtype."""
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * dtype_bytes


def estimate_overhead_bytes(weight_bytes: int) -> int:
    return int(weight_bytes * OVERHEAD_FRACTION) + OVERHEAD_BASE_BYTES


def estimate_memory(params: int | float, quantization: Quantization | str, shape: KVShape | None = None,
                    context: int = DEFAULT_CONTEXT, weight_bytes: int | None = None,
                    gguf: bool = False) -> dict[str, Any]:
    """Weights + KV cache at `context` tokens + runtime overhead, in bytes (see module doc).
    `weight_bytes`: the weights' size where it is known tensor by tensor (a GGUF file's
    header); `gguf`: the weights come from a GGUF file of that quantization."""
    quant = parse_quantization(quantization)
    weights = estimate_weight_bytes(params, quant, shape, gguf) if weight_bytes is None else weight_bytes
    kv = estimate_kv_bytes_per_token(shape, kv_dtype_bytes(quant)) * context if shape else None
    overhead = estimate_overhead_bytes(weights)
    return {
        "quantization": quant.value,
        "label": quant.label,
        "weights_from": "gguf" if gguf or weight_bytes is not None else "safetensors",
        "context": context,
        "weights_bytes": weights,
        "kv_cache_bytes": kv,
        "overhead_bytes": overhead,
        "total_bytes": weights + (kv or 0) + overhead,
    }


def format_bytes(count: int | float | None) -> str:
    """Human-readable binary size for memory: 512 B, 1.5 KiB, 4.7 GiB; '-' for None.
    (Sizes of files on disk are decimal, as the hub and download's progress give them:
    rich.filesize.decimal.)"""
    if count is None:
        return "-"
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
