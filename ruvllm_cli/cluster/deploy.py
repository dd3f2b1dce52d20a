"""Start or join a Ray cluster and deploy the replicas (Ray Serve, no HTTP proxy:
our aiohttp app is the front door, and it reaches the replicas through a handle)."""

from __future__ import annotations

import logging
import os
import queue
import re
import threading
from typing import Any

from ruvllm_cli.cluster.spec import ClusterOptions, ReplicaSpec
from ruvllm_cli.errors import RuvllmError

DEPLOYMENT = "EngineReplica"
HEALTH_CHECK_PERIOD_S = 5.0
HEALTH_CHECK_TIMEOUT_S = 30.0       # a step of a big prompt may hold the replica's loop a while
# A replica the autoscaler removes finishes its requests for up to this long first (at a
# server stop the front door has already drained them, so it is quick then).
GRACEFUL_SHUTDOWN_S = 60.0
# Beyond its batch a replica may hold as many again waiting in its engine; more wait in the router.
QUEUE_PER_BATCH = 2


class Cluster:
    """Ray as `ruvllm serve --replicas` joined or started it, until `stop`.

    Ray starts a local cluster's processes with PR_SET_PDEATHSIG, which Linux ties to
    the *thread* that started them: started from the short-lived loading thread they
    were killed the moment it ended. So one thread connects and then lives, idle,
    until the server stops."""

    def __init__(self, options: ClusterOptions, app_name: str, verbose: bool) -> None:
        self.app_name = app_name
        self.started_ray = options.ray_address is None   # a local cluster of our own: shut down whole
        self._stopping = threading.Event()
        self._connected: queue.Queue[BaseException | None] = queue.Queue()
        self._thread = threading.Thread(target=self._host, args=(options, verbose), name="ruvllm-ray", daemon=True)

    def connect(self) -> None:
        self._thread.start()
        error = self._connected.get()
        if error is not None:
            raise error

    def stop(self, timeout: float = 30.0) -> None:
        if self._thread.is_alive():
            self._stopping.set()
            self._thread.join(timeout)

    def _host(self, options: ClusterOptions, verbose: bool) -> None:
        try:
            connect(options, verbose)
        except BaseException as error:  # noqa: BLE001 - handed to the thread that waits
            import ray

            if ray.is_initialized():   # up, then refused (too few GPUs): not left running
                ray.shutdown()
            self._connected.put(error)
            return
        self._connected.put(None)
        self._stopping.wait()
        import ray
        from ray import serve

        try:
            if not self.started_ray:
                serve.delete(self.app_name)   # leave the cluster as we found it
        finally:
            ray.shutdown()


def app_name_for(served_name: str, port: int) -> str:
    """One app per front door (this host, its port) and model: restarting `ruvllm serve`
    on that port replaces the old replicas. It had been one per model name, so two front
    doors on one cluster (or two models in directories of one name) took over and then
    deleted each other's replicas (a helper's pass)."""
    import socket

    name = f"{served_name}-{socket.gethostname()}-{port}"
    return "ruvllm-" + (re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-") or "model")


def import_ray(options: ClusterOptions) -> None:
    """Import Ray Serve (a one-line error when the `cluster` extra is missing), set up
    for a local cluster when no --ray-address is given."""
    # Read by ray at import: no Ray call may start a cluster of its own. A stop while
    # the replicas deploy shuts Ray down under the deploying thread, whose next Serve
    # call had started a second local cluster, part of which outlived the server.
    os.environ.setdefault("RAY_ENABLE_AUTO_CONNECT", "0")
    if options.ray_address is None:
        # Read by ray at import: the node's address becomes 127.0.0.1, so its servers bind
        # the loopback interface only (a local cluster has no other node to talk to).
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        import ray.serve  # noqa: F401
    except ImportError as error:
        raise RuvllmError("--replicas needs Ray Serve, which is not installed",
                          'pip install "ruvllm-cli[cluster]"') from error


def connect(options: ClusterOptions, verbose: bool) -> None:
    """Join --ray-address, or start a local cluster bound to 127.0.0.1."""
    import ray

    level = logging.INFO if verbose else logging.WARNING
    if not verbose:
        quiet_logs("ray")
    if options.ray_address is None:
        cpus = max(os.cpu_count() or 1, options.max_replicas * options.threads_per_replica)
        ray.init(address="local", include_dashboard=False, num_cpus=cpus, logging_level=level,
                 log_to_driver=verbose)
    else:
        reachable(options.ray_address)
        try:
            ray.init(address=options.ray_address, logging_level=level, log_to_driver=verbose)
        except (ConnectionError, ValueError) as error:
            raise RuvllmError(f"cannot join the Ray cluster at {options.ray_address}: {error}",
                              "start one with `ray start --head`, or leave out --ray-address") from error
    check_gpus(options, float(ray.cluster_resources().get("GPU", 0)))


RAY_CONNECT_TIMEOUT_S = 10.0


def reachable(address: str) -> None:
    """A `host:port` address answers on its port, within RAY_CONNECT_TIMEOUT_S: ray.init
    waits for an unreachable one for good (retrying, its warnings naming this machine's
    address, not the one given). `auto` and other forms are left to Ray."""
    import socket

    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=RAY_CONNECT_TIMEOUT_S).close()
    except OSError as error:
        raise RuvllmError(f"cannot join the Ray cluster at {address}: {error.strerror or error}",
                          "start one with `ray start --head`, or leave out --ray-address") from None


