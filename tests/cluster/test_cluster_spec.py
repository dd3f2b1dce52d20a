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
    assert parse() is None


def test_fixed_and_autoscaled_replicas():
    assert parse(replicas=2) == ClusterOptions(2, 2, 2, None, 1, 0.0, 16)
    scaled = parse(min_replicas=1, max_replicas=4)
    assert (scaled.replicas, scaled.min_replicas, scaled.max_replicas, scaled.autoscaling) == (1, 1, 4, True)
    assert parse(replicas=3, max_replicas=4).min_replicas == 3
    assert parse(replicas=2).imbalance == 8


@pytest.mark.parametrize("given, message", [
    ({"replicas": 5, "max_replicas": 4}, "--replicas 5 must lie between --min-replicas 4 and --max-replicas 4"),
    ({"replicas": 2, "allow_runtime_lora": True}, "--allow-runtime-lora does not work with --replicas"),
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
