"""Our own model classes for the Llama family (engine/native.py) against transformers'
classes: the same config values and RoPE frequencies, bit-identical float32 logits
through prefill and decode in an engine, the same tokenizer, a load that imports none
of transformers' modeling stack, and transformers' classes wherever ours do not apply."""

from __future__ import annotations

import importlib
import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from ruvllm_cli.engine import native
from ruvllm_cli.engine.config import EngineConfig
from ruvllm_cli.engine.engine import LLMEngine
from ruvllm_cli.engine.loader import load_model
from ruvllm_cli.engine.sampling import SamplingParams
from ruvllm_cli.quantization import Quantization
from ruvllm_cli.testing.forward import prefill_logits

CLASS_PREFIX = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral", "phi3": "Phi3"}
FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings",
          "bos_token_id", "eos_token_id", "pad_token_id", "hidden_act", "rope_parameters")
SHAPE = {"hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 8, "intermediate_size": 512}
CONFIGS = {
    "llama-minimal": {"model_type": "llama", **SHAPE},
    "llama3-rope": {"model_type": "llama", **SHAPE, "num_key_value_heads": 2, "head_dim": 64,
                    "rope_theta": 500000.0, "max_position_embeddings": 131072, "tie_word_embeddings": True,
                    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    "llama-linear-rope": {"model_type": "llama", **SHAPE, "rope_scaling": {"type": "linear", "factor": 4.0}},
    "qwen2-minimal": {"model_type": "qwen2", **SHAPE, "num_attention_heads": 32},
    "qwen2.5-0.5b": {"model_type": "qwen2", "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
                     "num_key_value_heads": 2, "intermediate_size": 4864, "rope_theta": 1000000.0,
                     "tie_word_embeddings": True, "eos_token_id": 151645, "bos_token_id": 151643,
                     "max_position_embeddings": 32768, "sliding_window": 32768, "use_sliding_window": False},
    "mistral-minimal": {"model_type": "mistral", **SHAPE},
    "phi3-minimal": {"model_type": "phi3", **SHAPE},
    "phi3.5-longrope": {"model_type": "phi3", **SHAPE, "max_position_embeddings": 131072,
                        "original_max_position_embeddings": 4096, "rope_theta": 10000.0,
                        "rope_scaling": {"type": "longrope", "short_factor": [1.0 + i / 100 for i in range(16)],
                                         "long_factor": [2.0 + i for i in range(16)]}},
}
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 6, 7], list(range(10, 50)), [300, 12, 77, 401, 9] * 4]


def _hf_config(raw):
    from transformers import AutoConfig

    fields = dict(raw)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_config_and_rope_frequencies_are_transformers_own(name):
    raw = CONFIGS[name]
    ours, theirs = native.NativeConfig.from_dict(json.loads(json.dumps(raw))), _hf_config(raw)
    for field in FIELDS:
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.head_dim == (getattr(theirs, "head_dim", None) or theirs.hidden_size // theirs.num_attention_heads)
    family = raw["model_type"]
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    rotary = getattr(modeling, f"{CLASS_PREFIX[family]}RotaryEmbedding")(theirs)
    mine = native.RotaryEmbedding(ours)
    assert torch.equal(mine.inv_freq, rotary.inv_freq) and mine.attention_scaling == rotary.attention_scaling
    x = torch.zeros(1, 1)
    for last in (7, 5000):   # longrope takes its long set past the original length
        positions = torch.arange(last - 4, last).unsqueeze(0)
        assert all(torch.equal(a, b) for a, b in zip(mine(x, positions), rotary(x, positions)))


def _rewrite(source, target, model_type, drop=()):
    """A copy of a tiny Llama directory as another family: its config's type and
    architecture changed, the named tensors dropped."""
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config.update(model_type=model_type, architectures=[f"{CLASS_PREFIX[model_type]}ForCausalLM"])
    if model_type == "mistral":
        config["sliding_window"] = None
    for key in ("attention_bias", "mlp_bias"):
        if model_type != "llama":
            config.pop(key, None)
    (target / "config.json").write_text(json.dumps(config))
    weights = target / "model.safetensors"
    tensors = {k: v for k, v in load_file(weights).items() if not any(part in k for part in drop)}
    save_file(tensors, weights, metadata={"format": "pt"})
    return target


def _phi3(source, target):
    """A tiny Phi-3 (fused q/k/v and gate/up, longrope switching at 32 positions)
    with the tiny Llama's tokenizer."""
    from transformers import Phi3Config

    from ruvllm_cli.testing.tiny_model import random_model

    llama = json.loads((source / "config.json").read_text())
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + i / 10 for i in range(8)],
            "long_factor": [1.5 + i for i in range(8)]}
    config = Phi3Config(vocab_size=llama["vocab_size"], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                        original_max_position_embeddings=32, rope_parameters=rope,
                        bos_token_id=llama["bos_token_id"], eos_token_id=llama["eos_token_id"],
                        pad_token_id=llama["pad_token_id"], tie_word_embeddings=False)
    random_model(config, "float32", seed=3).save_pretrained(target)
    for file in source.iterdir():
        if file.name.startswith(("tokenizer", "chat_template", "generation_config")):
            shutil.copy(file, target / file.name)
    return target


