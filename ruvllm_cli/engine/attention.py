"""Paged attention behind the transformers attention interface.

Registered as the attention implementation "ruvllm_paged", so the stock model
classes (Llama, Qwen2, Mistral, Phi-3, ...) run unchanged: each attention layer
hands us its post-RoPE query/key/value for the step's packed tokens; we write the
new keys and values into the block pool and attend over each request's blocks.
Decode tokens (one per request) are attended in one padded batch; prompt chunks
each in one causal call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

ATTN_IMPLEMENTATION = "ruvllm_paged"
SINGLE_DECODE_SDPA = True  # one decoding request: SDPA (see _single_decode_attention)


class PagedKVCache:
    """Per-layer key and value pools of shape [num_kv_heads, num_slots, head_dim].

    Heads first: the layer's new keys arrive as [heads, tokens, dim], and a gather of
    slots comes out in the layout the attention matmuls read, with no copy."""

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, zeroed: bool = True) -> None:
        shape = (num_kv_heads, num_slots, head_dim)
        # Zeroed, not empty: padded decode slots read stale rows with weight 0, and
        # uninitialised memory could hold NaN (0 * NaN = NaN). A swap pool, only ever
        # read where it was written, stays empty: its pages cost nothing until used.
        make = torch.zeros if zeroed else torch.empty
        self.keys = [make(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [make(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_slot(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize


@dataclass
class PrefillSegment:
    start: int                                # offset of the chunk in the packed step
    length: int                               # tokens in the chunk
    context_len: int                          # tokens already in the cache before it
    slots: torch.Tensor | None = None         # slots of all context_len + length tokens
    mask: torch.Tensor | None = None          # [length, context_len + length] bool


@dataclass
class StepMetadata:
    """What every attention layer needs for one step; built once by the model runner."""

    cache: PagedKVCache
    slot_mapping: torch.Tensor                # [T] slot of each packed token
    num_decodes: int = 0                      # the first num_decodes tokens are single-token queries
    decode_slots: torch.Tensor | None = None  # [B, L] slots of each decode's context
    decode_padding: torch.Tensor | None = None  # [B, 1, L] bool, True past a request's length; None if none
    prefills: list[PrefillSegment] = field(default_factory=list)


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None,
                            scaling: float | None = None, dropout: float = 0.0,
                            ruvllm_step: StepMetadata | None = None, sliding_window: int | None = None,
                            softcap: float | None = None, s_aux: torch.Tensor | None = None, **_: object
                            ) -> tuple[torch.Tensor, None]:
    """query [1, Hq, T, D], key/value [1, Hkv, T, D] -> output [1, T, Hq, D].

    `sliding_window` (Mistral v0.1, Phi-3 4k, Gemma 2/3's local layers): a query at
    position p attends the keys at positions p - window + 1 .. p, transformers' mask.
    `softcap` (Gemma 2): scores become softcap * tanh(scores / softcap) before the
    softmax, as transformers' eager attention computes them."""
    assert ruvllm_step is not None, "the ruvllm_paged attention needs the engine's step metadata"
    if s_aux is not None:   # attention sinks (gpt-oss): refused at load (loader), never silently dropped
        raise NotImplementedError("attention sinks are not supported by ruvllm's paged attention")
    step = ruvllm_step
    window = sliding_window if sliding_window and sliding_window > 0 else None
    scale = scaling if scaling is not None else query.shape[3] ** -0.5
    layer = module.layer_idx
    k_cache, v_cache = step.cache.keys[layer], step.cache.values[layer]
    # A float16 cache beside float32 activations (model_runner.kv_cache_dtype) takes the
    # keys and values rounded; reads come back in the activations' dtype.
    k_cache.index_copy_(1, step.slot_mapping, key[0].to(k_cache.dtype))
    v_cache.index_copy_(1, step.slot_mapping, value[0].to(v_cache.dtype))
    out = query.new_empty(query.shape[2], query.shape[1], query.shape[3])
    if step.num_decodes:
        out[:step.num_decodes] = _decode_attention(query, k_cache, v_cache, step, scale, window, softcap)
    for seg in step.prefills:
        out[seg.start:seg.start + seg.length] = _prefill_attention(
            query, key, value, k_cache, v_cache, seg, scale, window, softcap)
    return out.unsqueeze(0), None


def _decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      step: StepMetadata, scaling: float, window: int | None = None,
                      softcap: float | None = None) -> torch.Tensor:
    """One query row per request, as two batched matmuls over the GQA groups.

    CPU SDPA (flash) takes a slow path for one-row queries with a padding mask: 3.5 ms
    a layer for 16 requests here, against a fraction of that for these matmuls."""
    slots = step.decode_slots
    batch, length = slots.shape
    kv_heads, head_dim = k_cache.shape[0], query.shape[3]
    groups = query.shape[1] // kv_heads
    windowed = window is not None and length > window
    if batch == 1 and SINGLE_DECODE_SDPA and softcap is None:   # one request: no padding
        return _single_decode_attention(query, k_cache, v_cache, slots[0, -window:] if windowed else slots[0],
                                        scaling)
    q = query[0, :, :batch].reshape(kv_heads, groups, batch, head_dim).transpose(1, 2)  # [Hkv, B, G, D]
    # index_select: 5.6x faster than advanced indexing for this gather (57 vs 317 us).
    flat = slots.reshape(-1)
    k = k_cache.index_select(1, flat).view(kv_heads, batch, length, head_dim).to(q.dtype)  # [Hkv, B, L, D]
    v = v_cache.index_select(1, flat).view(kv_heads, batch, length, head_dim).to(q.dtype)
    scores = torch.matmul(q, k.transpose(-1, -2)).float()                              # [Hkv, B, G, L]
    scores *= scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if step.decode_padding is not None:
        scores.masked_fill_(step.decode_padding, float("-inf"))
    if windowed:   # each request's keys older than its window: positions below length - window
        lengths = length - (0 if step.decode_padding is None else step.decode_padding.sum(-1, keepdim=True))
        positions = torch.arange(length, device=scores.device)
        scores.masked_fill_(positions < lengths - window, float("-inf"))               # [B, 1, L]
    out = torch.matmul(scores.softmax(dim=-1).to(v.dtype), v)                          # [Hkv, B, G, D]
    return out.permute(1, 0, 2, 3).reshape(batch, kv_heads * groups, head_dim)        # [B, Hq, D]


