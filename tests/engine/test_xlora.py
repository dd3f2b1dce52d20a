"""X-LoRA through the engine, with a KV cache for each of its two passes: greedy
tokens identical to peft's XLoraModel.generate() (which recomputes everything at
every token) in float32, alone and in a batch beside the base model and a LoRA."""

from __future__ import annotations

import pytest
import torch

from ruvllm_cli.engine.config import EngineConfig
from ruvllm_cli.engine.engine import LLMEngine
from ruvllm_cli.engine.loader import load_model
from ruvllm_cli.engine.sampling import SamplingParams
from ruvllm_cli.quantization import Quantization
from ruvllm_cli.testing.device import TEST_DEVICE
from ruvllm_cli.testing.tiny_lora import ATTENTION, build_lora_adapter, build_xlora_adapter
from ruvllm_cli.testing.tiny_model import cached_tiny_model

PROMPTS = [[5, 17, 99, 200, 31, 7, 64, 12], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53]]
NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
# Each case: the X-LoRA settings peft mixes the experts with.
CASES = {
    "softmax": {},
    "layerwise-topk": {"layerwise": True, "top_k": 2, "depth": 3},
    "softmax-topk-pass": {"top_k": 2, "softmax_topk": True, "scaling_pass_value": 0.5, "global_weight": 0.7,
                          "depth": 1},
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return cached_tiny_model(tmp_path_factory.mktemp("xlora-models"))


@pytest.fixture(scope="module")
def experts(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("experts")
    return [build_lora_adapter(model_dir, root / "e0", rank=4, alpha=8, seed=10, scale_b=20.0),
            build_lora_adapter(model_dir, root / "e1", rank=4, alpha=12, targets=("q_proj", "v_proj", "down_proj"),
                               seed=11, scale_b=20.0),
            build_lora_adapter(model_dir, root / "e2", rank=2, alpha=4, seed=12, scale_b=20.0)]


@pytest.fixture(scope="module")
def xloras(model_dir, experts, tmp_path_factory):
    root = tmp_path_factory.mktemp("xloras")
    return {name: build_xlora_adapter(model_dir, root / name, experts, seed=i, **options)
            for i, (name, options) in enumerate(CASES.items())}


def peft_generate(model_dir, xlora_dir, prompt) -> list[int]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, use_cache=False).to(TEST_DEVICE).eval()
    model = PeftModel.from_pretrained(base, xlora_dir).eval()
    ids = torch.tensor([prompt], device=TEST_DEVICE)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=NEW_TOKENS, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def loaded(model_dir):
    return load_model(model_dir, TEST_DEVICE, Quantization.F32)


@pytest.mark.parametrize("case", list(CASES))
def test_xlora_matches_peft_with_a_kv_cache_per_pass(loaded, model_dir, xloras, case):
    engine = LLMEngine(loaded, EngineConfig(device=TEST_DEVICE, quantization=Quantization.F32))
    engine.add_lora("mix", xloras[case])
    base = engine.generate(PROMPTS, GREEDY)
    mixed = engine.generate(PROMPTS, GREEDY, adapters="mix")
    for prompt, result, plain in zip(PROMPTS, mixed, base):
        expected = peft_generate(model_dir, xloras[case], prompt)
        assert result.token_ids == expected
        assert result.token_ids != plain.token_ids   # the experts really change the output
    engine.check_integrity()
    assert engine.runner.scaling_cache is not None
    engine.remove_lora("mix")
    assert engine.runner.scaling_cache is None   # its second KV pool goes with it


def test_xlora_beside_the_base_model_and_a_lora_in_one_batch(loaded, model_dir, xloras, experts, tmp_path):
    engine = LLMEngine(loaded, EngineConfig(device=TEST_DEVICE, quantization=Quantization.F32, max_num_batched_tokens=6,
                                            block_size=4))
    engine.add_lora("mix", xloras["layerwise-topk"])
    engine.add_lora("one", experts[0])
    alone = {(a, i): engine.generate([PROMPTS[i]], GREEDY, adapters=a)[0].token_ids
             for a in (None, "mix", "one") for i in range(2)}
    jobs = [("mix", 1), (None, 0), ("one", 1), ("mix", 0), ("mix", 1)]
    together = engine.generate([PROMPTS[i] for _, i in jobs], GREEDY, adapters=[a for a, _ in jobs])
    for (adapter, index), result in zip(jobs, together):
        assert result.token_ids == alone[(adapter, index)], (adapter, index)
    # The last request found the first one's blocks in both passes' caches.
    assert together[-1].num_cached_tokens > 0
    assert alone[("mix", 0)] == peft_generate(model_dir, xloras["layerwise-topk"], PROMPTS[0])


def _copy_with(source, target, config_changes=None, weights=None):
    """A copy of an X-LoRA directory with its config and classifier weights changed."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    config = json.loads((target / "adapter_config.json").read_text())
    config.update(config_changes or {})
    (target / "adapter_config.json").write_text(json.dumps(config))
    if weights is not None:
        state = weights(load_file(str(target / "adapter_model.safetensors")))
        save_file(state, str(target / "adapter_model.safetensors"), metadata={"format": "pt"})
    return target


def _widen_first(state):
    key = next(k for k in sorted(state) if k.endswith(".weight"))
    state[key] = torch.zeros(state[key].shape[0], state[key].shape[1] + 32)
    return state


def _narrow_second(state):
    keys = sorted(k for k in state if k.endswith(".weight"))
    state[keys[-1]] = torch.zeros(state[keys[-1]].shape[0], 5)
    return state


@pytest.mark.parametrize("changes, weights, reason", [
    ({"top_k_lora": 3 + 1}, None, "top_k_lora must be between 1 and its 3 experts"),
    ({"top_k_lora": 0}, None, "top_k_lora must be between 1"),
    ({"softmax_temperature": 0}, None, "softmax_temperature must be a positive number"),
    ({"layerwise_scalings": "yes"}, None, "layerwise_scalings must be true or false"),
    ({}, _widen_first, "its classifier reads hidden states of size 96; this model's are 64"),
    ({}, _narrow_second, "takes 5 inputs, the layer before gives"),
])
def test_an_xlora_that_would_fail_its_first_request_is_refused_at_load(loaded, xloras, tmp_path, changes, weights,
                                                                        reason):
    """Each of these loaded, and its first request failed the engine's step: the whole
    server stopped ("selected index k out of range", "mat1 and mat2 shapes cannot be
    multiplied"). Refused while loading, the engine keeps serving."""
    from ruvllm_cli.engine.lora import AdapterError

    engine = LLMEngine(loaded, EngineConfig(device=TEST_DEVICE, quantization=Quantization.F32))
    bad = _copy_with(xloras["layerwise-topk"], tmp_path / "bad", changes, weights)
    with pytest.raises(AdapterError, match=reason):
        engine.add_lora("bad", bad)
    assert engine.generate(PROMPTS[:1], GREEDY)[0].token_ids


def test_an_xlora_whose_first_expert_was_made_for_another_base_is_refused(loaded, experts, model_dir, tmp_path):
    """Only the last expert's modules were checked: one made for a 128-wide model loaded,
    and its first two requests stopped the engine (and so the server)."""
    import json

    from ruvllm_cli.engine.lora import AdapterError
    from ruvllm_cli.testing.tiny_model import build_tiny_model

    other = build_tiny_model(tmp_path / "wider", hidden_size=128, intermediate_size=256)
    stranger = build_lora_adapter(other, tmp_path / "stranger", rank=4, seed=1)
    mixed = build_xlora_adapter(model_dir, tmp_path / "mixed", [experts[0], experts[2]], seed=0)   # both: every layer
    config = json.loads((mixed / "adapter_config.json").read_text())
    config["adapters"][next(iter(config["adapters"]))] = str(stranger)
    (mixed / "adapter_config.json").write_text(json.dumps(config))
    engine = LLMEngine(loaded, EngineConfig(device=TEST_DEVICE, quantization=Quantization.F32))
    with pytest.raises(AdapterError, match=r"is 64x128|is 128x256|another base model"):
        engine.add_lora("mixed", mixed)
    assert engine.generate(PROMPTS[:1], GREEDY)[0].token_ids and not engine.lora.names()
