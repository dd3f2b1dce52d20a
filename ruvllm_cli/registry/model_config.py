"""A model's shape read from its `config.json`, and its real parameter count (no torch).

`read_model_config` understands the key variants of the Llama, Qwen2, Mistral and
Phi-3 families (and configs that nest the language model under `text_config`).
`count_parameters_from_safetensors` reads the tensor shapes from the safetensors
headers themselves; `count_parameters` computes the same number from the shape.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ruvllm_cli.errors import ModelLoadError

# Families whose config class defaults `tie_word_embeddings` to False; any other
# transformers config inherits True from PretrainedConfig.
_UNTIED_BY_DEFAULT = {"llama", "mistral", "qwen2", "phi3", "mixtral", "qwen3"}
# Families whose q/k/v projections always carry a bias (no config flag for it).
_QKV_BIAS_FAMILIES = {"qwen2"}
_SAFETENSORS_HEADER_LIMIT = 100 * 1024 * 1024


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a decoder-only transformer that size its weights and KV cache."""

    architecture: str | None
    model_type: str | None
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    context_length: int | None
    tie_word_embeddings: bool
    torch_dtype: str | None
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "architecture": self.architecture,
            "model_type": self.model_type,
            "hidden_size": self.hidden_size,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "context_length": self.context_length,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": self.torch_dtype,
        }


def _first(cfg: dict[str, Any], *keys: str) -> Any:
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    return None


def _language_config(raw: dict[str, Any]) -> dict[str, Any]:
    """Multimodal configs keep the decoder's numbers under `text_config`."""
    text = raw.get("text_config")
    if isinstance(text, dict) and raw.get("hidden_size") is None:
        return {**raw, **text}
    return raw


# Fields of config.json that the loaders and the model classes read, by type. A value of
# another type had loaded ("rms_norm_eps": "1e-06" failed the first request's step with a
# TypeError, and the second stopped the server; "tie_word_embeddings": "false" tied the
# head, since a string is true): transformers 5 refuses both too.
_INTEGERS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
             "vocab_size", "head_dim", "max_position_embeddings", "original_max_position_embeddings",
             "sliding_window", "max_window_layers", "n_embd", "n_layer", "n_head", "n_head_kv", "n_inner",
             "n_positions")
_NUMBERS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "rope_theta", "partial_rotary_factor")
_BOOLEANS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window")
_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def check_field_types(raw: dict[str, Any], source: str = "config.json") -> None:
    """A ModelLoadError naming the first field of `_INTEGERS`, `_NUMBERS`, `_BOOLEANS` or
    `_TOKEN_IDS` whose value has another type (a missing or null field is left to the
    defaults)."""
    cfg = _language_config(raw)

    def integer(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    rules = ((_INTEGERS, integer, "an integer"),
             (_NUMBERS, lambda v: integer(v) or isinstance(v, float), "a number"),
             (_BOOLEANS, lambda v: isinstance(v, bool), "true or false"),
             (_TOKEN_IDS, lambda v: integer(v) or (isinstance(v, list) and all(integer(i) for i in v)),
              "a token id or a list of them"))
    for names, fits, kind in rules:
        for name in names:
            value = cfg.get(name)
            if value is not None and not fits(value):
                raise ModelLoadError(f"{source}: {name} must be {kind}, not {json.dumps(value)}",
                                     "the model's config.json is damaged or hand-edited: fix that field")


def shape_from_dict(raw: dict[str, Any], source: str = "config.json") -> ModelShape:
    """Builds a `ModelShape` from a parsed config; raises ModelLoadError if numbers are
    missing or a field has the wrong type (`check_field_types`)."""
    check_field_types(raw, source)
    cfg = _language_config(raw)
    architectures = raw.get("architectures") or cfg.get("architectures") or []
    model_type = cfg.get("model_type") or raw.get("model_type")
    hidden = _first(cfg, "hidden_size", "n_embd", "d_model")
    layers = _first(cfg, "num_hidden_layers", "n_layer", "num_layers")
    heads = _first(cfg, "num_attention_heads", "n_head")
    vocab = cfg.get("vocab_size")
    missing = [name for name, value in
               (("hidden_size", hidden), ("num_hidden_layers", layers),
                ("num_attention_heads", heads), ("vocab_size", vocab)) if value is None]
    if missing:
        raise ModelLoadError(f"{source} lacks {', '.join(missing)}",
                             "is this a decoder-only language model's config.json?")
    kv_heads = _first(cfg, "num_key_value_heads", "n_head_kv") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    intermediate = _first(cfg, "intermediate_size", "n_inner", "ffn_dim") or 4 * hidden
    tied = cfg.get("tie_word_embeddings")
    if tied is None:
        tied = model_type not in _UNTIED_BY_DEFAULT
    attention_bias = bool(cfg.get("attention_bias", False))
    return ModelShape(
        architecture=architectures[0] if architectures else None,
        model_type=model_type,
        hidden_size=int(hidden),
        num_layers=int(layers),
        num_heads=int(heads),
        num_kv_heads=int(kv_heads),
        head_dim=int(head_dim),
        intermediate_size=int(intermediate),
        vocab_size=int(vocab),
        context_length=_first(cfg, "max_position_embeddings", "n_positions", "max_sequence_length",
                              "seq_length"),
        tie_word_embeddings=bool(tied),
        torch_dtype=_first(cfg, "torch_dtype", "dtype"),
        qkv_bias=attention_bias or model_type in _QKV_BIAS_FAMILIES,
        o_bias=attention_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
    )


def read_config_json(path: Path) -> dict[str, Any]:
    """`config.json` (or the directory holding it) as a dict, or a ModelLoadError that
    says what is wrong with it: missing, unreadable, not UTF-8 JSON, not an object."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelLoadError(f"no config.json at {path}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelLoadError(f"cannot read {path}: {error}") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path} is not a JSON object")
    return raw


def read_model_dir_config(path: Path) -> dict[str, Any]:
    """A model directory's config.json as a dict: the loader's reading, and serve's
    check before it listens (locate.check_readable); a ModelLoadError that says what is
    wrong (no directory, no config.json, or read_config_json's)."""
    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(f"{path} is not a directory")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} is not a model directory (no config.json)",
                             "download the model first: ruvllm download MODEL")
    raw = read_config_json(path / "config.json")
    check_field_types(raw, str(path / "config.json"))
    return raw


