"""Prefix-aware routing: a Ray Serve RequestRouter that sends a prompt to the replica
that was last sent its longest known prefix, unless that replica is much busier than
the least busy one (docs/design.md section 16).

It runs in the front door's process (where the DeploymentHandle routes), so its
table sees every request; Ray Serve's PrefixCacheAffinityRouter was not taken: it
imports ray.llm (pyarrow, and vLLM for most of its uses), matches on characters of
the prompt text rather than token blocks, and keeps its tree in a separate actor
that it asks with blocking calls on every request."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any, Hashable, List, Optional

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

# Ray Serve pickles this module by value into the handle's router: state shared with
# the rest of the process (the decisions /health reports) lives in prefix_table, which
# is reached through its module (pickled by reference).
from ruvllm_cli.cluster import prefix_table
from ruvllm_cli.cluster.prefix_table import PrefixTable, prefix_hashes
from ruvllm_cli.cluster.spec import PREFIX_MAX_BLOCKS, PREFIX_TABLE_SIZE


class PrefixAffinityRouter(FIFOMixin, RequestRouter):
    """Longest known prefix first, power of two choices otherwise."""

    def initialize_state(self, block_size: int = 16, imbalance: int = 8, max_blocks: int = PREFIX_MAX_BLOCKS,
                         table_size: int = PREFIX_TABLE_SIZE) -> None:
        self._block_size, self._imbalance, self._max_blocks = block_size, imbalance, max_blocks
        self._table = PrefixTable(table_size)
        self._in_flight: Counter[ReplicaID] = Counter()   # routed by us and not yet completed

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        if not candidate_replicas:
            return []
        hashes = self._hashes(pending_request)
        match = self._table.match(hashes, {r.replica_id for r in candidate_replicas})
        spread = two_choices(candidate_replicas)
        if match.replica is None:
            return [spread]
        owner = next(r for r in candidate_replicas if r.replica_id == match.replica)
        least = min(candidate_replicas, key=lambda r: self._in_flight[r.replica_id])
        if self._in_flight[owner.replica_id] - self._in_flight[least.replica_id] > self._imbalance:
            return [[least], spread]   # routed there, the prefix moves with it
        return [[owner], spread]       # the owner unless its queue is full, then the usual two choices

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        hashes = self._hashes(pending_request)
        prefix_table.DECISIONS[self._kind(hashes, replica_id)] += 1
        self._table.record(hashes, replica_id)
        self._in_flight[replica_id] += 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self._in_flight[replica_id] > 0:
            self._in_flight[replica_id] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._drop(replica_id)

    def update_replicas(self, replicas: List[RunningReplica]) -> None:
        gone = set(self._replica_id_set) - {r.replica_id for r in replicas}
        super().update_replicas(replicas)
        for replica_id in gone:
            self._drop(replica_id)

    def _drop(self, replica_id: Hashable) -> None:
        self._table.forget(replica_id)
        self._in_flight.pop(replica_id, None)

    def _hashes(self, pending_request: Optional[PendingRequest]) -> list[int]:
        """The request's prefix block hashes (tens of microseconds: not worth keeping)."""
        if pending_request is None or not pending_request.args:
            return []
        job = pending_request.args[0]
        salt = (job.options.cache_salt, job.options.adapter)
        return prefix_hashes(job.prompt_ids, self._block_size, self._max_blocks, salt)

    def _kind(self, hashes: list[int], replica_id: ReplicaID) -> str:
        if not hashes:
            return "spread"
        match = self._table.match(hashes, set(self._replica_id_set))
        if match.replica is None:
            return "spread"
        return "affinity" if match.replica == replica_id else "rebalanced"


def two_choices(replicas: List[RunningReplica]) -> List[RunningReplica]:
    """Ray Serve's default: two replicas at random; the one with the shorter queue wins."""
    return random.sample(replicas, min(2, len(replicas)))