def check_gpus(options: ClusterOptions, gpus: float) -> None:
    """--gpus-per-replica on a cluster with too few GPUs: the replicas would wait for
    them for good, the server answering 503 with nothing said."""
    needed = options.gpus_per_replica * options.min_replicas
    if needed > gpus:
        where = "this machine" if options.ray_address is None else f"the Ray cluster at {options.ray_address}"
        raise RuvllmError(f"--gpus-per-replica {options.gpus_per_replica:g} x {options.min_replicas} "
                          f"replica{'s' if options.min_replicas != 1 else ''} needs {needed:g} GPUs; {where} "
                          f"has {gpus:g}", "leave out --gpus-per-replica, or join a cluster with GPUs")


class StartNoiseFilter(logging.Filter):
    """Without --verbose, what Ray says at start that asks nothing of the user: Serve's
    progress lines (INFO: "Started Serve", "Connecting to existing Serve app ... New
    http_options/controller_options will not be applied", a router object's repr),
    the SIGTERM handler `ray.init` cannot set from the thread that hosts the cluster
    (serve puts its own back once Ray is up: serve.take_back_signals), and that a new
    local cluster has token authentication on, as Ray 2.60 does by default. (Setting
    RAY_AUTH_MODE=token instead would silence that too, but only when set before Ray's
    first import, which caches the mode: a later one leaves the driver without the
    token its own cluster asks for.)"""

    NOISE = ("SIGTERM handler is not set because current thread",
             "Token authentication is enabled for this Ray cluster")

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING and not record.getMessage().startswith(self.NOISE)


def quiet_logs(logger_name: str) -> None:
    """StartNoiseFilter on the handlers of Ray's logger `logger_name` (its records
    and its children's pass them)."""
    for handler in logging.getLogger(logger_name).handlers:
        if not any(isinstance(f, StartNoiseFilter) for f in handler.filters):
            handler.addFilter(StartNoiseFilter())


class QueuedRequestsFilter(logging.Filter):
    """Drops Serve's router warnings about busy replicas: "Failed to route request after
    N attempts" (with every replica's queue full, requests wait in the router, which
    the server's own admission, --max-queue, allows; the line repeats every few
    hundred attempts) and "Failed to get queue length from Replica ... within 0.1s"
    (a replica whose CPU threads are all in a step answers the router's probe late on
    one machine, no network involved; the router leaves it out of that pick, and the
    line came twice a probe, at start too, under a busy 2-core machine); and "Failed to
    fetch queue length for Replica" after a replica died (each copy carrying Ray's whole
    error: 14,790 of them in two minutes of a helper's pass; /health says it once)."""

    NOISE = ("Failed to route request after", "Failed to get queue length from Replica",
             "Failed to fetch queue length for Replica")

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.NOISE)


