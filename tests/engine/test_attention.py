"""The decode attention's two paths (SDPA for one request, batched matmuls for
several) compute the same thing, and match plain attention over the gathered KV."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ruvllm_cli.engine import attention
from ruvllm_cli.engine.attention import PagedKVCache, StepMetadata


@pytest.mark.parametrize("length", [1, 17, 80])
def test_single_request_decode_paths_agree_with_reference(length, monkeypatch):
    torch.manual_seed(0)
    kv_heads, groups, head_dim, slots_total = 2, 3, 16, 256
    cache = PagedKVCache(1, slots_total, kv_heads, head_dim, torch.float32, torch.device("cpu"))
    cache.keys[0].normal_()
    cache.values[0].normal_()
    slots = torch.randperm(slots_total)[:length]
    query = torch.randn(1, kv_heads * groups, 1, head_dim)
    step = StepMetadata(cache=cache, slot_mapping=slots[-1:], num_decodes=1, decode_slots=slots.view(1, -1))
    outputs = {}
    for flag in (True, False):
        monkeypatch.setattr(attention, "SINGLE_DECODE_SDPA", flag)
        outputs[flag] = attention._decode_attention(query, cache.keys[0], cache.values[0], step, 0.25)
    k = cache.keys[0][:, slots].repeat_interleave(groups, dim=0)            # [Hq, L, D]
    v = cache.values[0][:, slots].repeat_interleave(groups, dim=0)
    expected = F.scaled_dot_product_attention(query[0], k, v, scale=0.25)   # [Hq, 1, D]
    for flag, out in outputs.items():
        assert out.shape == (1, kv_heads * groups, head_dim)
        assert torch.allclose(out[0], expected[:, 0], atol=1e-5), flag
