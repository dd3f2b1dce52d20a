"""Q4_K and Q6_K blocks written in numpy, for test files: the gguf package (0.19)
dequantizes these types but has no quantizer for them.

The block layouts are llama.cpp's (`block_q4_K`, `block_q6_K` in ggml-common.h), the
ones gguf's `Q4_K.dequantize_blocks` and `Q6_K.dequantize_blocks` read. The fit is a
plain min/max (Q4_K) or abs-max (Q6_K) per sub-block, not llama.cpp's search for
better scales: any valid encoding serves a test, which compares the loaded weights
with gguf's own dequantization of the same bytes.
"""

from __future__ import annotations

import numpy as np

QK_K = 256  # weights per super-block


def _ratio(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
    """numerator / denominator, 0 where the denominator is 0 (an all-zero sub-block)."""
    return np.divide(numerator, denominator, out=np.zeros_like(numerator), where=denominator != 0)


def quantize_q4_k(weights: np.ndarray) -> np.ndarray:
    """[N, K] floats (K a multiple of 256) -> Q4_K bytes [N, K / 256 * 144]: per
    super-block an f16 scale d and min dmin, 8 sub-blocks of 32 with a 6-bit scale sc
    and min m each, and 4-bit codes q: w = d * sc * q - dmin * m."""
    rows = weights.shape[0]
    blocks = weights.astype(np.float32).reshape(-1, 8, 32)
    n = blocks.shape[0]
    low = np.minimum(blocks.min(-1), 0)
    scale = (blocks.max(-1) - low) / 15
    d = (scale.max(-1, keepdims=True) / 63).astype(np.float16)
    dmin = ((-low).max(-1, keepdims=True) / 63).astype(np.float16)
    sc = np.clip(np.round(_ratio(scale, d.astype(np.float32))), 0, 63).astype(np.uint8)
    m = np.clip(np.round(_ratio(-low, dmin.astype(np.float32))), 0, 63).astype(np.uint8)
    step = d.astype(np.float32) * sc
    offset = dmin.astype(np.float32) * m
    q = np.clip(np.round(_ratio(blocks + offset[..., None], step[..., None] + 0 * blocks)), 0, 15).astype(np.uint8)
    scales = np.empty((n, 12), dtype=np.uint8)
    scales[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    pairs = q.reshape(n, 4, 2, 32)  # each 32 bytes: sub-block 2c in the low nibbles, 2c+1 in the high
    codes = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(n, 128)
    out = np.concatenate([d.view(np.uint8), dmin.view(np.uint8), scales, codes], axis=1)
    return out.reshape(rows, -1)


def quantize_q6_k(weights: np.ndarray) -> np.ndarray:
    """[N, K] floats (K a multiple of 256) -> Q6_K bytes [N, K / 256 * 210]: per
    super-block 16 sub-blocks of 16 with an int8 scale, an f16 d, and 6-bit codes q:
    w = d * scale * (q - 32), the codes split into low 4 bits (ql) and high 2 (qh)."""
    rows = weights.shape[0]
    blocks = weights.astype(np.float32).reshape(-1, 16, 16)
    n = blocks.shape[0]
    scale = np.abs(blocks).max(-1) / 31
    d = (scale.max(-1, keepdims=True) / 127).astype(np.float16)
    sc = np.clip(np.round(_ratio(scale, d.astype(np.float32))), -128, 127).astype(np.int8)
    step = (d.astype(np.float32) * sc)[..., None] + 0 * blocks
    q = (np.clip(np.round(_ratio(blocks, step)), -32, 31) + 32).astype(np.uint8).reshape(n, 2, 2, 64)
    ql = (q[:, :, 0] & 0x0F) | ((q[:, :, 1] & 0x0F) << 4)  # byte 64h + b: values 128h + b and 128h + 64 + b
    high = q.reshape(n, 2, 4, 32) >> 4                      # byte 32h + b: values 128h + 32s + b, 2 bits each
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    out = np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8), d.view(np.uint8)], axis=1)
    return out.reshape(rows, -1)
