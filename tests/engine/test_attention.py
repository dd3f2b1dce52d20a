"""Decode attention over paged slots (SDPA for one request, batched matmuls with a
padding mask for several) matches plain attention over each request's own keys."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ruvllm_cli.engine import attention
from ruvllm_cli.engine.attention import PagedKVCache, StepMetadata

KV_HEADS, GROUPS, HEAD_DIM, BLOCK, NUM_BLOCKS = 2, 3, 16, 16, 32


def paged_step(lengths: list[int]) -> tuple[StepMetadata, list[torch.Tensor]]:
    """Random KV pool; each request gets random blocks. Returns the step and each
    request's slots in order."""
    cache = PagedKVCache(1, NUM_BLOCKS * BLOCK, KV_HEADS, HEAD_DIM, torch.float32, torch.device("cpu"))
    cache.keys[0].normal_()
    cache.values[0].normal_()
    longest = max(lengths)
    free = torch.randperm(NUM_BLOCKS).tolist()
    slots = []
    for n in lengths:
        table = [free.pop() for _ in range(-(-n // BLOCK))]
        slots.append(torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(n)]))
    # Rows padded with slot 0, as the model runner pads block tables with block 0.
    padded = torch.stack([torch.cat([s, s.new_zeros(longest - len(s))]) for s in slots])
    padding = torch.arange(longest).unsqueeze(0) >= torch.tensor(lengths).unsqueeze(1)
    step = StepMetadata(cache=cache, slot_mapping=torch.zeros(len(lengths), dtype=torch.long),
                        num_decodes=len(lengths), decode_slots=padded,
                        decode_padding=padding.view(len(lengths), 1, longest) if padding.any() else None)
    return step, slots


def reference(query: torch.Tensor, step: StepMetadata, slots: list[torch.Tensor], scale: float) -> torch.Tensor:
    rows = []
    for i, own in enumerate(slots):
        k = step.cache.keys[0][:, own].repeat_interleave(GROUPS, dim=0)      # [Hq, L, D]
        v = step.cache.values[0][:, own].repeat_interleave(GROUPS, dim=0)
        rows.append(F.scaled_dot_product_attention(query[0, :, i:i + 1], k, v, scale=scale)[:, 0])
    return torch.stack(rows)                                                  # [B, Hq, D]


@pytest.mark.parametrize("lengths", [[1], [17], [80], [3, 40, 33], [16, 16], [1, 64, 5, 20]])
@pytest.mark.parametrize("single_sdpa", [True, False])
def test_decode_attention_matches_plain_attention(lengths, single_sdpa, monkeypatch):
    torch.manual_seed(len(lengths) * 100 + sum(lengths))
    monkeypatch.setattr(attention, "SINGLE_DECODE_SDPA", single_sdpa)
    step, slots = paged_step(lengths)
    query = torch.randn(1, KV_HEADS * GROUPS, len(lengths), HEAD_DIM)
    out = attention._decode_attention(query, step.cache.keys[0], step.cache.values[0], step, 0.25)
    assert out.shape == (len(lengths), KV_HEADS * GROUPS, HEAD_DIM)
    assert torch.allclose(out, reference(query, step, slots, 0.25), atol=1e-5)
