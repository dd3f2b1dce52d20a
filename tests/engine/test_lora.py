"""LoRA adapters in the engine: per-token adapters in one batch, token-identical to
peft's own generate() in float32; slots and eviction; prefix-cache isolation; and
the adapters the serving path refuses."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from ruvllm_cli.engine.config import EngineConfig
from ruvllm_cli.engine.engine import LLMEngine
from ruvllm_cli.engine.loader import load_model
from ruvllm_cli.engine.lora import (AdapterError, AdapterInUseError, AdapterNotFoundError, LoRALinear,
                                    LoRAModule, LoRAStep, read_adapter)
from ruvllm_cli.engine.int8 import int8_linear
from ruvllm_cli.engine.quantize import (DynamicInt8Linear, Int4Linear, PackedLinear, int8_rows, int8_weights_here,
                                        packing_works)
from ruvllm_cli.engine.request import FinishReason
from ruvllm_cli.engine.sampling import SamplingParams
from ruvllm_cli.errors import UsageError
from ruvllm_cli.quantization import Quantization
from ruvllm_cli.registry.adapters import parse_lora_specs
from ruvllm_cli.testing.device import TEST_DEVICE
from ruvllm_cli.testing.tiny_lora import ATTENTION, MLP, build_lora_adapter
from ruvllm_cli.testing.tiny_model import cached_tiny_model

PROMPTS = [[5, 17, 99, 200, 31, 7, 64, 12], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57,
                                              58, 59], [300, 301, 2, 9]]
NEW_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return cached_tiny_model(tmp_path_factory.mktemp("lora-models"))


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    """Two adapters of different ranks and targets; the MLP one with a per-module rank."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        "attn": build_lora_adapter(model_dir, root / "attn", rank=4, alpha=8, targets=ATTENTION, seed=1),
        "mlp": build_lora_adapter(model_dir, root / "mlp", rank=8, alpha=12, targets=MLP, seed=2,
                                  rank_pattern={"down_proj": 2}),
        "all": build_lora_adapter(model_dir, root / "all", rank=6, alpha=6, seed=3, use_rslora=True),
    }


