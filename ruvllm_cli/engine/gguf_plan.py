"""What each tensor of a GGUF file becomes when it is loaded on a CPU, from the file's
tensor table alone (no torch): the quantization its file type asks for, the route each
weight takes into our layouts, the one-line summary the load line and `ruvllm info`
show, and the bytes the loaded weights take (the loader's memory check).

A weight's route (docs/design.md, section 9, "GGUF straight in"):
- into float32 (`-q none`): float tensors kept exactly, quantized ones dequantized,
  also exactly (a block's f16 scale times its small integer codes fits float32);
- into 16 bits (`-q f16`): bf16 where the CPU runs our bfloat16 kernel (BF16 kept,
  everything else rounded), else float16 for our float16 kernel (F16 kept);
- into int4 (`-q q4k`): Q4_K repacked, its 4-bit codes kept (its sub-blocks of 32 with
  a scale and a min are our asymmetric int4 groups of 32; only the scale and the min
  are rounded to bf16, the int4 kernel's type); other types requantized;
- into int8 (`-q q8`): requantized (a block's scale per 32 weights, ours one per row).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from ruvllm_cli.engine.gguf_check import GGUFLayout, TensorInfo
from ruvllm_cli.quantization import Quantization, int4_fits

STREAMED_ARCHS = ("llama", "qwen2")  # mapped by engine/gguf_load.py; others load through transformers
# Types the gguf package dequantizes that these loads were checked with (others: transformers' path).
READABLE = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
            "IQ4_NL", "IQ4_XS", "IQ3_S", "IQ3_XXS", "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_M", "IQ1_S")
INT4_GROUP = 32   # Q4_K's sub-block width, and Q4_0/Q5_0/Q8_0's block: our int4 group for GGUF weights
EMBEDDING, HEAD = "token_embd.weight", "output.weight"
EXACT_INT4 = ("Q4_K",)  # ggml types whose blocks are our int4 groups of INT4_GROUP
FLOAT_TYPES = ("F32", "F16", "BF16")


class Layout(str, Enum):
    FLOAT32 = "float32"
    BF16 = "bf16"
    FLOAT16 = "float16"   # `f16` on a CPU without our bfloat16 kernel (loader.half_weights_here)
    INT8 = "int8"
    INT4 = "int4"


class Route(str, Enum):
    KEPT = "kept exactly in"               # float values that the layout holds as they are
    DEQUANTIZED = "dequantized exactly into"  # blocks unpacked into float32: the file's values
    ROUNDED = "rounded into"               # values rounded to bf16 or float16
    REPACKED = "repacked into"             # 4-bit codes kept; scale and min rounded to bf16
    REQUANTIZED = "requantized into"       # blocks unpacked, then quantized again
    QUANTIZED = "quantized into"           # float values quantized


@dataclass(frozen=True)
class TensorPlan:
    """One 2-D weight of the file: its type, and what it becomes."""

    name: str
    type_name: str
    rows: int
    elements: int
    layout: Layout
    route: Route


def type_name(ggml_type: int) -> str:
    from gguf.constants import GGMLQuantizationType

    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"


def file_type(layout: GGUFLayout) -> str | None:
    """llama.cpp's name for the file's type ("Q4_K_M", "F16"), when it says one."""
    import gguf

    value = layout.metadata.get("general.file_type")
    try:
        return gguf.LlamaFileType(value).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except ValueError:
        return None


def _quantization_for(name: str) -> Quantization:
    """Our layout with at least the bits of a llama.cpp type: F16 into float32 (bf16
    would round it), 5 to 8 bits into int8, fewer into int4."""
    if name in ("F32", "F16"):
        return Quantization.F32
    if name == "BF16":
        return Quantization.F16
    if name.startswith(("Q8", "Q6", "Q5", "TQ")):   # ternary weights: int8 holds {-d, 0, d} exactly
        return Quantization.Q8_0
    return Quantization.Q4_K_M


def file_quantization(layout: GGUFLayout) -> Quantization:
    """The quantization a GGUF file loads with when `-q` does not say: by the type most
    of its weight matrices have (a file type names a recipe, and a recipe can leave
    every matrix in another type: llama-quantize's MXFP4_MOE on a dense model writes
    Q8_0), else by its file type."""
    weights = Counter(type_name(t.ggml_type) for t in layout.tensors if len(t.dims) == 2)
    named = weights.most_common(1)[0][0] if weights else file_type(layout) or "F32"
    return _quantization_for(named)


def label(layout: GGUFLayout) -> str:
    return file_type(layout) or "GGUF"


def _layout_for(tensor: TensorInfo, quantization: Quantization, half: bool = False) -> Layout:
    columns, rows = tensor.dims[0], tensor.dims[1]
    if quantization is Quantization.F32:
        return Layout.FLOAT32
    if quantization is Quantization.F16:
        return Layout.FLOAT16 if half else Layout.BF16
    if quantization is Quantization.Q8_0:
        return Layout.INT8
    if tensor.name == EMBEDDING or int4_fits(rows, columns, INT4_GROUP):
        return Layout.INT4
    return Layout.INT8  # the int4 kernel does not take this shape


def _route(kind: str, layout: Layout) -> Route:
    floating = kind in FLOAT_TYPES
    if layout is Layout.FLOAT32:
        return Route.KEPT if floating else Route.DEQUANTIZED
    if layout is Layout.BF16:
        return Route.KEPT if kind == "BF16" else Route.ROUNDED
    if layout is Layout.FLOAT16:
        return Route.KEPT if kind == "F16" else Route.ROUNDED
    if layout is Layout.INT4 and kind in EXACT_INT4:
        return Route.REPACKED
    return Route.QUANTIZED if floating else Route.REQUANTIZED


def plan_tensors(layout: GGUFLayout, quantization: Quantization, half: bool = False) -> list[TensorPlan]:
    """The route of every 2-D weight of the file under `quantization` (`half`: `f16`
    means float16 weights here, not bf16)."""
    plans = []
    for tensor in layout.tensors:
        if len(tensor.dims) != 2:
            continue
        kind, target = type_name(tensor.ggml_type), _layout_for(tensor, quantization, half)
        plans.append(TensorPlan(tensor.name, kind, tensor.dims[1], tensor.dims[0] * tensor.dims[1],
                                target, _route(kind, target)))
    return plans


def summary(layout: GGUFLayout, quantization: Quantization, half: bool = False) -> str:
    """One line: how many weights of which types took which route, e.g. "12 Q4_K
    repacked into int4 (codes kept; ...); 157 requantized into int4 (132 Q5_0, 13
    Q8_0, 12 Q6_K); 145 norms and biases"."""
    groups: dict[tuple[Route, Layout], Counter[str]] = {}
    for plan in plan_tensors(layout, quantization, half):
        groups.setdefault((plan.route, plan.layout), Counter())[plan.type_name] += 1
    parts = []
    for (route, target), types in sorted(groups.items(), key=lambda item: -item[1].total()):
        if len(types) == 1:
            (kind, count), = types.items()
            text = f"{count} {kind} {route.value} {target.value}"
        else:
            listed = ", ".join(f"{n} {kind}" for kind, n in types.most_common())
            text = f"{types.total()} {route.value} {target.value} ({listed})"
        if route is Route.REPACKED:
            text += " (codes kept; scales and mins rounded to bf16)"
        parts.append(text)
    others = sum(1 for t in layout.tensors if len(t.dims) == 1)
    if others:
        parts.append(f"{others} norms and biases")
    return "; ".join(parts)