def deployment_options(options: ClusterOptions, block_size: int) -> dict[str, Any]:
    from ray.serve.config import RequestRouterConfig

    from ruvllm_cli.cluster.router import PrefixAffinityRouter

    batch = options.max_concurrent
    scaling: dict[str, Any] = {"num_replicas": options.replicas}
    if options.autoscaling:
        # Ray Serve's autoscaler works on requests per replica, running plus queued:
        # one full batch each is the target.
        scaling = {"autoscaling_config": {"min_replicas": options.min_replicas, "max_replicas": options.max_replicas,
                                          "initial_replicas": options.replicas, "target_ongoing_requests": batch}}
    router = RequestRouterConfig(request_router_class=PrefixAffinityRouter,
                                 request_router_kwargs={"block_size": block_size, "imbalance": options.imbalance})
    actor = {"num_cpus": options.threads_per_replica, "num_gpus": options.gpus_per_replica}
    return {"name": DEPLOYMENT, "ray_actor_options": actor, "max_ongoing_requests": batch * QUEUE_PER_BATCH,
            "health_check_period_s": HEALTH_CHECK_PERIOD_S, "health_check_timeout_s": HEALTH_CHECK_TIMEOUT_S,
            "graceful_shutdown_timeout_s": GRACEFUL_SHUTDOWN_S, "request_router_config": router,
            "logging_config": {"enable_access_log": False, "log_level": "WARNING"}, **scaling}


def deploy(options: ClusterOptions, spec: ReplicaSpec, app_name: str) -> Any:
    """Deploy the replicas and wait until they are running; the RayEngineClient.
    Serve's progress lines show with --verbose (`spec.verbose`) only."""
    from ray import serve

    from ruvllm_cli.cluster.client import RayEngineClient
    from ruvllm_cli.cluster.model_view import ModelView
    from ruvllm_cli.cluster.replica import EngineReplica
    from ruvllm_cli.engine.config import EngineConfig

    if not spec.verbose:
        quiet_logs("ray.serve")
    serve.start(proxy_location="Disabled")
    logging.getLogger("ray.serve").addFilter(QueuedRequestsFilter())
    block_size = spec.engine_options.get("block_size") or EngineConfig.block_size
    deployment = serve.deployment(EngineReplica).options(**deployment_options(options, block_size))
    try:
        handle = serve.run(deployment.bind(spec), name=app_name, route_prefix=None)
    except RuntimeError as error:   # Serve gave up on the replicas' constructors
        reason = replica_error(app_name)
        if reason is not None:   # what a single process says ("--device cuda: no CUDA device ...")
            raise RuvllmError(reason, "run with --verbose to see the replicas' logs") from error
        raise RuvllmError(f"the replicas did not start: {last_error_line(error)}",
                          "run with --verbose to see the replicas' logs") from error
    facts = handle.facts.remote().result()
    return RayEngineClient(handle, ModelView(facts, options.max_replicas), app_name, DEPLOYMENT)


def replica_error(app_name: str) -> str | None:
    """Why the replicas' constructor failed, from the deployment's message in Serve's
    status (serve.run's own error says only "Failed to update the deployments"): a
    ruvllm error's own message, or the traceback's last error line; None if unknown."""
    try:
        from ray import serve

        message = serve.status().applications[app_name].deployments[DEPLOYMENT].message
    except Exception:  # noqa: BLE001 - no status: the caller says what it has
        return None
    if not message:
        return None
    line = last_error_line(RuntimeError(message))
    ours = re.match(r"^ruvllm_cli\.[\w.]*(Error|Exception): (.+)$", line)
    return ours.group(2) if ours else f"the replicas did not start: {line}"


def last_error_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^[A-Za-z_.]*(Error|Exception)\b", line)]
    return (errors or lines or [type(error).__name__])[-1]


def replica_details(app_name: str, deployment_name: str) -> list[dict[str, Any]]:
    """Each replica's id, state, pid and node, from Serve's controller. The public
    `serve.status()` gives only counts per state; this is what `serve status -v`
    and the dashboard read (a private client method, kept in this one place)."""
    import ray
    from ray.serve.context import _get_global_client

    if not ray.is_initialized():
        return []   # shut down: asking now would start a new cluster
    details = _get_global_client().get_serve_details()
    deployment = details.get("applications", {}).get(app_name, {}).get("deployments", {}).get(deployment_name, {})
    keep = ("replica_id", "state", "pid", "node_ip", "actor_name")
    return [{key: replica.get(key) for key in keep} for replica in deployment.get("replicas", [])]
