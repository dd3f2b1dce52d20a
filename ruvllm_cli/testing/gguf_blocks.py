"""K-quant and i-quant blocks written in numpy, for test files: the gguf package
(0.19) dequantizes these types but has no quantizer for them.

The block layouts are llama.cpp's (`block_q4_K`, `block_q6_K`, `block_iq4_nl`,
`block_iq4_xs`, ... in ggml-common.h), the ones gguf's `dequantize_blocks` read. The
fit is a plain min/max (Q4_K), abs-max (Q6_K) or nearest table value (IQ4_*) per
sub-block, not llama.cpp's search for better scales, and the lattice i-quants
(IQ1-IQ3) get random codes under a scale of the weights' size: any valid encoding
serves a test, which compares the loaded weights with gguf's own dequantization of
the same bytes.
"""

from __future__ import annotations

import numpy as np

QK_K = 256  # weights per super-block


def _ratio(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
    """numerator / denominator, 0 where the denominator is 0 (an all-zero sub-block)."""
    return np.divide(numerator, denominator, out=np.zeros_like(numerator), where=denominator != 0)


def _nibbles(codes: np.ndarray) -> np.ndarray:
    """4-bit codes [..., 2h] as h bytes: value b in the low nibble of byte b, value h + b in
    its high one (Q4_K's and the IQ4 types' packing)."""
    half = codes.shape[-1] // 2
    return codes[..., :half] | (codes[..., half:] << 4)


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
    codes = _nibbles(q.reshape(n, 4, 64)).reshape(n, 128)  # each 32 bytes: sub-block 2c low, 2c+1 high
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


IQ4_VALUES = np.array((-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113), dtype=np.float32)


def _iq4_codes(blocks: np.ndarray, step: np.ndarray) -> np.ndarray:
    """The nearest of IQ4_NL's 16 values (times `step`) to each weight: codes 0..15."""
    values = IQ4_VALUES * step[..., None]
    return np.abs(blocks[..., None] - values[..., None, :]).argmin(-1).astype(np.uint8)


def quantize_iq4_nl(weights: np.ndarray) -> np.ndarray:
    """[N, K] floats (K a multiple of 32) -> IQ4_NL bytes [N, K / 32 * 18]: per block of
    32 an f16 scale d and 4-bit indices into the non-linear table: w = d * table[q]."""
    rows = weights.shape[0]
    blocks = weights.astype(np.float32).reshape(-1, 32)
    d = (np.abs(blocks).max(-1) / 127).astype(np.float16)
    codes = _iq4_codes(blocks, d.astype(np.float32))
    out = np.concatenate([d[:, None].view(np.uint8), _nibbles(codes)], axis=1)
    return out.reshape(rows, -1)


def quantize_iq4_xs(weights: np.ndarray) -> np.ndarray:
    """[N, K] floats (K a multiple of 256) -> IQ4_XS bytes [N, K / 256 * 136]: per
    super-block an f16 d, 8 sub-blocks of 32 with a 6-bit scale s (stored + 32, split
    into 4 low bits and 2 high), and IQ4_NL's 4-bit indices: w = d * s * table[q]."""
    rows = weights.shape[0]
    blocks = weights.astype(np.float32).reshape(-1, 8, 32)
    n = blocks.shape[0]
    step = np.abs(blocks).max(-1) / 127
    d = (step.max(-1) / 31).astype(np.float16)
    s = np.clip(np.round(_ratio(step, d.astype(np.float32)[:, None] + 0 * step)), -32, 31).astype(np.int8)
    codes = _iq4_codes(blocks, d.astype(np.float32)[:, None] * s)
    stored = (s.astype(np.int16) + 32).astype(np.uint16)
    scales_h = np.bitwise_or.reduce((stored >> 4) << (2 * np.arange(8, dtype=np.uint16)), axis=1).astype(np.uint16)
    low = (stored & 0x0F).astype(np.uint8)
    scales_l = low[:, 0::2] | (low[:, 1::2] << 4)
    out = np.concatenate([d[:, None].view(np.uint8), scales_h[:, None].view(np.uint8), scales_l,
                          _nibbles(codes).reshape(n, 128)], axis=1)
    return out.reshape(rows, -1)


# d's divisor for each family: its lattice points times its sub-block scales reach about this.
GRID_DIVISOR = {"IQ1": 16, "IQ2": 192, "IQ3": 512}


def grid_blocks(weights: np.ndarray, kind: str, seed: int = 0) -> np.ndarray:
    """[N, K] floats (K a multiple of 256) -> bytes of an i-quant with a lattice of
    codes (IQ1_*, IQ2_*, IQ3_*): random grid indices, signs and sub-block scales, and
    each super-block's f16 d from its weights' largest magnitude. Not a fit of the
    weights (llama.cpp's search for one needs an importance matrix): any bytes are a
    valid encoding, and a test compares a load with gguf's dequantization of them."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[kind]][1]
    rows = weights.shape[0]
    amax = np.abs(weights.astype(np.float32).reshape(-1, QK_K)).max(-1)
    out = np.random.default_rng(seed).integers(0, 256, (amax.shape[0], block_bytes), dtype=np.uint8)
    d = (amax / GRID_DIVISOR[kind[:3]]).astype(np.float16)   # values about as large as the weights
    if kind == "IQ1_M":   # d's 16 bits sit in the top nibbles of the four 16-bit scale words
        words = out[:, -8:].copy().view(np.uint16)
        bits = d.view(np.uint16)
        for i in range(4):
            words[:, i] = (words[:, i] & 0x0FFF) | (((bits >> (4 * i)) & 0xF) << 12)
        out[:, -8:] = words.view(np.uint8)
    else:
        out[:, 0:2] = d[:, None].view(np.uint8)
    return out.reshape(rows, -1)
