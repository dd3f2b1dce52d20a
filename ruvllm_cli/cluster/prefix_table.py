"""Which replica holds which prompt prefix: the router's memory (no Ray import).

A prompt's full KV blocks are hashed as a chain, the way the engine's prefix cache
keys them (each block's hash covers its parent's, so equal hashes mean equal
prefixes); the table maps each chain hash to the replica that was last sent a
prompt through that block. A new prompt goes where its longest known prefix is."""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Hashable, Sequence

# How this process's routers placed requests, for /health: with their prefix's replica
# ("affinity"), away from it because it was busy ("rebalanced"), or with no known
# prefix ("spread"). Here, not in router.py: see the note there.
DECISIONS: Counter[str] = Counter({"affinity": 0, "rebalanced": 0, "spread": 0})


def routing_decisions() -> dict[str, int]:
    return dict(DECISIONS)


def prefix_hashes(prompt_ids: Sequence[int], block_size: int, max_blocks: int,
                  salt: Hashable = None) -> list[int]:
    """The chain hashes of the prompt's first full blocks (at most `max_blocks`).
    `salt` (cache salt, adapter) separates prompts the engine never shares blocks
    between. Like the engine, the last prompt token never counts: it is always computed."""
    full = min((len(prompt_ids) - 1) // block_size, max_blocks)
    hashes, parent = [], hash(("ruvllm-prefix", salt))
    for i in range(max(full, 0)):
        parent = hash((parent, tuple(prompt_ids[i * block_size:(i + 1) * block_size])))
        hashes.append(parent)
    return hashes


@dataclass(frozen=True)
class PrefixMatch:
    replica: Hashable | None   # where the longest known prefix was last sent (None: nowhere)
    blocks: int                # how many of the prompt's blocks that prefix covers


class PrefixTable:
    """Chain hash -> replica, least recently routed forgotten first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._owners: OrderedDict[int, Hashable] = OrderedDict()

    def __len__(self) -> int:
        return len(self._owners)

    def match(self, hashes: Sequence[int], replicas: set[Hashable]) -> PrefixMatch:
        """The longest prefix whose replica is among `replicas` (read-only)."""
        for depth in range(len(hashes), 0, -1):
            owner = self._owners.get(hashes[depth - 1])
            if owner is not None and owner in replicas:
                return PrefixMatch(owner, depth)
        return PrefixMatch(None, 0)

    def record(self, hashes: Sequence[int], replica: Hashable) -> None:
        """The prompt went to `replica`: its blocks now live there (and move there)."""
        for block_hash in hashes:
            self._owners[block_hash] = replica
            self._owners.move_to_end(block_hash)
        while len(self._owners) > self.capacity:
            self._owners.popitem(last=False)

    def forget(self, replica: Hashable) -> None:
        """A replica died or left: its cache went with it."""
        for block_hash in [h for h, owner in self._owners.items() if owner == replica]:
            del self._owners[block_hash]
