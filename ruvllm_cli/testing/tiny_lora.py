"""Random LoRA adapters for a model directory, written by peft itself (tests, benchmarks).

`init_lora_weights=False` makes both A and B random, so an adapter really changes
the model's output (peft's default starts B at zero: a no-op adapter).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def build_lora_adapter(model_dir: str | os.PathLike, path: str | os.PathLike, *, rank: int = 8,
                       alpha: float = 16.0, targets: Sequence[str] = ATTENTION + MLP, seed: int = 0,
                       rank_pattern: dict[str, int] | None = None, use_rslora: bool = False,
                       scale_b: float = 1.0) -> Path:
    """Save a random peft LoRA adapter for the model in `model_dir` into `path`
    (`scale_b` multiplies B, for adapters whose effect must show through a mix)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    path = Path(path)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False,
                        rank_pattern=dict(rank_pattern or {}), use_rslora=use_rslora, task_type="CAUSAL_LM")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = get_peft_model(base, config)
    if scale_b != 1.0:
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "lora_B" in name:
                    parameter.mul_(scale_b)
    model.save_pretrained(path)
    return path


def build_xlora_adapter(model_dir: str | os.PathLike, path: str | os.PathLike, experts: Sequence[str | os.PathLike],
                        *, depth: int = 2, size: int = 32, layerwise: bool = False, top_k: int | None = None,
                        softmax_topk: bool = False, temperature: float = 1.0, global_weight: float = 1.0,
                        scaling_pass_value: float = 0.0, seed: int = 0) -> Path:
    """Save a peft X-LoRA model over LoRA `experts` with a random classifier whose
    weights differ sharply from token to token.

    peft 0.21's save_pretrained drops the classifier layers whose index equals an
    expert's name ("0", "1", ...), so the classifier file is written here whole,
    with the keys peft itself reads."""
    import torch
    from peft import XLoraConfig, get_peft_model
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    path = Path(path)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, use_cache=False)
    config = XLoraConfig(task_type="CAUSAL_LM", hidden_size=base.config.hidden_size,
                         adapters={str(i): str(Path(e).resolve()) for i, e in enumerate(experts)},
                         xlora_depth=depth, xlora_size=size, layerwise_scalings=layerwise, top_k_lora=top_k,
                         enable_softmax=not softmax_topk, enable_softmax_topk=softmax_topk,
                         softmax_temperature=temperature, global_scaling_weight=global_weight,
                         scaling_pass_value=scaling_pass_value)
    model = get_peft_model(base, config).eval()
    classifier = model.base_model.internal_xlora_classifier
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for name, parameter in classifier.named_parameters():
            fan_in = parameter.shape[-1] if parameter.dim() == 2 else 1
            parameter.normal_(0.0, 3.0 / fan_in ** 0.5 if name.endswith("weight") else 0.5)
    model.save_pretrained(path)
    state = {f"base_model.internal_xlora_classifier.{k}": v.detach().clone().contiguous()
             for k, v in classifier.state_dict().items()}
    save_file(state, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    return path
