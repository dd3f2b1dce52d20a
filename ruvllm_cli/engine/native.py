"""Our own model classes for the Llama family (Llama, Qwen2, Mistral, Phi-3) on a CPU.

They hold the same modules under the same names as transformers' classes (so the
checkpoint, the quantizers, the LoRA wrappers, the weight cache and the fused decode
step see no difference), and run the same operations in the same order, so float32
logits are bit-identical to the stock classes (tests/engine/test_native.py). What they
save is transformers' import: its configuration and modeling modules pull in
`torch.distributed.tensor` (and sympy) and `torch._dynamo`, about 2.3 s and 115 MiB of
a cached start on the 0.5B shape (docs/design.md, section 8). The config comes from
config.json with each family's defaults; anything these classes do not compute (other
RoPE types, other activations, pre-quantized checkpoints) keeps the stock classes.
Phi-3 differs only in its fused q/k/v and gate/up projections and its "longrope".
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ruvllm_cli.engine.attention import StepMetadata, paged_attention_forward

NATIVE_ENV = "RUVLLM_NATIVE"   # "0": transformers' model classes for every family
ROPE_TYPES = ("default", "linear", "llama3", "longrope")

# config.json's defaults per family: transformers' LlamaConfig, Qwen2Config,
# MistralConfig and Phi3Config (5.x) for the fields these classes read.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"vocab_size": 32000, "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2,
              "attention_bias": False, "mlp_bias": False, "num_key_value_heads": None},
    "qwen2": {"vocab_size": 151936, "max_position_embeddings": 32768, "bos_token_id": None, "eos_token_id": None,
              "num_key_value_heads": 32},
    "mistral": {"vocab_size": 32000, "max_position_embeddings": 131072, "bos_token_id": 1, "eos_token_id": 2,
                "num_key_value_heads": 8, "sliding_window": 4096},
    "phi3": {"vocab_size": 32064, "max_position_embeddings": 4096, "original_max_position_embeddings": 4096,
             "bos_token_id": 1, "eos_token_id": 32000, "pad_token_id": 32000, "num_key_value_heads": None,
             "rms_norm_eps": 1e-5},
}
_COMMON = {"hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "pad_token_id": None,
           "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "head_dim": None}
_INTERMEDIATE = {"llama": 11008, "qwen2": 22016, "mistral": 14336, "phi3": 8192}


class NativeConfig:
    """A model's config.json as attributes, with its family's defaults filled in and
    the RoPE parameters in one dict (`rope_parameters`), as transformers keeps them."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.__dict__.update(values)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], name_or_path: str = "") -> "NativeConfig":
        family = raw["model_type"]
        values = {**_COMMON, "intermediate_size": _INTERMEDIATE[family], **_DEFAULTS[family], **raw,
                  "_name_or_path": name_or_path}
        if values["num_key_value_heads"] is None:
            values["num_key_value_heads"] = values["num_attention_heads"]
        if values["head_dim"] is None:
            values["head_dim"] = values["hidden_size"] // values["num_attention_heads"]
        values.setdefault("mlp_bias", False)
        values.setdefault("attention_bias", False)
        values["rope_parameters"] = _rope_parameters(values, values["max_position_embeddings"])
        return cls(values)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _rope_parameters(raw: dict[str, Any], max_positions: int) -> dict[str, Any]:
    """RoPE's parameters as transformers standardises them: `rope_parameters`, or the
    older `rope_scaling` with `rope_theta` beside it (10,000 when absent)."""
    parameters = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    parameters.setdefault("rope_type", parameters.get("type", "default"))
    parameters.setdefault("rope_theta", raw.get("rope_theta", 10_000.0))
    if raw.get("model_type") == "phi3":   # Phi3Config's reading: older names, the factor kept
        parameters.setdefault("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
        if parameters["rope_type"] in ("su", "yarn"):
            parameters["rope_type"] = "longrope"
    if parameters["rope_type"] in ("llama3", "longrope"):
        if "original_max_position_embeddings" in raw:   # the config's own field wins (Phi-3's)
            parameters["original_max_position_embeddings"] = raw["original_max_position_embeddings"]
        parameters.setdefault("original_max_position_embeddings", max_positions)
    return parameters


def layer_windows(config: Any) -> list[int | None]:
    """Each layer's sliding window (None: full attention), as transformers' classes of
    these families pass it to the attention: Mistral and Phi-3 the config's
    `sliding_window` in every layer; Qwen2 only where `use_sliding_window` is set, in the
    layers `layer_types` (or `max_window_layers`) names; Llama none."""
    family, layers = getattr(config, "model_type", None), int(config.num_hidden_layers)
    window = getattr(config, "sliding_window", None)
    if family in ("mistral", "phi3"):
        return [window or None] * layers
    if family != "qwen2" or not getattr(config, "use_sliding_window", False) or not window:
        return [None] * layers
    types = getattr(config, "layer_types", None) or [
        "sliding_attention" if index >= int(getattr(config, "max_window_layers", 28)) else "full_attention"
        for index in range(layers)]
    return [window if kind == "sliding_attention" else None for kind in types]


def unsupported(raw: dict[str, Any]) -> str | None:
    """Why a config.json takes transformers' classes, or None when ours compute it."""
    if os.environ.get(NATIVE_ENV, "1") == "0":
        return f"{NATIVE_ENV}=0"
    family = raw.get("model_type")
    if family not in _DEFAULTS:
        return f"model type {family!r}"
    if raw.get("quantization_config"):
        return "a pre-quantized checkpoint"
    if raw.get("hidden_act", "silu") != "silu":
        return f"activation {raw['hidden_act']!r}"
    rope = _rope_parameters(raw, int(raw.get("max_position_embeddings") or 0))
    if rope["rope_type"] not in ROPE_TYPES or rope.get("partial_rotary_factor", 1.0) != 1.0:
        return f"RoPE type {rope['rope_type']!r}"
    if int(raw.get("pretraining_tp") or 1) != 1:
        return "pretraining_tp"
    return _invalid_shape(NativeConfig.from_dict(raw))


def _invalid_shape(config: NativeConfig) -> str | None:
    """A shape our classes cannot build (transformers' then says what is wrong with it)."""
    sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim")
    if not all(isinstance(getattr(config, name), int) and getattr(config, name) > 0 for name in sizes):
        return "a size that is not a positive integer"
    if config.num_attention_heads % config.num_key_value_heads:
        return "query heads not a multiple of the KV heads"
    return None


def read_config(path: Path) -> NativeConfig | None:
    """The model directory's config for our classes, or None when it takes the stock ones."""
    raw = json.loads((path / "config.json").read_text())
    return None if unsupported(raw) else NativeConfig.from_dict(raw, str(path))


@dataclass
class GenerationDefaults:
    """generation_config.json's fields the engine reads (the end-of-sequence ids)."""

    eos_token_id: int | list[int] | None = None
    bos_token_id: int | None = None
    pad_token_id: int | None = None

    @classmethod
    def read(cls, path: Path) -> "GenerationDefaults | None":
        file = path / "generation_config.json"
        if not file.is_file():
            return None
        raw = json.loads(file.read_text())
        return cls(**{key: raw.get(key) for key in ("eos_token_id", "bos_token_id", "pad_token_id")})


def inverse_frequencies(config: NativeConfig, long: bool = False) -> torch.Tensor:
    """RoPE's inverse frequencies (transformers' `ROPE_INIT_FUNCTIONS` for the default,
    linear, llama3 and longrope types, the same float32 operations); `long`: longrope's
    set for sequences past its original length."""
    rope, dim = config.rope_parameters, config.head_dim
    if rope["rope_type"] == "longrope":
        factors = torch.tensor(rope["long_factor" if long else "short_factor"], dtype=torch.float32)
        return 1.0 / (factors * rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope["rope_type"] == "linear":
        return inv_freq / rope["factor"]
    if rope["rope_type"] != "llama3":
        return inv_freq
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context = rope["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def attention_factor(config: NativeConfig) -> float:
    """longrope's scale of cos and sin (1 for the other types)."""
    rope = config.rope_parameters
    if rope["rope_type"] != "longrope":
        return 1.0
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    original = rope["original_max_position_embeddings"]
    factor = rope.get("factor") or config.max_position_embeddings / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


class RotaryEmbedding(nn.Module):
    def __init__(self, config: NativeConfig) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inverse_frequencies(config), persistent=False)
        self.attention_scaling = attention_factor(config)
        # longrope: a sequence whose furthest position in the step passes the original
        # length takes the long set, for all its tokens, as transformers' module does for
        # its one sequence; each sequence of a batched step by its own (`furthest`).
        longrope = config.rope_parameters["rope_type"] == "longrope"
        self.long_inv_freq = inverse_frequencies(config, long=True) if longrope else None
        self.original_length = config.rope_parameters.get("original_max_position_embeddings", 0)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor,
                furthest: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [1, T, D] in x's dtype for positions [1, T]. `furthest` [1, T]: the
        furthest position in this step of each token's sequence (longrope's choice; all
        the tokens one sequence when None). A batch had taken the long set for every
        sequence once one passed the original length: a short request's tokens changed
        with its neighbours (a helper's pass)."""
        inv_freq = self.inv_freq.to(device=x.device, dtype=torch.float)
        if self.long_inv_freq is not None:
            furthest = position_ids.max().view(1, 1) if furthest is None else furthest
            long = furthest + 1 > self.original_length
            long_inv_freq = self.long_inv_freq.to(device=x.device, dtype=torch.float)
            if bool(long.all()):
                inv_freq = long_inv_freq
            elif bool(long.any()):   # per token: the same products as a set for all
                inv_freq = torch.where(long[..., None], long_inv_freq, inv_freq)
        freqs = position_ids[..., None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def sequence_furthest(position_ids: torch.Tensor, step: StepMetadata | None) -> torch.Tensor | None:
    """[1, T]: each packed token's sequence's furthest position in the step (a decode's
    own; a prefill chunk's last), or None without step metadata (one sequence)."""
    if step is None:
        return None
    furthest = position_ids.clone()
    for segment in step.prefills:
        furthest[0, segment.start:segment.start + segment.length] = segment.context_len + segment.length - 1
    return furthest


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, **factory: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, **factory), requires_grad=False)
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


def _linear(in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device: Any) -> nn.Linear:
    """nn.Linear with uninitialised parameters: its own constructor draws random weights,
    which on the meta device goes through torch's reference ops and imports
    torch._dynamo (0.8 s, 38 MiB)."""
    linear = nn.Linear.__new__(nn.Linear)
    nn.Module.__init__(linear)
    linear.in_features, linear.out_features = in_features, out_features
    linear.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device),
                                 requires_grad=False)
    linear.bias = (nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False)
                   if bias else None)
    return linear