@pytest.fixture(params=["llama-gqa", "llama-mha-bias-untied", "qwen2", "mistral", "phi3"])
def family_dir(request, make_tiny_model, tmp_path):
    if request.param == "llama-gqa":
        return make_tiny_model()
    if request.param == "llama-mha-bias-untied":
        return make_tiny_model(num_kv_heads=4, attention_bias=True, tie_word_embeddings=False)
    if request.param == "qwen2":   # q/k/v biases, none on o_proj; one KV head
        source = make_tiny_model(num_kv_heads=1, attention_bias=True)
        return _rewrite(source, tmp_path / "qwen2", "qwen2", drop=("o_proj.bias",))
    if request.param == "phi3":
        return _phi3(make_tiny_model(), tmp_path / "phi3")
    return _rewrite(make_tiny_model(), tmp_path / "mistral", "mistral")


def _load(path, monkeypatch, ours: bool, quantization=Quantization.F32):
    monkeypatch.setenv(native.NATIVE_ENV, "1" if ours else "0")
    return load_model(path, "cpu", quantization, use_cache=False)


def _engine_steps(loaded, fused: bool = False):
    """Greedy tokens of the prompts run together (chunked prompts, uneven decodes),
    every step's logits, and how many steps the fused decode step ran (none unless
    `fused`: then the model's forward runs prompt steps only)."""
    engine = LLMEngine(loaded, EngineConfig(device="cpu", quantization=Quantization.F32, fused_decode=fused,
                                            max_num_batched_tokens=24))
    assert (engine.runner.fused is not None) == fused
    steps: list[torch.Tensor] = []
    execute = engine.runner.execute

    def recorded(chunks):
        logits, sampled = execute(chunks)
        if logits is not None:
            steps.append(logits.clone())
        return logits, sampled

    engine.runner.execute = recorded
    return [r.token_ids for r in engine.generate(PROMPTS, GREEDY)], steps, engine.runner.fused_steps


def _alone(loaded):
    """Greedy tokens of the prompts that stay within longrope's original length (32
    positions), each run alone: transformers' longrope module picks its frequencies by
    the furthest position of the whole step, so batched it changes a short request's
    tokens once another passes the original length; ours picks them per sequence. (A
    request that passes it depends on where its prompt's chunks fall, alone or not.)"""
    engine = LLMEngine(loaded, EngineConfig(device="cpu", quantization=Quantization.F32, fused_decode=False))
    short = [prompt for prompt in PROMPTS if len(prompt) + GREEDY.max_tokens <= 32]
    assert len(short) == 2
    return [engine.generate([prompt], GREEDY)[0].token_ids for prompt in short]


def _short(tokens):
    return [t for prompt, t in zip(PROMPTS, tokens) if len(prompt) + GREEDY.max_tokens <= 32]


def test_logits_are_bit_identical_to_transformers_classes(family_dir, monkeypatch):
    ours, theirs = _load(family_dir, monkeypatch, ours=True), _load(family_dir, monkeypatch, ours=False)
    assert isinstance(ours.model, native.NativeForCausalLM)
    assert type(theirs.model).__name__ == json.loads((family_dir / "config.json").read_text())["architectures"][0]
    assert ours.model.state_dict().keys() == theirs.model.state_dict().keys()
    assert torch.equal(prefill_logits(ours.model, PROMPTS[1]), prefill_logits(theirs.model, PROMPTS[1]))
    our_tokens, our_steps, _ = _engine_steps(ours)
    if ours.model.model.rotary_emb.long_inv_freq is not None:   # longrope: per sequence (`_alone`)
        assert _short(our_tokens) == _alone(theirs) != _short(_engine_steps(theirs)[0])
        return
    their_tokens, their_steps, _ = _engine_steps(theirs)
    assert our_tokens == their_tokens
    assert len(our_steps) == len(their_steps) > GREEDY.max_tokens
    assert all(torch.equal(a, b) for a, b in zip(our_steps, their_steps))
    assert ours.eos_token_ids == theirs.eos_token_ids and ours.max_context == theirs.max_context


