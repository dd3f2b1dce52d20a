"""What runs the engine behind `ruvllm serve`: an EngineLoop in this process, or
Ray Serve replicas with --replicas (Ray is imported only then)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from ruvllm_cli.cli.context import AppContext
from ruvllm_cli.registry.locate import LocatedModel

if TYPE_CHECKING:
    from ruvllm_cli.cluster.deploy import Cluster
    from ruvllm_cli.cluster.spec import ClusterOptions
    from ruvllm_cli.server.engine_client import EngineClient

# How long a stopping server waits for the engine to finish its current step: the
# process exits regardless (os._exit), and the replies have all been sent by then.
ENGINE_STOP_TIMEOUT = 0.3


def engine_options(options: dict[str, Any]) -> dict[str, Any]:
    """open_engine's keyword arguments from the serve command's options."""
    from ruvllm_cli.cli.options import prefix_caching

    return dict(
        quantization=options["quantization"], device=options["device"], max_num_seqs=options["max_concurrent"],
        max_model_len=options["max_context"], max_num_batched_tokens=options["max_num_batched_tokens"],
        kv_cache_memory=options["kv_cache_memory"], enable_prefix_caching=prefix_caching(options["no_prefix_cache"]),
        weight_cache=not options["no_weight_cache"], max_loras=options["max_loras"],
        max_lora_rank=options["max_lora_rank"], scheduling_policy=options["scheduling_policy"],
        preemption_mode=options["preemption_mode"], swap_space=options["swap_space"],
        kernels=not options["no_compile"], threads=options["threads"])


class LocalBackend:
    """The model loaded here, run by an EngineLoop thread."""

    def __init__(self, opened: Any) -> None:
        self.opened = opened          # cli.engine_setup.OpenedEngine
        self.located: LocatedModel = opened.located
        self.engine_loop: Any = None

    def describe(self) -> str:
        return self.opened.describe()

    def kv_summary(self) -> str | None:
        return self.opened.kv_summary()

    def context_note(self, asked: int) -> str | None:
        return self.opened.context_note(asked)

    def replicas_line(self) -> str | None:
        return None

    def start(self, on_failure: Callable[[BaseException], None]) -> Any:
        from ruvllm_cli.engine.loop import EngineLoop

        self.engine_loop = EngineLoop(self.opened.engine, on_failure=on_failure)
        return self.engine_loop

    def stop(self) -> None:
        if self.engine_loop is not None:
            self.engine_loop.shutdown(ENGINE_STOP_TIMEOUT)


def load_local(app: AppContext, options: dict[str, Any]) -> LocalBackend:
    from ruvllm_cli.cli.engine_setup import open_engine

    from ruvllm_cli.engine.tokenizer import warm_up

    opened = open_engine(app, options["model"], adapters=options["adapters"],
                         skip_bad_adapters=options.get("skip_bad_adapters", False), **engine_options(options))
    opened.check_served_context()
    warm_up(opened.engine.tokenizer)   # before the first chat request, not during it
    return LocalBackend(opened)


@dataclass
class ClusterBackend:
    """Replicas on a Ray cluster, reached through `client` (cluster.client.RayEngineClient)."""

    located: LocatedModel
    options: "ClusterOptions"
    cluster: "Cluster"
    client: Any = None

    def describe(self) -> str:
        return self.client.engine.facts.described

    def kv_summary(self) -> str | None:
        return f"{self.client.engine.facts.kv_summary} per replica"

    def context_note(self, asked: int) -> str | None:
        return None   # each replica's own start line gives its context

    def replicas_line(self) -> str:
        o = self.options
        where = "a local Ray cluster (127.0.0.1)" if self.cluster.started_ray else f"Ray at {o.ray_address}"
        count = f"{o.min_replicas}-{o.max_replicas} (autoscaled, {o.replicas} at start)" if o.autoscaling \
            else str(o.replicas)
        gpus = f", {o.gpus_per_replica:g} GPU" if o.gpus_per_replica else ""
        threads = f"{o.threads_per_replica} CPU thread{'s' if o.threads_per_replica != 1 else ''}"
        return f"{count} x ({threads}{gpus}) on {where}; prefix-aware routing"

    def start(self, on_failure: Callable[[BaseException], None]) -> "EngineClient":
        return self.client   # Ray restarts a failed replica: the server itself goes on

    def stop(self) -> None:
        if self.client is not None:
            self.client.close()
        self.cluster.stop()


@dataclass
class Pending:
    """A cluster started while the model loads, so a stop before it is ready ends it too;
    `on_connected` is called (in the loading thread) once Ray is up."""

    clusters: list["Cluster"] = field(default_factory=list)
    on_connected: Callable[[], None] = lambda: None

    def stop(self) -> None:
        while self.clusters:
            self.clusters.pop().stop()


def load_cluster(app: AppContext, options: dict[str, Any], cluster_options: "ClusterOptions",
                 pending: Pending) -> ClusterBackend:
    """Start or join Ray, deploy the replicas and wait until they answer."""
    from ruvllm_cli.cluster.deploy import Cluster, app_name_for, deploy
    from ruvllm_cli.cluster.spec import ReplicaSpec
    from ruvllm_cli.registry.locate import locate_model

    located = locate_model(options["model"], app.cache_dir, options["quantization"])
    app_name = app_name_for(located.served_name, options["port"])
    # The server writes nothing to stdout, but Ray's driver prints the cluster's error
    # messages there ("a worker died"): logs belong on stderr.
    sys.stdout = sys.stderr
    cluster = Cluster(cluster_options, app_name, app.verbose)
    pending.clusters.append(cluster)
    cluster.connect()
    pending.on_connected()
    spec = ReplicaSpec(options["model"], str(app.cache_dir), engine_options(options),
                       tuple((name, str(path)) for name, path in options["adapters"]),
                       cluster_options.threads_per_replica, app.verbose)
    backend = ClusterBackend(located, cluster_options, cluster)
    backend.client = deploy(cluster_options, spec, app_name)
    pending.clusters.remove(cluster)
    return backend
