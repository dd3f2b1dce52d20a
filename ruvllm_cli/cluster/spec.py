"""What `ruvllm serve --replicas` asks of the cluster, as plain data (no Ray import)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ruvllm_cli.errors import UsageError

# A replica is skipped for a prefix it holds once it has this many more requests in
# flight than the least busy replica, as a share of one engine's batch (--max-concurrent).
IMBALANCE_SHARE = 0.5
# The router remembers this many prefix blocks (of all replicas together), least
# recently routed forgotten first: about 16 bytes of hash and 8 of id each.
PREFIX_TABLE_SIZE = 200_000
# Prefix blocks hashed per request: a 16-token block each, so the first 2,048 tokens.
PREFIX_MAX_BLOCKS = 128


@dataclass(frozen=True)
class ReplicaSpec:
    """What each replica needs to build its engine: the arguments `ruvllm serve`
    passes to open_engine in a single process, and its share of the machine."""

    model: str
    cache_dir: str
    engine_options: dict[str, Any] = field(default_factory=dict)   # open_engine's keyword arguments
    adapters: tuple[tuple[str, str], ...] = ()                       # (name, directory) of --lora
    threads: int = 1
    verbose: bool = False


@dataclass(frozen=True)
class ClusterOptions:
    """--replicas, --min-replicas, --max-replicas, --ray-address and the per-replica shares."""

    replicas: int
    min_replicas: int
    max_replicas: int
    ray_address: str | None = None      # None: start a local cluster bound to 127.0.0.1
    threads_per_replica: int = 1
    gpus_per_replica: float = 0.0
    max_concurrent: int = 16            # one engine's batch (--max-concurrent)

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas != self.max_replicas

    @property
    def imbalance(self) -> int:
        """In-flight requests by which a prefix's replica may lead the least busy one."""
        return max(1, round(self.max_concurrent * IMBALANCE_SHARE))


def cluster_options(options: dict[str, Any]) -> ClusterOptions | None:
    """The serve command's options as ClusterOptions; None without --replicas or
    --min/--max-replicas (one process, no Ray)."""
    replicas, low, high = options["replicas"], options["min_replicas"], options["max_replicas"]
    if replicas is None and low is None and high is None:
        given = [flag for flag, value in (("--ray-address", options.get("ray_address")),
                                          ("--threads-per-replica", options.get("threads_per_replica")),
                                          ("--gpus-per-replica", options.get("gpus_per_replica")))
                 if value]
        if given:   # they had been ignored: one process served, no Ray
            raise UsageError(f"{given[0]} needs --replicas (or --min-replicas/--max-replicas)",
                             "add --replicas N to serve on Ray, or leave it out for one process")
        return None
    if options.get("threads"):
        raise UsageError("--threads is for one process; with --replicas give --threads-per-replica",
                         f"--threads-per-replica {options['threads']}")
    if options.get("allow_runtime_lora"):
        raise UsageError("--allow-runtime-lora does not work with --replicas",
                         "give the adapters with --lora; every replica loads them at start")
    low = low if low is not None else min(replicas or 1, high or replicas or 1)
    high = high if high is not None else max(replicas or low, low)
    replicas = replicas if replicas is not None else low
    if low > high:
        raise UsageError(f"--min-replicas {low} is more than --max-replicas {high}")
    if not low <= replicas <= high:
        raise UsageError(f"--replicas {replicas} must lie between --min-replicas {low} and --max-replicas {high}")
    threads = options["threads_per_replica"] or max(1, (os.cpu_count() or 1) // replicas)
    return ClusterOptions(replicas, low, high, options["ray_address"], threads, options["gpus_per_replica"],
                          options["max_concurrent"])
