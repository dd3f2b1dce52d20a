"""What a model's weight files are, in one short label ("safetensors bf16", "GGUF Q4_K_M").

The label describes the files on disk, never a quantization applied when loading
them (that is `-q` on chat, serve and benchmark). No torch here: safetensors
headers are read directly, GGUF types come from llama.cpp's file naming.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Iterable

from ruvllm_cli.errors import ModelLoadError

# llama.cpp's type names as they appear in GGUF file names: Q4_K_M, Q8_0, IQ4_XS, F16, BF16, ...
_GGUF_TYPE_RE = re.compile(r"(?<![a-z0-9])(i?q\d(?:_[a-z0-9]+)*|bf16|fp16|f16|fp32|f32)(?![a-z0-9])")
_DTYPE_NAMES = {"BF16": "bf16", "F16": "f16", "F32": "f32", "F64": "f64", "I8": "int8", "U8": "uint8",
                "F8_E4M3": "fp8", "F8_E5M2": "fp8"}


def gguf_type(file_name: str) -> str | None:
    """The GGUF type a file name announces ("Q4_K_M", "F16"), or None."""
    found = _GGUF_TYPE_RE.findall(Path(file_name).stem.lower())
    if not found:
        return None
    name = found[-1].upper()
    return {"FP16": "F16", "FP32": "F32"}.get(name, name)


def safetensors_dtype(files: Iterable[Path]) -> str | None:
    """The dtype most of the tensors in `files` are stored in ("bf16"), or None if unreadable."""
    from ruvllm_cli.registry.model_config import read_safetensors_header

    counts: Counter[str] = Counter()
    for file in files:
        try:
            header = read_safetensors_header(file)
        except (OSError, ModelLoadError):
            return None
        counts.update(str(info.get("dtype")) for key, info in header.items()
                      if key != "__metadata__" and isinstance(info, dict))
    if not counts:
        return None
    dtype = counts.most_common(1)[0][0]
    return _DTYPE_NAMES.get(dtype, dtype.lower())


def weights_label(directory: Path, names: Iterable[str]) -> str:
    """"GGUF Q4_K_M, Q8_0" for GGUF files, "safetensors bf16" for a checkpoint, "LoRA adapter f32"
    for a PEFT adapter, "-" without weights."""
    names = sorted(names)
    ggufs = [name for name in names if name.lower().endswith(".gguf")]
    if ggufs:
        types = [gguf_type(name) or Path(name).name for name in ggufs]
        return "GGUF " + ", ".join(dict.fromkeys(types))
    shards = [directory / name for name in names if name.endswith(".safetensors")]
    if not shards:
        return "-"
    dtype = safetensors_dtype(shards)
    kind = "LoRA adapter" if "adapter_config.json" in names else "safetensors"
    return f"{kind} {dtype}" if dtype else kind
