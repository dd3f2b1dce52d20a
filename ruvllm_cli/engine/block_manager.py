"""Paged KV-cache bookkeeping: block ids, reference counts and the prefix cache.

A fixed pool of `num_blocks` blocks of `block_size` token slots. A request holds a
block table (its blocks in order). Full blocks are identified by a hash chained over
the parent block's hash, the block's token ids and the request's cache salt and
LoRA adapter, so a later request with the same prefix (salt and adapter) can reuse them; a hit counts only when
the stored token ids match too (collision check).

Freed blocks keep their contents and hash and sit in an LRU free queue: a prefix
hit takes them back, and a new allocation evicts the least recently freed one.
Only full blocks are ever shared, and full blocks are never written again, so
shared blocks need no copy-on-write.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Sequence

from ruvllm_cli.engine.request import Request


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] = ()


@dataclass
class PrefixCacheStats:
    queries: int = 0          # prompt tokens looked up
    hits: int = 0             # prompt tokens found in the cache
    evictions: int = 0        # cached blocks reused for new content

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def hash_block(parent_hash: int | None, token_ids: Sequence[int], salt: object) -> int:
    return hash((parent_hash, tuple(token_ids), salt))


class BlockManager:
    """Owns the block pool. Read-only queries (`match_prefix`, `can_allocate`) come
    before any allocation, so the scheduler can decide without side effects."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        assert num_blocks > 0 and block_size > 0
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.stats = PrefixCacheStats()

    # ---- queries -------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def match_prefix(self, token_ids: Sequence[int], salt: object = None) -> list[int]:
        """Block ids of the longest cached prefix of `token_ids` (full blocks only).

        Capped one token short of the whole sequence, so the last token is always
        computed and yields logits. Changes nothing.
        """
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        parent: int | None = None
        for start in range(0, len(token_ids) - 1 - self.block_size + 1, self.block_size):
            chunk = tuple(token_ids[start:start + self.block_size])
            parent = hash_block(parent, chunk, salt)
            block_id = self.cached.get(parent)
            if block_id is None or self.blocks[block_id].token_ids != chunk:
                break
            hits.append(block_id)
        return hits

    # ---- allocation ----------------------------------------------------------
    def allocate_prefix(self, request: Request, block_ids: Iterable[int]) -> None:
        """Give a new request the cached blocks of its prefix (from `match_prefix`)."""
        assert not request.block_table
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_queue[block_id]
            block.ref_count += 1
            request.block_table.append(block_id)
            request.block_hashes.append(block.block_hash)  # type: ignore[arg-type]
        request.num_computed_tokens = len(request.block_table) * self.block_size

    def grow(self, request: Request, num_tokens: int) -> bool:
        """Make the block table cover `num_tokens` slots; False (and no change) if the pool is short."""
        needed = self.blocks_needed(num_tokens) - len(request.block_table)
        if needed <= 0:
            return True
        if needed > self.num_free_blocks:
            return False
        for _ in range(needed):
            request.block_table.append(self._take_free_block())
        return True

    def _take_free_block(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            # Evicting a cached block: forget its hash (if it still owns it).
            if self.cached.get(block.block_hash) == block_id:
                del self.cached[block.block_hash]
            self.stats.evictions += 1
            block.block_hash, block.token_ids = None, ()
        block.ref_count = 1
        return block_id

    def free(self, request: Request) -> None:
        """Drop the request's references; blocks keep their hash for later hits.

        Tail blocks are queued first, so the LRU evicts the end of a prefix chain
        before its beginning (the beginning is what other requests share).
        """
        for block_id in reversed(request.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed too often"
            if block.ref_count == 0:
                if block.block_hash is None:
                    self.free_queue[block_id] = None
                    self.free_queue.move_to_end(block_id, last=False)  # empty blocks go first
                else:
                    self.free_queue[block_id] = None
        request.block_table.clear()
        request.block_hashes.clear()

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's newly completed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        size = self.block_size
        num_full = min(request.num_computed_tokens // size, len(request.block_table))
        tokens = request.all_token_ids
        parent = request.block_hashes[-1] if request.block_hashes else None
        for index in range(len(request.block_hashes), num_full):
            chunk = tuple(tokens[index * size:(index + 1) * size])
            parent = hash_block(parent, chunk, request.prefix_salt)
            request.block_hashes.append(parent)
            block = self.blocks[request.block_table[index]]
            if parent not in self.cached:
                self.cached[parent] = block.block_id
                block.block_hash, block.token_ids = parent, chunk

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.stats.queries += num_tokens
        self.stats.hits += num_hit_tokens

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (contents are simply overwritten later)."""
        for block in self.blocks:
            block.block_hash, block.token_ids = None, ()
        self.cached.clear()

    # ---- invariants ------------------------------------------------------------
    def check_integrity(self, requests: Iterable[Request] | None = None) -> None:
        """Prove free + used = total and, given every live request, that reference
        counts match the block tables."""
        refs = [0] * self.num_blocks
        for request in requests or ():
            for block_id in request.block_table:
                refs[block_id] += 1
        free = set(self.free_queue)
        assert len(free) == len(self.free_queue)
        used = {b.block_id for b in self.blocks if b.ref_count > 0}
        assert not free & used, f"blocks both free and used: {sorted(free & used)}"
        assert len(free) + len(used) == self.num_blocks, "free + used != total"
        if requests is not None:
            for block in self.blocks:
                assert block.ref_count == refs[block.block_id], (
                    f"block {block.block_id}: ref_count {block.ref_count}, held {refs[block.block_id]} times")
        for block_hash, block_id in self.cached.items():
            assert self.blocks[block_id].block_hash == block_hash, f"cached hash of block {block_id} is stale"


class SwapSpace:
    """Block ids of the swap pool (`--preemption-mode swap`): a preempted request's KV
    blocks are copied there and back instead of being recomputed. Bookkeeping only;
    the model runner holds the pool's tensors and does the copies."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.free_blocks: list[int] = list(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def allocate(self, count: int) -> list[int] | None:
        """`count` free blocks, or None (and no change) when the pool is short."""
        if count > len(self.free_blocks):
            return None
        taken, self.free_blocks = self.free_blocks[:count], self.free_blocks[count:]
        return taken

    def release(self, blocks: Iterable[int]) -> None:
        self.free_blocks.extend(blocks)

    def check_integrity(self, requests: Iterable[Request]) -> None:
        """Free + held by swapped-out requests = total, each block held once."""
        held = [b for r in requests if r.swapped is not None for b in r.swapped.blocks]
        assert len(held) == len(set(held)), "a swap block is held twice"
        assert not set(held) & set(self.free_blocks), "a swap block is both free and held"
        assert len(held) + len(self.free_blocks) == self.num_blocks, "swap pool: free + held != total"