@pytest.fixture(scope="module")
def peft_reference(model_dir, adapters):
    """peft's generate() with each adapter (None: adapters disabled), greedy, float32."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, GenerationConfig

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(TEST_DEVICE).eval()
    base.generation_config.eos_token_id = None  # generate() merges it back in otherwise
    names = list(adapters)
    model = PeftModel.from_pretrained(base, adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapters[name], adapter_name=name)
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    cache: dict[tuple[str | None, int], list[int]] = {}

    def generate(adapter: str | None, prompt_index: int) -> list[int]:
        key = (adapter, prompt_index)
        if key not in cache:
            prompt = torch.tensor([PROMPTS[prompt_index]], device=TEST_DEVICE)
            with torch.inference_mode():
                if adapter is None:
                    with model.disable_adapter():
                        out = model.generate(input_ids=prompt, generation_config=config)
                else:
                    model.set_adapter(adapter)
                    out = model.generate(input_ids=prompt, generation_config=config)
            cache[key] = out[0, prompt.shape[1]:].tolist()
        return cache[key]

    return generate


@pytest.fixture(scope="module")
def loaded(model_dir):
    # A model of its own: adapters wrap its linear layers.
    return load_model(model_dir, TEST_DEVICE, Quantization.F32)


def make_engine(loaded, adapters, names=("attn", "mlp", "all"), **overrides) -> LLMEngine:
    overrides.setdefault("quantization", Quantization.F32)
    overrides.setdefault("device", TEST_DEVICE)
    engine = LLMEngine(loaded, EngineConfig(**overrides))
    for name in names:
        engine.add_lora(name, adapters[name])
    return engine


def test_a_mixed_batch_matches_peft_for_every_adapter(loaded, adapters, peft_reference):
    engine = make_engine(loaded, adapters)
    jobs = [(a, p) for a in (None, "attn", "mlp", "all") for p in range(len(PROMPTS))]
    results = engine.generate([PROMPTS[p] for _, p in jobs], GREEDY, adapters=[a for a, _ in jobs])
    for (adapter, prompt_index), result in zip(jobs, results):
        assert result.token_ids == peft_reference(adapter, prompt_index), (adapter, prompt_index)
    # The adapters really change the output, or the comparison above proves nothing.
    assert len({tuple(peft_reference(a, 0)) for a in (None, "attn", "mlp", "all")}) == 4
    # On a CPU the decodes ran the fused step, adapters in its linears; CUDA has none.
    assert (engine.runner.fused_steps > 0) == (TEST_DEVICE == "cpu")
    engine.check_integrity()


def test_chunked_prompts_beside_decodes_of_other_adapters(loaded, adapters, peft_reference):
    # A 6-token budget splits prompts into chunks that share steps with other adapters' decodes.
    engine = make_engine(loaded, adapters, max_num_batched_tokens=6)
    jobs = [("mlp", 1), (None, 0), ("attn", 1), ("all", 2), ("attn", 0)]
    results = engine.generate([PROMPTS[p] for _, p in jobs], GREEDY, adapters=[a for a, _ in jobs])
    for (adapter, prompt_index), result in zip(jobs, results):
        assert result.token_ids == peft_reference(adapter, prompt_index), (adapter, prompt_index)


def test_more_adapters_than_slots_evict_and_stay_correct(loaded, adapters, peft_reference):
    engine = make_engine(loaded, adapters, max_loras=1)
    jobs = [("attn", 0), ("mlp", 0), (None, 1), ("all", 0), ("attn", 2), ("mlp", 1)]
    results = engine.generate([PROMPTS[p] for _, p in jobs], GREEDY, adapters=[a for a, _ in jobs])
    for (adapter, prompt_index), result in zip(jobs, results):
        assert result.token_ids == peft_reference(adapter, prompt_index), (adapter, prompt_index)
    assert engine.lora.loads == 3   # one slot: each adapter copied in once, its requests run together
    assert engine.scheduler.waiting == type(engine.scheduler.waiting)()


def test_one_slot_never_runs_two_adapters_in_a_step(loaded, adapters):
    engine = make_engine(loaded, adapters, max_loras=1)
    for adapter in ("attn", "mlp", None, "attn"):
        engine.add_request(PROMPTS[0], GREEDY, adapter=adapter)
    while engine.has_unfinished:
        plan_adapters = set()
        original = engine.runner.execute

        def spy(chunks, original=original):
            plan_adapters.update(c.request.adapter_uid for c in chunks if c.request.adapter_uid)
            return original(chunks)

        engine.runner.execute = spy
        engine.step()
        assert len(plan_adapters) <= 1


def test_prefix_cache_is_shared_within_an_adapter_and_never_across(loaded, adapters):
    engine = make_engine(loaded, adapters, block_size=4)
    prompt = PROMPTS[1]   # 20 tokens: 4 full blocks can be shared
    first = engine.generate([prompt], GREEDY, adapters="attn")[0]
    same = engine.generate([prompt], GREEDY, adapters="attn")[0]
    other = engine.generate([prompt], GREEDY, adapters="mlp")[0]
    base = engine.generate([prompt], GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert same.num_cached_tokens == 16 and same.token_ids == first.token_ids
    assert other.num_cached_tokens == 0 and other.token_ids != first.token_ids
    assert base.num_cached_tokens == 0


def test_a_reloaded_adapter_never_reuses_the_old_weights_blocks(loaded, adapters):
    engine = make_engine(loaded, adapters, names=("attn",), block_size=4)
    engine.generate([PROMPTS[1]], GREEDY, adapters="attn")
    engine.remove_lora("attn")
    engine.add_lora("attn", adapters["mlp"])   # same name, other weights
    again = engine.generate([PROMPTS[1]], GREEDY, adapters="attn")[0]
    assert again.num_cached_tokens == 0


def test_unknown_adapter_and_unload_rules(loaded, adapters):
    engine = make_engine(loaded, adapters, names=("attn",))
    with pytest.raises(AdapterNotFoundError, match="no LoRA adapter named nope"):
        engine.add_request(PROMPTS[0], GREEDY, adapter="nope")
    request = engine.add_request(PROMPTS[0], GREEDY, adapter="attn")
    engine.step()
    with pytest.raises(AdapterInUseError, match="in use by 1 request"):
        engine.remove_lora("attn")
    engine.abort(request.request_id)
    engine.remove_lora("attn")
    assert engine.lora.names() == []
    with pytest.raises(AdapterNotFoundError):
        engine.remove_lora("attn")
    with pytest.raises(AdapterError, match="already loaded"):
        engine.add_lora("x", adapters["mlp"])
        engine.add_lora("x", adapters["mlp"])


def test_adapters_that_cannot_be_served_are_refused_with_the_reason(loaded, adapters, model_dir, tmp_path):
    engine = make_engine(loaded, adapters, names=(), max_lora_rank=4)
    with pytest.raises(AdapterError, match="rank 8, above --max-lora-rank 4"):
        engine.add_lora("mlp", adapters["mlp"])
    with pytest.raises(AdapterError, match="not a PEFT adapter directory"):
        engine.add_lora("x", tmp_path)
    other = cached_tiny_model(tmp_path / "wide", hidden_size=96, num_heads=4, num_kv_heads=2)
    wide = build_lora_adapter(other, tmp_path / "wide-lora", rank=2, targets=("q_proj",))
    with pytest.raises(AdapterError, match="another base model"):
        engine.add_lora("wide", wide)
    dora = tmp_path / "dora"
    dora.mkdir()
    config = json.loads((adapters["attn"] / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    (dora / "adapter_model.safetensors").write_bytes((adapters["attn"] / "adapter_model.safetensors").read_bytes())
    with pytest.raises(AdapterError, match="uses DoRA"):
        read_adapter("dora", dora)
    assert engine.lora.names() == []


@pytest.mark.parametrize("change, reason", [
    ({"alora_invocation_tokens": [5, 6]}, "is an activated LoRA"),
    ({"layer_replication": [[0, 1], [0, 1]]}, "replicates the base model's layers"),
    ({"use_qalora": True}, "is a QA-LoRA"),
])
def test_configs_that_change_the_forward_are_refused_not_served_from_the_weights(adapters, tmp_path, change, reason):
    """Each loaded and was served as a plain LoRA: other tokens than peft's, with nothing said."""
    changed = tmp_path / "changed"
    changed.mkdir()
    config = json.loads((adapters["attn"] / "adapter_config.json").read_text())
    (changed / "adapter_config.json").write_text(json.dumps({**config, **change}))
    (changed / "adapter_model.safetensors").write_bytes((adapters["attn"] / "adapter_model.safetensors").read_bytes())
    with pytest.raises(AdapterError, match=reason):
        read_adapter("changed", changed)