def read_model_config(path: Path) -> ModelShape:
    """Reads `config.json` (or the directory holding it) into a `ModelShape`."""
    config_file = Path(path) / "config.json" if Path(path).is_dir() else Path(path)
    return shape_from_dict(read_config_json(config_file), str(config_file))


def count_parameters(shape: ModelShape) -> int:
    """Parameters of a Llama-style decoder, computed from its shape.

    embeddings V*H; per layer: q (H x heads*head_dim), k and v (H x kv_heads*head_dim),
    o (heads*head_dim x H), gate/up/down MLP (3*H*I), two RMSNorm weights (2H), plus the
    biases the family has; a final norm (H); and the LM head V*H unless it is tied.
    """
    h, q_dim = shape.hidden_size, shape.num_heads * shape.head_dim
    kv_dim = shape.num_kv_heads * shape.head_dim
    attention = h * q_dim + 2 * h * kv_dim + q_dim * h
    if shape.qkv_bias:
        attention += q_dim + 2 * kv_dim
    if shape.o_bias:
        attention += h
    mlp = 3 * h * shape.intermediate_size
    if shape.mlp_bias:
        mlp += 2 * shape.intermediate_size + h
    per_layer = attention + mlp + 2 * h
    embeddings = shape.vocab_size * h
    lm_head = 0 if shape.tie_word_embeddings else shape.vocab_size * h
    return embeddings + shape.num_layers * per_layer + h + lm_head


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file: 8-byte little-endian length, then the JSON."""
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) != 8:
            raise ModelLoadError(f"{path} is too short to be a safetensors file")
        (length,) = struct.unpack("<Q", prefix)
        if length > _SAFETENSORS_HEADER_LIMIT:
            raise ModelLoadError(f"{path} has an implausible safetensors header ({length} bytes)")
        try:
            header = json.loads(handle.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise ModelLoadError(f"{path} has a corrupt safetensors header") from None
    if not isinstance(header, dict):
        raise ModelLoadError(f"{path} has a corrupt safetensors header")
    return header


def count_parameters_from_safetensors(directory: Path) -> int | None:
    """Sum of the tensor sizes stored in `directory`'s safetensors files; None if it has none.

    A tied LM head is counted once, as `model.parameters()` does, even where a checkpoint
    stores it twice.
    """
    directory = Path(directory)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        return None
    tied = False
    if (directory / "config.json").is_file():
        try:
            tied = read_model_config(directory).tie_word_embeddings
        except ModelLoadError:
            tied = False
    total = 0
    for file in files:
        for name, info in read_safetensors_header(file).items():
            if name == "__metadata__" or (tied and name == "lm_head.weight"):
                continue
            total += math.prod(_tensor_shape(file, name, info))
    return total


def _tensor_shape(path: Path, name: str, info: Any) -> list[int]:
    """A header entry's shape; a ModelLoadError naming the file where the entry is no
    object with a list of counts (it had been an AttributeError out of `info`)."""
    shape = info.get("shape", []) if isinstance(info, dict) else None
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in shape):
        raise ModelLoadError(f"{path} has a corrupt safetensors header (tensor {name!r} has no valid shape)")
    return shape