def _embedding(rows: int, width: int, padding_idx: int | None, dtype: torch.dtype, device: Any) -> nn.Embedding:
    weight = torch.empty(rows, width, dtype=dtype, device=device)
    return nn.Embedding(rows, width, padding_idx, _weight=weight, _freeze=True)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: NativeConfig, layer_idx: int, **factory: Any) -> None:
        super().__init__()
        self.layer_idx, self.head_dim = layer_idx, config.head_dim
        self.scaling = self.head_dim ** -0.5
        self.sliding_window = layer_windows(config)[layer_idx]
        q_size, kv_size = config.num_attention_heads * self.head_dim, config.num_key_value_heads * self.head_dim
        # Qwen2: q/k/v always carry a bias, o_proj never; Llama: all four follow
        # attention_bias; Mistral and Phi-3: none. Phi-3 keeps q, k, v in one matrix.
        llama_bias = config.model_type == "llama" and bool(config.attention_bias)
        qkv_bias = llama_bias or config.model_type == "qwen2"
        self.sizes = (q_size, kv_size, kv_size)
        if config.model_type == "phi3":
            self.qkv_proj = _linear(config.hidden_size, q_size + 2 * kv_size, False, **factory)
        else:
            self.q_proj = _linear(config.hidden_size, q_size, qkv_bias, **factory)
            self.k_proj = _linear(config.hidden_size, kv_size, qkv_bias, **factory)
            self.v_proj = _linear(config.hidden_size, kv_size, qkv_bias, **factory)
        self.o_proj = _linear(q_size, config.hidden_size, llama_bias, **factory)

    def _project(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if "qkv_proj" in self._modules:
            return self.qkv_proj(hidden_states).split(self.sizes, dim=-1)
        return self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                step: StepMetadata) -> torch.Tensor:
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query, key, value = (t.view(shape).transpose(1, 2) for t in self._project(hidden_states))  # [1, H, T, D]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        query = (query * cos) + (_rotate_half(query) * sin)
        key = (key * cos) + (_rotate_half(key) * sin)
        out, _ = paged_attention_forward(self, query, key, value, None, scaling=self.scaling, ruvllm_step=step,
                                         sliding_window=self.sliding_window)
        return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1).contiguous())