def test_the_fused_step_on_our_classes_matches_transformers_classes(family_dir, monkeypatch):
    """Decode steps through the fused step (engine/fused.py) over our classes, against
    transformers' classes and layer code: the same greedy tokens, logits within float32
    rounding (the C kernels sum in another order)."""
    ours, theirs = _load(family_dir, monkeypatch, ours=True), _load(family_dir, monkeypatch, ours=False)
    tokens, steps, fused_steps = _engine_steps(ours, fused=True)
    if ours.model.model.rotary_emb.long_inv_freq is not None:   # longrope: per sequence (`_alone`)
        assert fused_steps > 0 and _short(tokens) == _alone(theirs)
        return
    reference_tokens, reference_steps, _ = _engine_steps(theirs)
    assert fused_steps > 0 and tokens == reference_tokens
    assert max((a - b).abs().max().item() for a, b in zip(steps, reference_steps)) < 1e-4


def test_the_tokenizer_is_the_one_autotokenizer_picks(family_dir, monkeypatch):
    from transformers import AutoTokenizer

    loaded = _load(family_dir, monkeypatch, ours=True)
    reference = AutoTokenizer.from_pretrained(family_dir)
    assert type(loaded.tokenizer) is type(reference)
    text = "A function takes arguments. def add(a, b): return a + b <|im_end|>"
    assert loaded.tokenizer.encode(text) == reference.encode(text)
    assert loaded.tokenizer.eos_token_id == reference.eos_token_id


@pytest.mark.parametrize("quantization", [Quantization.F16, Quantization.Q8_0, Quantization.Q4_K_M])
def test_quantized_models_take_our_classes_with_the_same_layers(make_tiny_model, monkeypatch, quantization):
    path = make_tiny_model()
    ours, theirs = _load(path, monkeypatch, True, quantization), _load(path, monkeypatch, False, quantization)
    assert isinstance(ours.model, native.NativeForCausalLM)
    assert ours.quantization_path == theirs.quantization_path
    layers = {name: type(m).__name__ for name, m in ours.model.named_modules() if name.endswith("proj")}
    assert layers == {name: type(m).__name__ for name, m in theirs.model.named_modules() if name.endswith("proj")}
    ids = PROMPTS[1]
    assert torch.equal(prefill_logits(ours.model, ids, ours.dtype), prefill_logits(theirs.model, ids, theirs.dtype))


def test_a_load_and_a_reply_import_none_of_transformers_modeling(make_tiny_model):
    script = (
        "import sys\n"
        "from ruvllm_cli.engine.config import EngineConfig\n"
        "from ruvllm_cli.engine.engine import LLMEngine\n"
        "from ruvllm_cli.engine.loader import load_model\n"
        "from ruvllm_cli.engine.sampling import SamplingParams\n"
        "from ruvllm_cli.quantization import Quantization as Q\n"
        f"loaded = load_model({str(make_tiny_model())!r}, 'cpu', Q.Q8_0, use_cache=False)\n"
        "engine = LLMEngine(loaded, EngineConfig(device='cpu', quantization=Q.Q8_0))\n"
        "engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0))\n"
        "heavy = ('transformers.modeling_utils', 'transformers.models.llama.modeling_llama',\n"
        "         'transformers.models.llama.configuration_llama', 'torch._dynamo', 'torch.distributed.tensor',\n"
        "         'sympy')\n"
        "print(type(loaded.model).__name__, [m for m in heavy if m in sys.modules])\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["NativeForCausalLM", "[]"]


def test_what_our_classes_do_not_compute_takes_transformers(make_tiny_model, monkeypatch, tmp_path):
    path = tmp_path / "yarn"
    shutil.copytree(make_tiny_model(), path)
    config = json.loads((path / "config.json").read_text())
    config.pop("rope_parameters", None)
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
    (path / "config.json").write_text(json.dumps(config))
    assert native.unsupported(config) == "RoPE type 'yarn'"
    loaded = load_model(path, "cpu", Quantization.F32, use_cache=False)
    assert type(loaded.model).__name__ == "LlamaForCausalLM"
    monkeypatch.setenv(native.NATIVE_ENV, "0")
    assert type(load_model(make_tiny_model(), "cpu", Quantization.F32).model).__name__ == "LlamaForCausalLM"
    monkeypatch.delenv(native.NATIVE_ENV)
    for raw, reason in (({"model_type": "gemma"}, "model type 'gemma'"),
                        ({"model_type": "llama", "hidden_act": "gelu"}, "activation 'gelu'"),
                        ({"model_type": "llama", "quantization_config": {"quant_method": "awq"}},
                         "a pre-quantized checkpoint")):
        assert native.unsupported(raw) == reason