def test_lora_spec_parsing():
    assert parse_lora_specs(["a=/x/y", "/models/b/"]) == [("a", "/x/y"), ("b", "/models/b/")]
    with pytest.raises(UsageError, match="given twice"):
        parse_lora_specs(["a=/x", "a=/y"])
    with pytest.raises(UsageError, match="may not end in ':latest'"):
        parse_lora_specs(["tiny:latest=/x"])
    with pytest.raises(UsageError, match="NAME=PATH"):
        parse_lora_specs(["=/x"])


def _bases() -> list[nn.Module]:
    torch.manual_seed(0)
    linear = nn.Linear(256, 64)
    bases = [linear, DynamicInt8Linear(linear), Int4Linear(nn.Linear(256, 64, bias=False))]
    if int8_weights_here():
        bases.append(int8_linear(*int8_rows(linear.weight.detach()), linear.bias.detach()))
    if packing_works(torch.float32):
        bases.append(PackedLinear(linear))
    return bases


@pytest.mark.parametrize("base", _bases(), ids=lambda b: type(b).__name__)
def test_the_wrapper_adds_each_segments_update_to_any_base_layer(base):
    step = LoRAStep()
    layer = LoRALinear(base, step, num_slots=2, max_rank=4, dtype=torch.float32, device=torch.device("cpu"))
    modules = [LoRAModule(torch.randn(r, 256), torch.randn(64, r), s) for r, s in ((4, 0.5), (2, 3.0))]
    for slot, module in enumerate(modules):
        layer.set_slot(slot, module)
    x = torch.randn(1, 7, 256)
    plain = base(x)[0]
    assert torch.equal(layer(x), base(x))   # no segments: the base layer alone
    step.publish(7, [(1, 3, 0), (3, 6, 1)], rank=4, dtype=torch.float32, device=torch.device("cpu"))
    out = layer(x)[0]
    rows = x[0]
    expected = plain.clone()
    expected[1:3] += (rows[1:3] @ modules[0].a.T @ modules[0].b.T * 0.5).to(plain.dtype)
    expected[3:6] += (rows[3:6] @ modules[1].a.T @ modules[1].b.T * 3.0).to(plain.dtype)
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(out[0], plain[0]) and torch.equal(out[6], plain[6])   # base rows untouched


