"""Engine fixtures: one tiny float32 model per session, and its transformers reference."""

from __future__ import annotations

import pytest
import torch

from ruvllm_cli.engine.config import EngineConfig
from ruvllm_cli.engine.engine import LLMEngine
from ruvllm_cli.engine.loader import LoadedModel, load_model
from ruvllm_cli.quantization import Quantization
from ruvllm_cli.testing.device import TEST_DEVICE
from ruvllm_cli.testing.tiny_model import cached_tiny_model


@pytest.fixture(scope="session")
def engine_model_dir(tmp_path_factory):
    return cached_tiny_model(tmp_path_factory.mktemp("engine-models"))


@pytest.fixture(scope="session")
def loaded(engine_model_dir) -> LoadedModel:
    return load_model(engine_model_dir, TEST_DEVICE, Quantization.F32)


@pytest.fixture(scope="session")
def reference(engine_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(engine_model_dir, dtype=torch.float32).to(TEST_DEVICE).eval()
    model.generation_config.eos_token_id = None  # generate() merges it back in otherwise
    return model


@pytest.fixture
def make_engine(loaded):
    """A fresh engine (fresh KV pool and queues) around the session's loaded model."""

    def make(**overrides) -> LLMEngine:
        overrides.setdefault("quantization", Quantization.F32)
        overrides.setdefault("device", TEST_DEVICE)
        return LLMEngine(loaded, EngineConfig(**overrides))

    return make


@pytest.fixture(scope="session")
def greedy_reference(reference):
    """transformers' own greedy generate(), token ids only, EOS ignored."""

    from transformers import GenerationConfig

    def generate(prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        # No EOS at all (not min_new_tokens, which would mask EOS out of the logits):
        # the engine's ignore_eos samples EOS like any token and carries on.
        config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)
        with torch.inference_mode():
            out = reference.generate(torch.tensor([prompt_ids], device=TEST_DEVICE), generation_config=config)
        ids = out[0, len(prompt_ids):].tolist()
        assert len(ids) == max_new_tokens
        return ids

    return generate
