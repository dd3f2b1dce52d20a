"""--replicas and friends: parsed and checked before any Ray is started."""

from __future__ import annotations

import pytest

from ruvllm_cli.cluster.spec import ClusterOptions, cluster_options
from ruvllm_cli.errors import UsageError

BASE = {"replicas": None, "min_replicas": None, "max_replicas": None, "ray_address": None,
        "threads_per_replica": 1, "gpus_per_replica": 0.0, "max_concurrent": 16, "allow_runtime_lora": False}


def parse(**given):
    return cluster_options({**BASE, **given})


def test_no_replica_option_means_one_process():
    assert parse(threads_per_replica=None) is None


def test_fixed_and_autoscaled_replicas():
    assert parse(replicas=2) == ClusterOptions(2, 2, 2, None, 1, 0.0, 16)
    scaled = parse(min_replicas=1, max_replicas=4)
    assert (scaled.replicas, scaled.min_replicas, scaled.max_replicas, scaled.autoscaling) == (1, 1, 4, True)
    assert parse(replicas=3, max_replicas=4).min_replicas == 3
    assert parse(replicas=2).imbalance == 8


@pytest.mark.parametrize("given, message", [
    ({"replicas": 5, "max_replicas": 4}, "--replicas 5 must lie between --min-replicas 4 and --max-replicas 4"),
    ({"replicas": 2, "allow_runtime_lora": True}, "--allow-runtime-lora does not work with --replicas"),
    ({"min_replicas": 3, "max_replicas": 2}, "--min-replicas 3 is more than --max-replicas 2"),
    ({"ray_address": "head:6379", "threads_per_replica": None}, "--ray-address needs --replicas"),
    ({"gpus_per_replica": 1.0, "threads_per_replica": None}, "--gpus-per-replica needs --replicas"),
    ({"threads_per_replica": 2}, "--threads-per-replica needs --replicas"),
    ({"replicas": 2, "threads": 2}, "--threads is for one process; with --replicas give --threads-per-replica"),
])
def test_refused(given, message):
    with pytest.raises(UsageError, match=message):
        parse(**given)


def test_the_deployment_autoscales_on_requests_per_replica():
    pytest.importorskip("ray.serve")
    from ruvllm_cli.cluster.deploy import deployment_options

    options = deployment_options(parse(min_replicas=1, max_replicas=3, threads_per_replica=2), block_size=16)
    assert options["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 3, "initial_replicas": 1,
                                             "target_ongoing_requests": 16}
    assert options["ray_actor_options"] == {"num_cpus": 2, "num_gpus": 0.0}
    assert options["request_router_config"].request_router_kwargs == {"block_size": 16, "imbalance": 8}
    assert "num_replicas" not in options
    assert deployment_options(parse(replicas=2), 16)["num_replicas"] == 2


def test_an_unreachable_ray_address_is_said_at_once():
    """ray.init had waited for good on a closed port or an unknown host."""
    import socket

    from ruvllm_cli.cluster.deploy import reachable
    from ruvllm_cli.errors import RuvllmError

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]   # closed once the block ends: nothing listens there
    for address in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}", "nohost.invalid:6379"):
        with pytest.raises(RuvllmError, match=f"cannot join the Ray cluster at {address}"):
            reachable(address)
    reachable("auto")   # Ray's own lookup


def test_gpus_per_replica_beyond_the_clusters_gpus_is_refused():
    from ruvllm_cli.cluster.deploy import check_gpus
    from ruvllm_cli.errors import RuvllmError

    with pytest.raises(RuvllmError, match="--gpus-per-replica 1 x 2 replicas needs 2 GPUs; this machine has 0"):
        check_gpus(parse(replicas=2, gpus_per_replica=1.0), 0.0)
    check_gpus(parse(replicas=2, gpus_per_replica=0.5), 1.0)
    check_gpus(parse(replicas=2), 0.0)


def test_no_ray_call_may_start_a_cluster_of_its_own():
    """A stop while the replicas deploy shuts Ray down under the deploying thread; its
    next Serve call had started a second local cluster that outlived the server."""
    import subprocess
    import sys

    pytest.importorskip("ray.serve")
    script = ("from ruvllm_cli.cluster.deploy import import_ray\n"
              "from ruvllm_cli.cluster.spec import ClusterOptions\n"
              "import_ray(ClusterOptions(1, 1, 1, None, 1, 0.0, 16))\n"
              "from ray._private import auto_init_hook\n"
              "print(auto_init_hook.enable_auto_connect)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False"], out.stderr


def test_serve_s_router_warnings_about_busy_replicas_are_not_the_user_s():
    import logging

    from ruvllm_cli.cluster.deploy import QueuedRequestsFilter

    def record(message: str) -> logging.LogRecord:
        return logging.LogRecord("ray.serve", logging.WARNING, __file__, 1, message, None, None)

    quiet = QueuedRequestsFilter()
    assert not quiet.filter(record("Failed to get queue length from Replica(id='x3xx', deployment='EngineReplica', "
                                   "app='ruvllm-1') within 0.1s. If this happens repeatedly it's likely caused by "
                                   "high network latency in the cluster."))
    assert not quiet.filter(record("Failed to route request after 200 attempts over 10.00s."))
    assert not quiet.filter(record("Failed to fetch queue length for Replica(id='x3xx', deployment='EngineReplica',"
                                   " app='ruvllm-1'): OutOfMemoryError: 2 worker(s) were killed ..."))
    assert quiet.filter(record("Replica EngineReplica#x3xx failed its health check"))


def test_each_front_door_has_an_app_of_its_own():
    """Two front doors on one cluster (or two models in directories of one name) had the
    same app name: each deploy replaced the other's replicas, and each stop deleted them.
    A restart on the same port still replaces its own."""
    import socket

    from ruvllm_cli.cluster.deploy import app_name_for

    assert app_name_for("model", 8000) != app_name_for("model", 8001)
    assert app_name_for("model", 8000) == app_name_for("model", 8000) == \
        f"ruvllm-model-{socket.gethostname()}-8000".replace("/", "-")
    assert app_name_for("org/odd name!", 80).startswith("ruvllm-org-odd-name-")
