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
                       rank_pattern: dict[str, int] | None = None, use_rslora: bool = False) -> Path:
    """Save a random peft LoRA adapter for the model in `model_dir` into `path`."""
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
    model.save_pretrained(path)
    return path