def _layout_bytes(target: Layout, rows: int, elements: int, embedding: bool, int8_row_bytes: int) -> float:
    """Bytes of a weight in our layout (quantize.py): int8 rows carry a float32 scale
    (our kernel), fbgemm's scale and zero point (16 bytes) or a bf16 scale (embeddings);
    int4 groups a bf16 scale and zero."""
    if target is Layout.FLOAT32:
        return 4.0 * elements
    if target in (Layout.BF16, Layout.FLOAT16):
        return 2.0 * elements
    if target is Layout.INT8:
        return elements + rows * (2 if embedding else int8_row_bytes)
    return elements * (0.5 + 4 / INT4_GROUP)


def loaded_bytes(layout: GGUFLayout, quantization: Quantization, dtype_bytes: int,
                 head_copy: Callable[[int, int], bool], int8_row_bytes: int = 16) -> int:
    """Bytes the loaded weights take: each weight in its layout, the 1-D tensors in the
    model's dtype, and a tied head's own copy where the plan gives it one
    (`head_copy(rows, columns)`, WeightPlan's rule)."""
    total = 0.0
    for plan in plan_tensors(layout, quantization):
        total += _layout_bytes(plan.layout, plan.rows, plan.elements, plan.name == EMBEDDING, int8_row_bytes)
        if (plan.name == EMBEDDING and head_copy(plan.rows, plan.elements // plan.rows)
                and not any(t.name == HEAD for t in layout.tensors)):
            head = plan.layout
            if head is Layout.INT4 and not int4_fits(plan.rows, plan.elements // plan.rows, INT4_GROUP):
                head = Layout.INT8
            total += _layout_bytes(head, plan.rows, plan.elements, False, int8_row_bytes)
    for tensor in layout.tensors:
        if len(tensor.dims) == 1:
            total += tensor.dims[0] * dtype_bytes
    return int(total)


def unstreamable(layout: GGUFLayout) -> str | None:
    """Why the file takes transformers' path, known from its metadata alone, or None."""
    arch = layout.metadata.get("general.architecture")
    if arch not in STREAMED_ARCHS:
        return f"architecture {arch} is not mapped here"
    if arch == "llama" and "mistral" in str(layout.metadata.get("general.name", "")).lower():
        return "transformers reads a llama-architecture file named mistral as Mistral"
    unread = next((t for t in layout.tensors if type_name(t.ggml_type) not in READABLE), None)
    if unread is not None:   # as the load finds it (gguf_load._check_tensor)
        return f"{unread.name} is {type_name(unread.ggml_type)}, a type not read here"
    return None