@pytest.mark.parametrize("quantization", [Quantization.Q8_0, Quantization.Q4_K_M], ids=["q8", "q4k"])
def test_quantized_models_take_adapters_and_mix_them(model_dir, adapters, quantization):
    """16-bit activations around int8/int4 layers (on a CPU without bfloat16 kernels
    the adapters compute in float32 and add into the 16-bit rows)."""
    loaded = load_model(model_dir, "cpu", quantization, use_cache=False)
    engine = LLMEngine(loaded, EngineConfig(device="cpu", quantization=quantization))
    for name in ("attn", "mlp"):
        engine.add_lora(name, adapters[name])
    names = (None, "attn", "mlp")
    alone = {a: engine.generate([PROMPTS[0]], GREEDY, adapters=a)[0].token_ids for a in names}
    assert len({tuple(ids) for ids in alone.values()}) == 3
    together = engine.generate([PROMPTS[0]] * 3, GREEDY, adapters=list(names))
    assert len({tuple(r.token_ids) for r in together}) == 3
    if quantization is Quantization.Q4_K_M or int8_weights_here():
        # int4's kernel and ours for int8 give each row the same result in any batch
        # (fbgemm's int8 GEMM, q8 where ours does not run, quantizes activations over
        # the whole batch, so its rows move with their company).
        for result, adapter in zip(together, names):
            assert result.token_ids[:6] == alone[adapter][:6], adapter


@pytest.mark.parametrize("quantization", [Quantization.Q4_K_M, Quantization.Q8_0])
def test_an_adapter_rows_logits_are_the_same_bits_alone_or_in_a_batch(quantization, tmp_path_factory):
    """Every step's logits, not only the first tokens: prompts of several lengths (up to
    64 rows a step, lora.C_ROWS) under one adapter, together and each alone. int4's
    bfloat16 rows had taken torch's float32 matmul for the update, whose bits move with
    the batch: 3 of 5 such requests changed tokens, on this model (a helper's pass)."""
    import random

    if quantization is Quantization.Q8_0 and not int8_weights_here():
        pytest.skip("fbgemm's int8 GEMM quantizes activations over the whole batch")
    root = tmp_path_factory.mktemp("wider-lora")
    model = cached_tiny_model(root, hidden_size=256, intermediate_size=512, num_layers=4, vocab_size=1024)
    adapter = build_lora_adapter(model, root / "lora", rank=8, seed=5, scale_b=20.0)
    engine = LLMEngine(load_model(model, "cpu", quantization, use_cache=False),
                       EngineConfig(device="cpu", quantization=quantization, enable_prefix_caching=False))
    engine.add_lora("a", adapter)
    rng = random.Random(1234)
    prompts = [[rng.randrange(5, 1000) for _ in range(n)] for n in (3, 5, 7, 9, 2)]   # 1 token: see design 21
    together = step_logits(engine, prompts, "a")
    for prompt, seen in zip(prompts, together):
        [alone] = step_logits(engine, [prompt], "a")
        assert all(torch.equal(a, b) for a, b in zip(seen, alone))


def step_logits(engine, prompts, adapter):
    """Each prompt's logits at every step, greedy, prompts submitted together."""
    seen: dict[str, list[torch.Tensor]] = {}
    execute = engine.runner.execute

    def recording(chunks):
        logits, sampled = execute(chunks)
        for row, request in zip(logits if logits is not None else (), sampled):
            seen.setdefault(request.request_id, []).append(row.float().clone())
        return logits, sampled

    engine.runner.execute = recording
    try:
        requests = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                                       adapter=adapter) for p in prompts]
        while engine.has_unfinished:
            engine.step()
    finally:
        engine.runner.execute = execute
    return [seen[r.request_id] for r in requests]


