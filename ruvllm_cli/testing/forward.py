"""One prompt through a loaded model's forward, outside an engine: the logits of a
single prefill step over a fresh paged KV cache, for the tests that compare two
models (ours and transformers' classes, streamed and not) token for token."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ruvllm_cli.engine.attention import PagedKVCache, PrefillSegment, StepMetadata
from ruvllm_cli.engine.model_runner import kv_layout


@torch.inference_mode()
def prefill_logits(model: Any, token_ids: Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Logits [T, V] of every position of `token_ids`, as one prompt chunk."""
    count = len(token_ids)
    cache = PagedKVCache(*_slots_layout(model, count), dtype, torch.device("cpu"))
    step = StepMetadata(cache=cache, slot_mapping=torch.arange(count))
    step.prefills.append(PrefillSegment(start=0, length=count, context_len=0))
    ids = torch.tensor([list(token_ids)])
    out = model(input_ids=ids, position_ids=torch.arange(count).unsqueeze(0), use_cache=False,
                logits_to_keep=0, ruvllm_step=step)
    return out.logits[0].float()


def _slots_layout(model: Any, count: int) -> tuple[int, int, int, int]:
    layers, kv_heads, head_dim = kv_layout(model.config)
    return layers, count, kv_heads, head_dim