class MLP(nn.Module):
    def __init__(self, config: NativeConfig, **factory: Any) -> None:
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        bias = config.model_type == "llama" and bool(config.mlp_bias)   # the other families have none
        if config.model_type == "phi3":   # gate and up in one matrix
            self.gate_up_proj = _linear(hidden, 2 * inner, False, **factory)
        else:
            self.gate_proj = _linear(hidden, inner, bias, **factory)
            self.up_proj = _linear(hidden, inner, bias, **factory)
        self.down_proj = _linear(inner, hidden, bias, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if "gate_up_proj" in self._modules:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(up * F.silu(gate))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: NativeConfig, layer_idx: int, **factory: Any) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx, **factory)
        self.mlp = MLP(config, **factory)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                step: StepMetadata) -> torch.Tensor:
        hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states), cos, sin, step)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


@dataclass
class DecoderOutput:
    last_hidden_state: torch.Tensor


@dataclass
class CausalLMOutput:
    logits: torch.Tensor


class DecoderModel(nn.Module):
    def __init__(self, config: NativeConfig, **factory: Any) -> None:
        super().__init__()
        self.embed_tokens = _embedding(config.vocab_size, config.hidden_size, config.pad_token_id, **factory)
        self.layers = nn.ModuleList(DecoderLayer(config, index, **factory)
                                    for index in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)
        self.rotary_emb = RotaryEmbedding(config)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, ruvllm_step: StepMetadata,
                **_: Any) -> DecoderOutput:
        """input_ids, position_ids [1, T]: the step's packed tokens (engine/model_runner.py)."""
        hidden_states = self.embed_tokens(input_ids)
        furthest = sequence_furthest(position_ids, ruvllm_step) if self.rotary_emb.long_inv_freq is not None else None
        cos, sin = self.rotary_emb(hidden_states, position_ids, furthest)
        for layer in self.layers:
            hidden_states = layer(hidden_states, cos, sin, ruvllm_step)
        return DecoderOutput(self.norm(hidden_states))