@pytest.mark.parametrize("changes, reason", [
    ({"lora_alpha": None}, "lora_alpha and r must be numbers"),
    ({"r": 16}, "has weights of rank 8; its config says r=16"),
    # its config names other layers than its weights hold: peft refuses it ("Target
    # modules {'foo_proj'} not found"); it was served from the weights (a helper's pass)
    ({"target_modules": ["foo_proj"]}, r"target_modules \(\['foo_proj'\]\) do not name"),
    ({"target_modules": r".*\.foo_proj"}, "do not name"),
])
def test_an_adapter_config_that_does_not_fit_its_weights_is_refused(loaded, model_dir, tmp_path, changes, reason):
    """lora_alpha null was a 500 (a TypeError at load); a config r other than the
    weights' rank loaded with another scaling than peft's (which refuses it)."""
    import json

    path = build_lora_adapter(model_dir, tmp_path / "a", rank=8, seed=3)
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**config, **changes}))
    engine = LLMEngine(loaded, EngineConfig(device="cpu", quantization=Quantization.F32, max_lora_rank=16))
    with pytest.raises(AdapterError, match=reason):
        engine.add_lora("a", path)


READ_IN_A_FRESH_PROCESS = r"""
import importlib.util, json, sys
from ruvllm_cli.engine.lora import read_adapter
adapter = read_adapter("attn", sys.argv[1])
print(json.dumps({"bitsandbytes": "bitsandbytes" in sys.modules, "modules": len(adapter.modules),
                  "importable": importlib.util.find_spec("bitsandbytes") is not None}))
"""


def test_reading_an_adapter_leaves_bitsandbytes_out_and_importable(adapters):
    """peft imports bitsandbytes where it is installed (and with it torch's compiler
    stack: 2.3 s and 46 MiB of a --lora start); ruvllm's LoRA never builds its layers,
    so `import_peft` keeps it out, and puts nothing in its place for later imports."""
    import importlib.util
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", READ_IN_A_FRESH_PROCESS, str(adapters["attn"])],
                          capture_output=True, text=True, timeout=300, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["modules"] > 0 and result["bitsandbytes"] is False
    assert result["importable"] is (importlib.util.find_spec("bitsandbytes") is not None)


def test_an_adapter_whose_every_request_fails_does_not_stop_the_engine(loaded, adapters, monkeypatch):
    """Two steps in a row in which every request failed had been taken for the engine's
    own failure, so one adapter that no check found wrong (an X-LoRA expert for another
    base) stopped the server at its second request."""
    engine = make_engine(loaded, adapters, names=("attn",))
    bad = engine.adapter("attn").uid
    execute = engine.runner.execute

    def broken_for_the_adapter(chunks):
        if any(chunk.request.adapter_uid == bad for chunk in chunks):
            raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")
        return execute(chunks)

    monkeypatch.setattr(engine.runner, "execute", broken_for_the_adapter)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    for _ in range(3):
        [failed] = engine.generate([[5, 6, 7]], params, adapters="attn")
        assert failed.finish_reason is FinishReason.ERROR and "shapes cannot be multiplied" in failed.error
    assert len(engine.generate([[5, 6, 7]], params)[0].token_ids) == 4
    engine.check_integrity()


def test_replace_lora_swaps_weights_and_keeps_the_old_ones_when_it_cannot(loaded, adapters, tmp_path):
    engine = make_engine(loaded, adapters, names=("attn",))
    old_uid = engine.adapter("attn").uid
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=4), adapter="attn")
    with pytest.raises(AdapterInUseError):
        engine.replace_lora("attn", read_adapter("attn", adapters["mlp"]))
    while engine.has_unfinished:
        engine.step()
    other = cached_tiny_model(tmp_path / "wide", hidden_size=96, num_heads=4, num_kv_heads=2)
    with pytest.raises(AdapterError, match="another base model"):
        engine.replace_lora("attn", read_adapter("attn", build_lora_adapter(other, tmp_path / "w", rank=2)))
    assert engine.adapter("attn").uid == old_uid
    engine.replace_lora("attn", read_adapter("attn", adapters["mlp"]))
    assert engine.adapter("attn").uid != old_uid and engine.lora.names() == ["attn"]
    engine.check_integrity()
