"""Overload through the server (127.0.0.1, bounded): 200 long low-priority requests and
50 short high-priority ones at once, with a KV cache small enough to force preemption.
Under --scheduling-policy priority every request completes, with either preemption
mode, and the high-priority ones start sooner (p95 TTFT); at least three times sooner
in the slow run (`scripts/test --slow`) and in `scripts/bench_priority.py`: beside
another test worker the ratio fell to 2.3-2.7 in 4 of 12 runs (with and without the
commit that split it), so the default run asserts the order only."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from ruvllm_cli.bench.overload import HIGH, LOW, run_overload
from ruvllm_cli.engine.model_runner import kv_bytes_per_block

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("ratio", [1, pytest.param(3, marks=pytest.mark.slow)])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_high_priority_requests_start_sooner(make_server, server_model, mode, ratio):
    per_block = kv_bytes_per_block(server_model.model.config, server_model.dtype, 16)
    live = make_server(engine={"scheduling_policy": "priority", "preemption_mode": mode, "max_num_seqs": 16,
                               "kv_cache_memory": 48 * per_block, "swap_space": 256 * per_block},
                       max_queue=300)
    result = asyncio.run(run_overload(live.url, live.model, low=200, high=50, low_tokens=48, high_tokens=8))
    assert not result.failures, result.failures[:3]
    assert all(o.tokens == (48 if o.priority == LOW else 8) for o in result.outcomes)
    assert result.p95(HIGH) * ratio <= result.p95(LOW), (result.p95(HIGH), result.p95(LOW))
    preemptions = live.engine(lambda e: dict(e.scheduler.preemptions))
    assert sum(preemptions.values()) > 0
    assert any(m == mode for _, m in preemptions)
    metrics = httpx.get(live.url + "/metrics").text
    assert f'ruvllm_preemptions_total{{mode="{mode}",priority="1"}}' in metrics
    assert "ruvllm_request_queue_time_seconds_count 250.0" in metrics
    live.assert_clean()
    live.engine(lambda e: e.check_integrity())


def test_user_session_and_priority_are_kept_and_logged(make_server, server, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="ruvllm.server")
    body = {"model": server.model, "prompt": "hello", "max_tokens": 2, "user": "alice", "session_id": "s-1",
            "priority": -1}
    # Under fcfs (the shared server's policy) a priority would change nothing: vLLM's 400.
    refused = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert refused.status_code == 400 and "--scheduling-policy priority" in refused.json()["error"]["message"]
    server = make_server(engine={"scheduling_policy": "priority"})
    assert httpx.post(server.url + "/v1/completions", json=body, timeout=30).status_code == 200
    [line] = [r.getMessage() for r in caplog.records if "user=alice" in r.getMessage()]
    assert "/v1/completions model=tiny user=alice session=s-1 priority=-1 sequences=1" in line
    assert "queue=" in line and "queue=-" not in line
    for bad in ({"priority": 1.5}, {"priority": "high"}, {"user": 7}, {"session_id": []}):
        answer = httpx.post(server.url + "/v1/completions", json={**body, **bad}, timeout=30)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == next(iter(bad))
