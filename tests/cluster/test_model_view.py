"""The front door's ModelView answers what the routes read of an engine as the
replica's own engine would (no Ray: the facts come from an engine in this process)."""

from __future__ import annotations

from ruvllm_cli.cli.context import AppContext
from ruvllm_cli.cli.engine_setup import open_engine
from ruvllm_cli.cluster.model_view import ModelFacts, ModelView
from ruvllm_cli.quantization import Quantization
from ruvllm_cli.server.ollama_api.routes import memory_bytes


def test_the_view_carries_the_policy_quantization_and_memory_the_routes_read(tiny_model_dir) -> None:
    """A helper's pass with --replicas: `priority` under fcfs was taken (the view had no
    scheduling_policy), and Ollama's quantization_level was '' and /api/ps's size the
    tokenizer's alone (no quantization, weight or KV figures)."""
    opened = open_engine(AppContext(no_color=True), str(tiny_model_dir), quantization=Quantization.Q8_0,
                         device="cpu", max_num_seqs=2, max_model_len=64, scheduling_policy="priority")
    view = ModelView(ModelFacts.of(opened), max_replicas=3)
    engine = opened.engine
    assert view.config.scheduling_policy == "priority" and view.config.quantization is Quantization.Q8_0
    assert view.config.max_num_seqs == 6
    assert memory_bytes(view) == memory_bytes(engine) == engine.loaded.weight_bytes + engine.kv_cache_bytes
    assert view.loaded.device.type == "cpu"
