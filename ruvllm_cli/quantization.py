"""Quantization names (light: no torch). The engine maps them to load-time paths."""

from __future__ import annotations

from enum import Enum

from ruvllm_cli.errors import UsageError


class Quantization(str, Enum):
    Q4_K_M = "q4k"
    Q8_0 = "q8"
    F16 = "f16"
    F32 = "none"

    @property
    def label(self) -> str:
        return {"q4k": "Q4_K_M", "q8": "Q8_0", "f16": "F16", "none": "F32"}[self.value]

    def precision(self, compute: str) -> str:
        """What the weights are and what the layers compute in (`compute`: "float32",
        "bfloat16"), by the `-q` name: "float32", "f16: bfloat16", "q8: 8-bit weights,
        float32 compute". It said "float32 (F16)" for 16-bit weights computed in float32,
        which read as a contradiction."""
        if self is Quantization.F32:
            return compute
        if self is Quantization.F16:
            return f"f16: {compute}" if compute != "float32" else "f16: 16-bit weights, float32 compute"
        bits = 8 if self is Quantization.Q8_0 else 4
        return f"{self.value}: {bits}-bit weights, {compute} compute"


_NAMES = {
    "q4k": Quantization.Q4_K_M, "q4_k": Quantization.Q4_K_M, "q4_k_m": Quantization.Q4_K_M,
    "q4": Quantization.Q4_K_M,
    "q8": Quantization.Q8_0, "q8_0": Quantization.Q8_0,
    "f16": Quantization.F16, "fp16": Quantization.F16,
    "none": Quantization.F32, "f32": Quantization.F32, "fp32": Quantization.F32,
}
CHOICES = "q4k|q8|f16|none"
# q4k's int4 groups, weights per bfloat16 scale and zero (docs/design.md, section 4b): the
# loader quantizes with them and the memory estimates count them (registry/memory.py).
INT4_GROUP = 64        # linear layers (32 where the hidden size is not a multiple)
TIED_INT4_GROUP = 32   # embedding tables; a tied head's table is the embedding's too (Int4Embedding's group)
QUANTIZATION_NAMES = tuple(_NAMES)  # every accepted spelling, lowercase


def parse_quantization(name: str | Quantization) -> Quantization:
    """Case-insensitive: q4k|q4_k|q4_k_m|q4, q8|q8_0, f16|fp16, none|f32|fp32."""
    if isinstance(name, Quantization):
        return name
    try:
        return _NAMES[name.strip().lower()]
    except KeyError:
        raise UsageError(f"unknown quantization '{name}'", f"choose one of {CHOICES}") from None


def int4_fits(out_features: int, in_features: int, group: int) -> bool:
    """Whether the CPU int4 kernel takes a linear layer of this shape (else q4k keeps it int8)."""
    return in_features % group == 0 and out_features % 8 == 0


def quantization_of_gguf(file_name: str) -> Quantization | None:
    """The quantization a GGUF file name announces (llama.cpp's naming), if any; the
    file's own `general.file_type` comes first (engine/gguf_plan.py). F16 files load
    as float32, which holds their values exactly (bfloat16 would round them)."""
    name = file_name.lower()
    for marker, quantization in (("q4_k", Quantization.Q4_K_M), ("q4_0", Quantization.Q4_K_M),
                                 ("q8_0", Quantization.Q8_0), ("bf16", Quantization.F16),
                                 ("f16", Quantization.F32), ("fp16", Quantization.F32),
                                 ("f32", Quantization.F32)):
        if marker in name:
            return quantization
    return None
