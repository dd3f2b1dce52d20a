"""Memory estimates for running a model, from its parameter count and shape (no torch).

    weights    = params x bytes_per_param(quantization)
                 (Q4_K_M 4.85 bits, Q8_0 8.5 bits incl. block scales; F16 2 bytes; F32 4 bytes)
    kv_cache   = 2 (K and V) x layers x kv_heads x head_dim x kv_dtype_bytes x context
                 (the cache is kept in 16-bit, or in 32-bit when the model runs unquantized F32)
    overhead   = 10% of weights + 256 MiB for the runtime, activations and allocator slack
    total      = weights + kv_cache + overhead

The KV-cache term needs the shape; without one it is reported as unknown (None) and left
out of the total.
"""

from __future__ import annotations

from typing import Any, Protocol

from ruvllm_cli.quantization import Quantization, parse_quantization

OVERHEAD_FRACTION = 0.10
OVERHEAD_BASE_BYTES = 256 * 1024**2
DEFAULT_CONTEXT = 4096


class KVShape(Protocol):
    num_layers: int
    num_kv_heads: int
    head_dim: int


def kv_dtype_bytes(quantization: Quantization | str) -> int:
    return 4 if parse_quantization(quantization) is Quantization.F32 else 2


def estimate_weight_bytes(params: int | float, quantization: Quantization | str) -> int:
    """Bytes the weights take at `quantization`."""
    return int(round(params * parse_quantization(quantization).bytes_per_param))


def estimate_kv_bytes_per_token(shape: KVShape, dtype_bytes: int = 2) -> int:
    """KV-cache bytes one token takes across all layers: 2 x layers x kv_heads x head_dim x dtype."""
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * dtype_bytes


def estimate_overhead_bytes(weight_bytes: int) -> int:
    return int(weight_bytes * OVERHEAD_FRACTION) + OVERHEAD_BASE_BYTES


def estimate_memory(params: int | float, quantization: Quantization | str, shape: KVShape | None = None,
                    context: int = DEFAULT_CONTEXT) -> dict[str, Any]:
    """Weights + KV cache at `context` tokens + runtime overhead, in bytes (see module doc)."""
    quant = parse_quantization(quantization)
    weights = estimate_weight_bytes(params, quant)
    kv = estimate_kv_bytes_per_token(shape, kv_dtype_bytes(quant)) * context if shape else None
    overhead = estimate_overhead_bytes(weights)
    return {
        "quantization": quant.value,
        "label": quant.label,
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
