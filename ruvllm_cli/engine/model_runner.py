"""Device work of one engine step: packs the scheduled chunks into one forward pass."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ruvllm_cli.engine.attention import PagedKVCache, PrefillSegment, StepMetadata
from ruvllm_cli.engine.lora import LoRAManager
from ruvllm_cli.engine.request import Request
from ruvllm_cli.engine.scheduler import ScheduledChunk


def kv_layout(config: Any) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) from a transformers config."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, kv_heads, head_dim


def kv_bytes_per_block(config: Any, dtype: torch.dtype, block_size: int) -> int:
    return block_size * PagedKVCache.bytes_per_slot(*kv_layout(config), dtype)


def adapter_segments(chunks: Sequence[ScheduledChunk]) -> list[tuple[int, int, int]]:
    """(first token, end, adapter uid) of the packed step's tokens that use an adapter,
    adjacent chunks of one adapter merged."""
    segments: list[tuple[int, int, int]] = []
    offset = 0
    for chunk in chunks:
        end, uid = offset + chunk.num_new_tokens, chunk.request.adapter_uid
        if uid:
            if segments and segments[-1][1] == offset and segments[-1][2] == uid:
                segments[-1] = (segments[-1][0], end, uid)
            else:
                segments.append((offset, end, uid))
        offset = end
    return segments


class ModelRunner:
    """Owns the model and the KV pools; `execute` returns next-token logits."""

    def __init__(self, model: Any, num_blocks: int, block_size: int, device: torch.device,
                 dtype: torch.dtype, lora: LoRAManager | None = None) -> None:
        self.model = model
        self.lora = lora
        self.block_size = block_size
        self.device = device
        self.num_layers, self.num_kv_heads, self.head_dim = kv_layout(model.config)
        self.dtype = dtype
        self.cache = PagedKVCache(self.num_layers, num_blocks * block_size, self.num_kv_heads,
                                  self.head_dim, self.dtype, device)

    @torch.inference_mode()
    def execute(self, chunks: Sequence[ScheduledChunk]) -> tuple[torch.Tensor | None, list[Request]]:
        """Run the step; returns logits [S, V] for the requests whose prompt (or
        decode) completes this step, in that order."""
        # Decodes grouped by adapter: each adapter's tokens form few contiguous segments.
        decodes = sorted((c for c in chunks if c.num_new_tokens == 1), key=lambda c: c.request.adapter_uid)
        prefills = [c for c in chunks if c.num_new_tokens > 1]
        ordered = decodes + prefills
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sampled: list[Request] = []
        for chunk in ordered:
            start, end = chunk.start, chunk.start + chunk.num_new_tokens
            input_ids += chunk.request.all_token_ids[start:end]
            positions += range(start, end)
            slots += self._slots(chunk.request.block_table, start, end)
            if chunk.completes:
                sample_rows.append(len(input_ids) - 1)
                sampled.append(chunk.request)
        step = StepMetadata(cache=self.cache, slot_mapping=self._tensor(slots))
        self._describe_decodes(step, decodes)
        self._describe_prefills(step, prefills, offset=len(decodes))
        if not sampled:
            # Prompt chunks that complete nothing still fill the cache: run them with
            # one kept row to keep the LM head cheap, and drop the logits.
            sample_rows = [len(input_ids) - 1]
        segments = adapter_segments(ordered)
        if segments:
            assert self.lora is not None
            self.lora.begin_step(segments)
        try:
            out = self.model(input_ids=self._tensor(input_ids).unsqueeze(0),
                             position_ids=self._tensor(positions).unsqueeze(0),
                             logits_to_keep=self._tensor(sample_rows), use_cache=False, ruvllm_step=step)
        finally:
            if segments:
                self.lora.end_step()
        return (out.logits[0] if sampled else None), sampled

    def _tensor(self, values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        size = self.block_size
        return [block_table[p // size] * size + p % size for p in range(start, end)]

    def _block_slots(self, tables: list[list[int]], length: int) -> torch.Tensor:
        """[B, length] slots of the first `length` positions of each block table."""
        width = -(-length // self.block_size)
        padded = [t[:width] + [0] * (width - len(t[:width])) for t in tables]
        blocks = self._tensor([b for row in padded for b in row]).view(len(tables), width)
        offsets = torch.arange(self.block_size, device=self.device)
        return (blocks.unsqueeze(-1) * self.block_size + offsets).view(len(tables), -1)[:, :length]

    def _describe_decodes(self, step: StepMetadata, decodes: list[ScheduledChunk]) -> None:
        if not decodes:
            return
        lengths = [c.start + 1 for c in decodes]
        longest = max(lengths)
        step.num_decodes = len(decodes)
        step.decode_slots = self._block_slots([c.request.block_table for c in decodes], longest)
        if min(lengths) != longest:
            positions = torch.arange(longest, device=self.device)
            padding = positions.unsqueeze(0) >= self._tensor(lengths).unsqueeze(1)
            step.decode_padding = padding.view(len(decodes), 1, longest)  # broadcasts over [Hkv, B, G, L]

    def _describe_prefills(self, step: StepMetadata, prefills: list[ScheduledChunk], offset: int) -> None:
        for chunk in prefills:
            seg = PrefillSegment(start=offset, length=chunk.num_new_tokens, context_len=chunk.start)
            if chunk.start:
                total = chunk.start + chunk.num_new_tokens
                seg.slots = self._block_slots([chunk.request.block_table], total)[0]
                rows = torch.arange(chunk.num_new_tokens, device=self.device).unsqueeze(1) + chunk.start
                seg.mask = torch.arange(total, device=self.device).unsqueeze(0) <= rows
            step.prefills.append(seg)
            offset += chunk.num_new_tokens