class NativeForCausalLM(nn.Module):
    """The stock `*ForCausalLM` interface the engine uses: `model`, `lm_head`, `config`,
    `generation_config`, a forward with `logits_to_keep`, and the embedding accessors."""

    def __init__(self, config: NativeConfig, dtype: torch.dtype, device: str | torch.device = "cpu") -> None:
        super().__init__()
        self.config = config
        self.generation_config: GenerationDefaults | None = None
        factory = {"dtype": dtype, "device": device}
        self.model = DecoderModel(config, **factory)
        self.lm_head = _linear(config.hidden_size, config.vocab_size, False, **factory)
        self.tie_weights()

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, ruvllm_step: StepMetadata,
                logits_to_keep: int | torch.Tensor = 0, **_: Any) -> CausalLMOutput:
        hidden = self.model(input_ids, position_ids, ruvllm_step).last_hidden_state
        if isinstance(logits_to_keep, int):
            hidden = hidden[:, -logits_to_keep:] if logits_to_keep else hidden
        else:
            hidden = hidden[:, logits_to_keep]
        return CausalLMOutput(self.lm_head(hidden))

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def get_decoder(self) -> DecoderModel:
        return self.model

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def set_input_embeddings(self, module: nn.Module) -> None:
        self.model.embed_tokens = module

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def set_output_embeddings(self, module: nn.Module) -> None:
        self.lm_head = module


def skeleton(path: Path, dtype: torch.dtype) -> NativeForCausalLM | None:
    """Our model for `path` with its parameters on the meta device (the RoPE frequencies
    real), or None when the config takes transformers' classes."""
    config = read_config(path)
    if config is None:
        return None
    model = NativeForCausalLM(config, dtype, device="meta")   # the RoPE buffer is made on the CPU
    model.generation_config = GenerationDefaults.read(path)
    return model.eval()