def _single_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             slots: torch.Tensor, scaling: float | None) -> torch.Tensor:
    """One request's decode: the query heads sharing a KV head become that head's
    query rows, so SDPA runs one unmasked [G, L] attention per KV head (every cached
    key precedes the query). Inside real steps: 65 vs 189 us a layer at 128 tokens,
    205 vs 304 at 1,500, and decode steps 1.10x faster (scripts/bench_decode_attention.py).
    With several requests and their padding mask, SDPA is the slower (772 vs 584 us
    a layer for 16 requests), so they keep the batched matmuls."""
    kv_heads, head_dim = k_cache.shape[0], query.shape[3]
    q = query[0, :, :1].reshape(1, kv_heads, -1, head_dim)                   # [1, Hkv, G, D]
    k = k_cache.index_select(1, slots).unsqueeze(0).to(q.dtype)              # [1, Hkv, L, D]
    v = v_cache.index_select(1, slots).unsqueeze(0).to(q.dtype)
    out = F.scaled_dot_product_attention(q, k, v, scale=scaling)             # [1, Hkv, G, D]
    return out.reshape(1, -1, head_dim)                                      # [1, Hq, D]


def _prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, seg: PrefillSegment,
                       scaling: float, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    q = query[:, :, seg.start:seg.start + seg.length]                        # [1, Hq, n, D]
    if seg.context_len == 0:
        k = key[:, :, seg.start:seg.start + seg.length]
        v = value[:, :, seg.start:seg.start + seg.length]
        if k_cache.dtype != k.dtype:
            # As the cache holds them, as every later chunk and a prefix-cache hit read
            # them: attended unrounded, a q8 prompt's tokens changed with the prefix
            # cache on or off and with the chunk budget (2 and 5 of 12, a helper's pass).
            k, v = k.to(k_cache.dtype).to(k.dtype), v.to(v_cache.dtype).to(v.dtype)
    else:
        k = k_cache.index_select(1, seg.slots).unsqueeze(0).to(q.dtype)      # [1, Hkv, L, D]
        v = v_cache.index_select(1, seg.slots).unsqueeze(0).to(q.dtype)
    gqa = query.shape[1] != key.shape[1]
    if softcap is not None or (window is not None and seg.context_len + seg.length > window):
        o = _masked_prefill(q, k, v, seg, scaling, window, softcap)
    elif seg.context_len == 0:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa)
    else:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=seg.mask, scale=scaling, enable_gqa=gqa)
    return o[0].transpose(0, 1)                                              # [n, Hq, D]


def _masked_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: PrefillSegment, scaling: float,
                    window: int | None, softcap: float | None) -> torch.Tensor:
    """A prompt chunk under a sliding window or a softcap: an explicit mask over the
    chunk's query rows (positions context_len + i) and every key before them, and the
    scores in float32 as transformers' eager attention keeps them. [1, Hq, n, D]."""
    total = seg.context_len + seg.length
    rows = torch.arange(seg.context_len, total, device=q.device).unsqueeze(1)   # query positions
    columns = torch.arange(total, device=q.device).unsqueeze(0)
    allowed = columns <= rows
    if window is not None:
        allowed &= columns > rows - window
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scaling)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scaling               # [1, Hq, n, L]
    scores = torch.tanh(scores / softcap) * softcap
    scores.masked_fill_(~allowed, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1).to(v.dtype), v)


def register() -> str:
    """Register the paged attention with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION
