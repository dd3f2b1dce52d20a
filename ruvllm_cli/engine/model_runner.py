"""Device work of one engine step: packs the scheduled chunks into one forward pass."""

from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Iterator, Sequence

import torch

from ruvllm_cli.engine.attention import PagedKVCache, PrefillSegment, StepMetadata
from ruvllm_cli.engine.fused import DecodeBatch, FusedDecoder, fused_decoder
from ruvllm_cli.engine.loader import free_memory
from ruvllm_cli.engine.lora import AdapterError, LoRAManager
from ruvllm_cli.engine.request import Request
from ruvllm_cli.engine.scheduler import ScheduledChunk
from ruvllm_cli.quantization import Quantization


def kv_layout(config: Any) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) from a transformers config."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, kv_heads, head_dim


def kv_bytes_per_block(config: Any, dtype: torch.dtype, block_size: int) -> int:
    return block_size * PagedKVCache.bytes_per_slot(*kv_layout(config), dtype)


def kv_cache_dtype(loaded: Any) -> torch.dtype:
    """The KV cache's dtype: the activations', except where a quantized model runs float32
    activations on a CPU (q8, and f16 on float16 weights): its keys and values are held in
    float16, as llama.cpp holds them, half the bytes a decode step reads and the pool
    keeps (docs/design.md, section 21). `-q none` keeps float32, the reference."""
    if (loaded.device.type == "cpu" and loaded.dtype == torch.float32
            and loaded.quantization in (Quantization.Q8_0, Quantization.F16)):
        return torch.float16
    return loaded.dtype


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


def sdpa_backends(device: torch.device) -> AbstractContextManager[Any]:
    """On CUDA, SDPA without its cuDNN backend: cuDNN builds a plan for every new
    key length, and a decode step brings a new one each time (a cold single stream
    ran at a quarter of its warm rate on an H100; docs/design.md section 5)."""
    if device.type != "cuda":
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


class ModelRunner:
    """Owns the model and the KV pools; `execute` returns next-token logits."""

    def __init__(self, model: Any, num_blocks: int, block_size: int, device: torch.device,
                 dtype: torch.dtype, lora: LoRAManager | None = None, swap_blocks: int = 0,
                 fused: bool = True, kv_dtype: torch.dtype | None = None) -> None:
        self.model = model
        self.kv_dtype = kv_dtype or dtype
        # Decode-only steps of Llama-family models on a CPU: our fused step (engine/fused.py).
        self.fused: FusedDecoder | None = (fused_decoder(model, dtype, device, block_size, self.kv_dtype)
                                           if fused else None)
        self.fused_steps = 0
        self.lora = lora
        self.scaling_cache: PagedKVCache | None = None   # X-LoRA's scaling pass (ensure_scaling_cache)
        self.block_size = block_size
        self.device = device
        self.num_layers, self.num_kv_heads, self.head_dim = kv_layout(model.config)
        self.dtype = dtype
        self.cache = PagedKVCache(self.num_layers, num_blocks * block_size, self.num_kv_heads,
                                  self.head_dim, self.kv_dtype, device)
        # Preemption by swap: a pool of its own in host memory (on a CPU, beside the cache).
        self.swap_pool = PagedKVCache(self.num_layers, swap_blocks * block_size, self.num_kv_heads, self.head_dim,
                                      self.kv_dtype, torch.device("cpu"), zeroed=False) if swap_blocks else None

    def ensure_scaling_cache(self) -> None:
        """The second KV pool X-LoRA's scaling pass writes (same block ids, same size)."""
        if self.scaling_cache is None:
            keys = self.cache.keys[0]
            needed = 2 * len(self.cache.keys) * keys.nbytes
            free = free_memory(self.device)
            if needed > free * 0.9:
                raise AdapterError(f"X-LoRA needs a second KV pool of {needed / 2**20:,.0f} MiB for its scaling "
                                   f"pass; {free / 2**20:,.0f} MiB is free (a smaller --kv-cache-memory leaves room)")
            self.scaling_cache = PagedKVCache(self.num_layers, keys.shape[1], self.num_kv_heads, self.head_dim,
                                              self.kv_dtype, self.device)

    @torch.inference_mode()
    def execute(self, chunks: Sequence[ScheduledChunk]) -> tuple[torch.Tensor | None, list[Request]]:
        """Run the step; returns logits [S, V] for the requests whose prompt (or
        decode) completes this step, in that order."""
        # Decodes grouped by adapter: each adapter's tokens form few contiguous segments.
        decodes = sorted((c for c in chunks if c.num_new_tokens == 1), key=lambda c: c.request.adapter_uid)
        prefills = [c for c in chunks if c.num_new_tokens > 1]
        ordered = decodes + prefills
        if self._fusable(decodes, prefills):
            with self._adapters(len(decodes), adapter_segments(decodes), []):
                logits = self.fused(self._decode_batch(decodes), self.cache)
            self.fused_steps += 1
            return logits, [c.request for c in decodes]
        input_ids, positions, step = self._pack(ordered, self.cache)
        sample_rows: list[int] = []
        sampled: list[Request] = []
        end = 0
        for chunk in ordered:
            end += chunk.num_new_tokens
            if chunk.completes:
                sample_rows.append(end - 1)
                sampled.append(chunk.request)
        if not sampled:
            # Prompt chunks that complete nothing still fill the cache: run them with
            # one kept row to keep the LM head cheap, and drop the logits.
            sample_rows = [end - 1]
        segments = adapter_segments(ordered)
        mixtures = self._mixtures(ordered) if segments else []
        if mixtures:   # X-LoRA tokens take their experts, not a slot
            segments = [s for s in segments if not self.lora.is_mixture(s[2])]
        with self._adapters(input_ids.shape[1], segments, mixtures), sdpa_backends(self.device):
            out = self.model(input_ids=input_ids, position_ids=positions,
                             logits_to_keep=self._tensor(sample_rows), use_cache=False, ruvllm_step=step)
        return (out.logits[0] if sampled else None), sampled

    def _fusable(self, decodes: list[ScheduledChunk], prefills: list[ScheduledChunk]) -> bool:
        """A step for the fused decoder: decodes alone, each giving logits, no X-LoRA."""
        if self.fused is None or prefills or not all(c.completes for c in decodes):
            return False
        return self.lora is None or not any(self.lora.is_mixture(c.request.adapter_uid)
                                            for c in decodes if c.request.adapter_uid)

    @contextmanager
    def _adapters(self, tokens: int, segments: list[tuple[int, int, int]], mixtures: list[Any]) -> Iterator[None]:
        """The step's adapter rows published to the LoRA wrappers for the forward's span."""
        if not (segments or mixtures):
            yield
            return
        assert self.lora is not None
        self.lora.begin_step(tokens, segments, mixtures)
        try:
            yield
        finally:
            self.lora.end_step()

    def _decode_batch(self, decodes: list[ScheduledChunk]) -> DecodeBatch:
        size = self.block_size
        starts = [c.start for c in decodes]
        last = max(starts)
        width = last // size + 1
        tables = [c.request.block_table[:width] for c in decodes]
        # ids, positions and slots in one tensor (a row each): one conversion, not three
        rows = self._tensor([[c.request.all_token_ids[c.start] for c in decodes], starts,
                             [self._slots(t, p, p + 1)[0] for t, p in zip(tables, starts)]])
        return DecodeBatch(
            input_ids=rows[0], positions=rows[1].unsqueeze(0), slots=rows[2],
            tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
            lengths=torch.tensor([p + 1 for p in starts], dtype=torch.int32), last_position=last)

    def _pack(self, ordered: Sequence[ScheduledChunk], cache: PagedKVCache
              ) -> tuple[torch.Tensor, torch.Tensor, StepMetadata]:
        """Input ids and positions [1, T] of the chunks packed in order, and their step
        metadata over `cache` (decodes come first in `ordered`)."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for chunk in ordered:
            start, end = chunk.start, chunk.start + chunk.num_new_tokens
            input_ids += chunk.request.all_token_ids[start:end]
            positions += range(start, end)
            slots += self._slots(chunk.request.block_table, start, end)
        step = StepMetadata(cache=cache, slot_mapping=self._tensor(slots))
        decodes = [c for c in ordered if c.num_new_tokens == 1]
        self._describe_decodes(step, decodes)
        self._describe_prefills(step, list(ordered[len(decodes):]), offset=len(decodes))
        return self._tensor(input_ids).unsqueeze(0), self._tensor(positions).unsqueeze(0), step

    def _mixtures(self, ordered: Sequence[ScheduledChunk]) -> list[tuple[int, int, Any, torch.Tensor]]:
        """X-LoRA: the scaling pass over this step's X-LoRA chunks (their own KV pool),
        then each token's expert weights; as (start, end, adapter, scalings) segments
        of the main pass, one per chunk."""
        assert self.lora is not None
        placed, offset, row = [], 0, 0   # (chunk, first token in the main pass, in the scaling pass, adapter)
        for chunk in ordered:
            if self.lora.is_mixture(chunk.request.adapter_uid):
                placed.append((chunk, offset, row, self.lora.by_uid(chunk.request.adapter_uid)))
                row += chunk.num_new_tokens
            offset += chunk.num_new_tokens
        if not placed:
            return []
        assert self.scaling_cache is not None, "an X-LoRA adapter is installed with its KV pool"
        input_ids, positions, step = self._pack([chunk for chunk, _, _, _ in placed], self.scaling_cache)
        constant = [(row, row + chunk.num_new_tokens, adapter, scalings) for chunk, _, row, adapter in placed
                    if (scalings := adapter.pass_scalings(chunk.num_new_tokens)) is not None]
        self.lora.begin_step(input_ids.shape[1], [], constant)
        try:
            hidden = self.model.get_decoder()(input_ids=input_ids, position_ids=positions, use_cache=False,
                                              ruvllm_step=step).last_hidden_state[0]
        finally:
            self.lora.end_step()
        return [(start, start + chunk.num_new_tokens, adapter,
                 adapter.scalings(hidden[row:row + chunk.num_new_tokens])) for chunk, start, row, adapter in placed]

    @torch.inference_mode()
    def swap(self, out: Sequence[tuple[int, int]], back: Sequence[tuple[int, int]]) -> None:
        """Copy (device block -> swap block) pairs out, then (swap block -> device block)
        pairs back in: a block freed by a swap-out may be the target of a swap-in."""
        assert self.swap_pool is not None
        for pairs, source, target in ((out, self.cache, self.swap_pool), (back, self.swap_pool, self.cache)):
            if not pairs:
                continue
            src = self._block_slots([[s for s, _ in pairs]], len(pairs) * self.block_size)[0]
            dst = self._block_slots([[d for _, d in pairs]], len(pairs) * self.block_size)[0]
            for pool_from, pool_to in ((source.keys, target.keys), (source.values, target.values)):
                for layer_from, layer_to in zip(pool_from, pool_to):
                    rows = layer_from.index_select(1, src.to(layer_from.device))
                    layer_to.index_copy_(1, dst.to(layer_to.device), rows.to(layer_to.device))

    def _tensor(self, values: Sequence[int] | Sequence[Sequence[int]]) -> torch.Tensor:
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
