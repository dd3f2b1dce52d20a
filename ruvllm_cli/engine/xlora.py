"""X-LoRA (peft's XLoraModel) served with KV caches.

An X-LoRA model mixes several LoRA experts per token: a scaling pass runs the model
with constant expert weights (`scaling_pass_value`, 0 by default: the base model),
a small classifier reads its final normed hidden state and gives every token a
weight per expert (and per layer, with `layerwise_scalings`), and the main pass adds
`sum_i B_i(A_i(x * s_i)) * scale_i * global_scaling_weight` in every targeted layer.

peft's generate() runs both passes over the whole sequence at every token, without
a KV cache. Both passes are causal (a token's scalings depend on tokens up to it),
so each can keep a cache: the engine gives the scaling pass a second KV pool with
the same block ids (the runner's `scaling_cache`), and a step runs the scaling pass
over its X-LoRA tokens, the classifier, then the one main forward of the whole
batch, where X-LoRA tokens carry their scalings (docs/design.md section 11).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ruvllm_cli.engine.lora import ADAPTER_CONFIG, AdapterError, LoRAModule, _uids, is_number, read_adapter

CLASSIFIER_PREFIX = "base_model.internal_xlora_classifier.layers."


def is_xlora(path: str | Path) -> bool:
    config = Path(path).expanduser() / ADAPTER_CONFIG
    try:
        return json.loads(config.read_text()).get("peft_type") == "XLORA"
    except (OSError, ValueError, AttributeError):
        return False


@dataclass(eq=False)
class XLoRAAdapter:
    """The experts (LoRA modules by layer name, in the config's order), the classifier
    and peft's mixing settings. `layer_of` numbers the targeted layers as peft does
    (set when installed on a model)."""

    name: str
    source: str
    experts: list[dict[str, LoRAModule]]
    classifier: nn.Sequential
    settings: dict[str, Any]
    layer_of: dict[str, int] = field(default_factory=dict)
    uid: int = field(default_factory=lambda: next(_uids))
    mixture = True

    @property
    def modules(self) -> dict[str, LoRAModule]:
        """Every targeted layer (one expert's module each), for the manager's checks."""
        return {name: module for expert in self.experts for name, module in expert.items()}

    @property
    def rank(self) -> int:
        return max(m.rank for expert in self.experts for m in expert.values())

    @property
    def num_layers(self) -> int:
        return len(self.layer_of)

    def describe(self) -> str:
        return (f"{self.name} (X-LoRA: {len(self.experts)} experts of rank up to {self.rank}, "
                f"classifier depth {self.settings['xlora_depth']}; a second KV pool for its scaling pass)")

    def to(self, dtype: torch.dtype, device: torch.device) -> None:
        for expert in self.experts:
            for module in expert.values():
                module.a = module.a.to(device, dtype)
                module.b = module.b.to(device, dtype)
        self.classifier.to(device, dtype)

    # ---- the scalings ----
    def pass_scalings(self, tokens: int) -> torch.Tensor | None:
        """The scaling pass's constant scalings [T, L, n]; None when they are 0 (the base model)."""
        value = float(self.settings["scaling_pass_value"])
        if value == 0.0:
            return None
        weights = self.classifier[0].weight
        full = torch.full((tokens, self.num_layers, len(self.experts)), value, dtype=weights.dtype,
                          device=weights.device)
        return self._top_k(full)

    def scalings(self, hidden: torch.Tensor) -> torch.Tensor:
        """Per-token expert weights [T, L, n] from the scaling pass's final hidden states [T, H]."""
        settings, experts = self.settings, len(self.experts)
        logits = self.classifier(hidden.to(self.classifier[0].weight.dtype))
        if settings["layerwise_scalings"]:
            scalings = logits.reshape(hidden.shape[0], self.num_layers, experts)
        else:
            scalings = logits.unsqueeze(1).expand(-1, self.num_layers, -1)
        if settings["enable_softmax"]:
            scalings = torch.softmax(scalings / settings["softmax_temperature"], dim=-1)
        return self._top_k(scalings)

    def _top_k(self, scalings: torch.Tensor) -> torch.Tensor:
        """peft's per-layer top-k (no renormalisation) and softmax over the kept ones."""
        settings = self.settings
        if settings["top_k_lora"] is not None:
            _, kept = torch.topk(scalings, k=settings["top_k_lora"], dim=-1)
            mask = torch.zeros_like(scalings, dtype=torch.bool).scatter_(-1, kept, True)
            scalings = scalings * mask.to(scalings.dtype)
        if settings["enable_softmax_topk"]:
            nonzero = scalings != 0
            scalings = torch.softmax(scalings.masked_fill(~nonzero, float("-inf")), dim=-1).masked_fill(~nonzero, 0.0)
        return scalings


SETTINGS = {"xlora_depth": 1, "layerwise_scalings": False, "enable_softmax": True, "softmax_temperature": 1.0,
            "top_k_lora": None, "enable_softmax_topk": False, "global_scaling_weight": 1.0,
            "scaling_pass_value": 0.0}


def read_xlora(name: str, path: str | Path) -> XLoRAAdapter:
    """Read a peft X-LoRA directory: its config, classifier and the experts it names."""
    path = Path(path).expanduser()
    try:
        config = json.loads((path / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError) as error:
        raise AdapterError(f"adapter {name}: cannot read {path / ADAPTER_CONFIG}: {error}") from None
    experts_config = config.get("adapters")
    if not isinstance(experts_config, dict) or not experts_config:
        raise AdapterError(f"adapter {name}: an X-LoRA config without experts (adapters)")
    settings = {key: config.get(key, default) for key, default in SETTINGS.items()}
    _check_settings(name, settings, len(experts_config))
    experts = [read_adapter(f"{name}/{expert}", _expert_dir(path, expert, where)).modules
               for expert, where in experts_config.items()]
    return XLoRAAdapter(name, str(path), experts, _classifier(name, path), settings)


def _check_settings(name: str, settings: dict[str, Any], experts: int) -> None:
    """Settings that would fail the first request using the adapter (an error there is
    the engine's, in its step) are refused while it loads."""
    top_k = settings["top_k_lora"]
    if top_k is not None and not (isinstance(top_k, int) and not isinstance(top_k, bool) and 1 <= top_k <= experts):
        raise AdapterError(f"adapter {name}: top_k_lora must be between 1 and its {experts} experts, not {top_k!r}")
    temperature = settings["softmax_temperature"]
    if not is_number(temperature) or temperature <= 0:
        raise AdapterError(f"adapter {name}: softmax_temperature must be a positive number, not {temperature!r}")
    for key in ("scaling_pass_value", "global_scaling_weight"):
        if not is_number(settings[key]):
            raise AdapterError(f"adapter {name}: {key} must be a number, not {settings[key]!r}")
    for key in ("layerwise_scalings", "enable_softmax", "enable_softmax_topk"):
        if not isinstance(settings[key], bool):
            raise AdapterError(f"adapter {name}: {key} must be true or false, not {settings[key]!r}")


def _expert_dir(root: Path, expert: str, where: str) -> Path:
    """The expert's directory as the config names it, else beside the X-LoRA files."""
    for candidate in (Path(where).expanduser(), root / where, root / expert):
        if (candidate / ADAPTER_CONFIG).is_file():
            return candidate
    raise AdapterError(f"X-LoRA expert {expert}: no adapter directory at {where} (nor {root / expert})")


def _classifier(name: str, path: Path) -> nn.Sequential:
    """Linear layers in index order with ReLU between them (dropout is the identity here)."""
    from safetensors.torch import load_file

    weights_file = path / "adapter_model.safetensors"
    if not weights_file.is_file():
        raise AdapterError(f"adapter {name}: no X-LoRA classifier weights ({weights_file.name})")
    weights = load_file(str(weights_file))
    indices = sorted({int(key[len(CLASSIFIER_PREFIX):].split(".")[0]) for key in weights
                      if key.startswith(CLASSIFIER_PREFIX)})
    if not indices:
        raise AdapterError(f"adapter {name}: {weights_file.name} holds no X-LoRA classifier")
    layers: list[nn.Module] = []
    width: int | None = None   # the previous layer's outputs
    for index in indices:
        weight = weights.get(f"{CLASSIFIER_PREFIX}{index}.weight")
        bias = weights.get(f"{CLASSIFIER_PREFIX}{index}.bias")
        if weight is None or weight.dim() != 2 or (bias is not None and bias.shape != weight.shape[:1]):
            raise AdapterError(f"adapter {name}: X-LoRA classifier layer {index} has no weight matrix, or a bias "
                               "of another size")
        if width is not None and weight.shape[1] != width:
            raise AdapterError(f"adapter {name}: X-LoRA classifier layer {index} takes {weight.shape[1]} inputs, "
                               f"the layer before gives {width}")
        width = int(weight.shape[0])
        weight = weight.float()
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
        with torch.no_grad():
            linear.weight.copy_(weight)
            if bias is not None:
                linear.bias.copy_(bias.float())
        layers += [nn.ReLU(), linear] if layers else [linear]
    return nn.Sequential(*layers).eval()


def number_layers(model: nn.Module, adapter: XLoRAAdapter) -> None:
    """peft's layer numbers: the targeted layers in `model.named_modules()` order."""
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    takes = int(adapter.classifier[0].in_features)
    if hidden is not None and takes != hidden:
        raise AdapterError(f"adapter {adapter.name}: its classifier reads hidden states of size {takes}; this "
                           f"model's are {hidden} (an adapter for another base model?)")
    targets = set(adapter.modules)
    names = [name for name, _ in model.named_modules() if name in targets]
    adapter.layer_of = {name: index for index, name in enumerate(names)}
    expected = int(adapter.classifier[-1].out_features)
    per_token = len(adapter.experts) * (len(names) if adapter.settings["layerwise_scalings"] else 1)
    if expected != per_token:
        raise AdapterError(f"adapter {adapter.name}: the classifier gives {expected} weights per token, "
                           f"its experts and layers need {per_token}")
