"""Load-time weight quantization: the hook the loader calls after loading.

`none` and `f16` are a matter of dtype (chosen at load); on a CPU their linear
layers keep the weights in oneDNN's blocked layout (`PackedLinear`). On a CPU, `q8` and `q4k`
replace every linear layer (the LM head included) with int8 (fbgemm's dynamic
int8 GEMM) or int4 (torch's int4pack weight-only kernel) ones, and the embedding
table with an int8 (q8) or int4 (q4k) one, so the whole model shrinks; activations
stay bfloat16 between layers. On CUDA the loader asks bitsandbytes instead.
docs/design.md gives the measurements behind these choices.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch import nn

from ruvllm_cli.engine.dense_gemm import GEMM_ROWS
from ruvllm_cli.engine.int4_dense import own_linear
from ruvllm_cli.engine.kernels import int4_unpack_kernel
from ruvllm_cli.quantization import INT4_GROUP, TIED_INT4_GROUP, Quantization, int4_fits

INT4_INNER_K_TILES = 2


def _cpu_has_vnni() -> bool:
    """True where fbgemm runs AVX-512 VNNI kernels: their int8 dot products do not
    saturate. Without VNNI (AVX2's vpmaddubsw sums pairs into int16) full-range
    activations can overflow (q8's next-token KL on the test model reached 0.087 on an
    AVX2-only EPYC, 0.054 with 7 bits), so there they keep fbgemm's 7-bit default."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            return any(line.startswith("flags") and " avx512_vnni" in line for line in info)
    except OSError:
        return False


REDUCE_RANGE = not _cpu_has_vnni()


PACK_ENV = "RUVLLM_PACK_WEIGHTS"  # "0" keeps plain nn.Linear layers (for comparisons)
EXACT_ROWS = 32  # up to here (decode batches) a packed layer sees the real row count


def bucket_rows(rows: int) -> int:
    """`rows` rounded up to one of 8 sizes per power of two (at most 12.5% padding).

    oneDNN and ideep each cache a primitive per input shape, up to 1,024 per layer
    shape, at about half a MiB each here: with every prefill length a shape of its
    own, a server's RSS grew by hundreds of MiB under varied load. Bucketed, a layer
    shape sees at most 32 + 8 per doubling of the batch's tokens."""
    if rows <= EXACT_ROWS:
        return rows
    step = 1 << (rows.bit_length() - 4)
    return -(-rows // step) * step


class PackedLinear(nn.Module):
    """A bfloat16 or float32 linear layer whose weight is kept in oneDNN's blocked
    layout, reordered once at load.

    nn.Linear hands oneDNN the plain [out, in] weight on every call; packed once,
    the model's decode steps ran 1.3-1.6x faster in bfloat16 and 2.5-2.7x in
    float32 here, with identical bfloat16 outputs (scripts/bench_packed_linear.py,
    docs/design.md). The packed weight is an opaque tensor, so the module counts its
    bytes itself. (Per-request LoRA deltas, when they come, add to this forward.)"""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self._build(linear.weight.detach(), None if linear.bias is None else linear.bias.detach())

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> "PackedLinear":
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._build(weight, bias)
        return layer

    def _build(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        self.bias = None if bias is None else nn.Parameter(bias.clone(), requires_grad=False)
        self.quantized_nbytes = weight.numel() * weight.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A decode step calls this 169 times: the op's overload is called directly (the
        # packet's overload resolution cost 14 us a call here), nothing sliced unpadded.
        rows = x.reshape(-1, self.in_features)
        count = rows.shape[0]
        padded = bucket_rows(count)
        if padded != count:
            rows = torch.cat([rows, rows.new_zeros(padded - count, self.in_features)])
        out = torch.ops.mkldnn._linear_pointwise.default(rows.contiguous(), self.packed, self.bias, "none", [], "")
        if padded != count:
            out = out[:count]
        return out.view(*x.shape[:-1], self.out_features)


def cpu_has_bf16_kernels() -> bool:
    """Whether oneDNN has bfloat16 kernels for this CPU (AVX-512 or AMX). Without them a
    bfloat16 model cannot be packed, and its matmuls take a slow generic path."""
    try:
        return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (RuntimeError, AttributeError):  # a private op another torch build may lack
        return False


def packing_works(dtype: torch.dtype) -> bool:
    """Whether this torch build and CPU run PackedLinear for `dtype` (checked on a
    small layer against nn.Linear), unless RUVLLM_PACK_WEIGHTS=0 turns it off."""
    if os.environ.get(PACK_ENV, "1") == "0" or not torch.backends.mkldnn.is_available():
        return False
    try:  # private oneDNN ops: another torch build may lack or reject them
        if dtype == torch.bfloat16 and not cpu_has_bf16_kernels():
            return False
        with torch.random.fork_rng(devices=[]):  # leave the caller's random state alone
            linear = nn.Linear(64, 32, dtype=dtype)
            x = torch.randn(3, 64, dtype=dtype)
        return torch.allclose(PackedLinear(linear)(x).float(), linear(x).float(), atol=1e-2, rtol=1e-2)
    except (RuntimeError, AttributeError):
        return False


class DynamicInt8Linear(nn.Module):
    """int8 weights (per output channel) through fbgemm's dynamic-quantized GEMM.

    Activations are quantized per call, so one kernel is fast from one row (decode)
    to hundreds (prefill): measured faster than plain bf16 and than torch's
    weight-only int8 kernel at every batch size here, and level with packed bf16 at
    one row (docs/design.md).
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self._build(linear.weight.detach(), None if linear.bias is None else linear.bias.detach())

    @classmethod
    def from_weight(cls, weight: torch.Tensor | RowBlocks, bias: torch.Tensor | None) -> "DynamicInt8Linear":
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._build(weight, bias)
        return layer

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> "DynamicInt8Linear":
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._build_from_codes(codes, scales, bias)
        return layer

    def _build(self, weight: torch.Tensor | RowBlocks, bias: torch.Tensor | None) -> None:
        codes, scales = int8_rows(weight)
        self._build_from_codes(codes, scales, bias)

    def _build_from_codes(self, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        """From int8 codes [N, K] and float32 scales [N] (also the weight cache's way in)."""
        self.out_features, self.in_features = codes.shape
        scales = scales.double()
        bias = None if bias is None else bias.to(torch.float32, copy=True)  # never a view of a file
        with warnings.catch_warnings():  # torch marks quantized tensors deprecated; fbgemm needs them
            warnings.simplefilter("ignore")
            qweight = torch._make_per_channel_quantized_tensor(
                codes, scales, torch.zeros_like(scales, dtype=torch.long), 0)
            # Packed straight into fbgemm's layout: torch's dynamic Linear module would
            # pack a placeholder weight first and then this one (3 packings, not 1).
            self.packed = torch.ops.quantized.linear_prepack(qweight, bias)
        # fbgemm keeps its packed copy outside the module's tensors: count it here.
        self.quantized_nbytes = qweight.numel() + scales.numel() * 16 + (
            0 if bias is None else bias.numel() * 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()
        # Full 8-bit activation range where VNNI allows it: half the rounding error of
        # the module's default 7 bits (see _cpu_has_vnni).
        out = torch.ops.quantized.linear_dynamic(rows, self.packed, REDUCE_RANGE)
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


class Int4Linear(nn.Module):
    """Grouped asymmetric int4 weights in the CPU int4 kernel's packed layout."""

    def __init__(self, linear: nn.Linear, group_size: int = INT4_GROUP) -> None:
        super().__init__()
        self._build(linear.weight.detach(), None if linear.bias is None else linear.bias.detach(), group_size)

    @classmethod
    def from_weight(cls, weight: torch.Tensor | RowBlocks, bias: torch.Tensor | None,
                    group_size: int = INT4_GROUP) -> "Int4Linear":
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._build(weight, bias, group_size)
        return layer

    def _build(self, weight: torch.Tensor | RowBlocks, bias: torch.Tensor | None, group_size: int) -> None:
        self.out_features, self.in_features = weight.shape
        self.group_size = group_size
        n, k = weight.shape
        packed = torch.empty(n, k // 2, dtype=torch.uint8)  # filled in place: no second copy to concatenate
        scales = torch.empty(k // group_size, n, 2, dtype=torch.bfloat16)
        for start, codes, group_scales, lows in int4_chunks(weight, group_size):  # a few rows at a time
            end = start + len(codes)
            packed[start:end] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                codes.to(torch.int32), INT4_INNER_K_TILES)
            scales[:, start:end] = int4_kernel_params(group_scales, lows)
        self.register_buffer("qweight", packed)
        self.register_buffer("scales_and_zeros", scales)
        self.bias = None if bias is None else nn.Parameter(bias.to(torch.bfloat16, copy=True),
                                                           requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Called 169 times a decode step: the op's overload directly, buffers read
        # from the dict, no no-op conversion (PackedLinear.forward says why).
        rows = x.reshape(-1, self.in_features)
        if rows.dtype != torch.bfloat16:
            rows = rows.to(torch.bfloat16)
        buffers = self._buffers
        own = own_linear(rows.contiguous(), buffers["qweight"], buffers["scales_and_zeros"], self.group_size,
                         self.bias)
        if own is not None:
            return own.view(*x.shape[:-1], self.out_features)   # its bias added in C, as torch adds it below
        if rows.shape[0] >= GEMM_ROWS and (dense := self._dense(rows)) is not None:
            out = dense
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu.default(rows, buffers["qweight"], self.group_size,
                                                                     buffers["scales_and_zeros"])
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def _dense(self, rows: torch.Tensor) -> torch.Tensor | None:
        """A prompt chunk through float32 GEMM on weights unpacked a block at a time
        (engine/int4_dense.py), where torch's packed layout is one it reads and our
        int4 kernel does not run (CPUs without AVX-512). Inside the
        engine's steps (inference mode) only: elsewhere torch's kernel, the reference
        tests compare this path with."""
        from ruvllm_cli.engine.int4_dense import dense_linear, packed_layout

        layout = packed_layout(INT4_INNER_K_TILES)
        if layout is None or self.out_features % layout.block or not torch.is_inference_mode_enabled():
            return None
        return dense_linear(rows, self._buffers["qweight"], self._buffers["scales_and_zeros"], self.group_size,
                            layout).to(torch.bfloat16)


CHUNK_ROWS = 4096  # rows a streamed matrix is read at a time at most
CHUNK_VALUES = 1 << 21  # values quantized at a time: 8 MiB in float32
PACK_ROWS = 64  # torch's CPU int4 packer lays out blocks of 64 rows: chunks start on them


def chunk_rows(columns: int) -> int:
    """Rows of a [N, columns] matrix quantized at a time: about CHUNK_VALUES values, a
    multiple of PACK_ROWS (smaller chunks pack differently). The quantizers' temporaries
    (float32 rows, codes, rounding) come to some dozen bytes a value. 0.5B shape, q4k,
    streamed, two runs each: blocks of 2^22 / 2^21 / 2^20 values peaked at 667 / 648 /
    630 MiB and loaded in 4.5-4.8 / 5.2-6.2 / 7.5-8.0 s (smaller blocks, more calls)."""
    return max(PACK_ROWS, min(CHUNK_ROWS, CHUNK_VALUES // max(columns, 1)) // PACK_ROWS * PACK_ROWS)


def _row_chunks(weight: torch.Tensor | RowBlocks) -> Iterator[tuple[int, torch.Tensor]]:
    """Row blocks of [N, K]: each quantizer works row by row, so quantizing blocks
    gives the very same codes as the whole matrix, with float32 temporaries of a
    block (`chunk_rows`) instead of the matrix (545 MiB for a 151,936-row head).
    A `RowBlocks` source (the streamed loader's) reads each block from its file.
    Yields (first row, block)."""
    rows = chunk_rows(weight.shape[1])
    blocks = weight.blocks(rows) if not isinstance(weight, torch.Tensor) else weight.split(rows)
    start = 0
    for block in blocks:
        yield start, block
        start += block.shape[0]


class RowBlocks(Protocol):
    """A [N, K] matrix handed over a block of rows at a time. A source may also offer
    `int4_groups(rows, group)`: its own 4-bit codes, scales and lows per group (a GGUF
    file's Q4_K blocks), or None where it has none of that group size (`int4_chunks`)."""

    shape: tuple[int, int]

    def blocks(self, rows: int) -> Iterator[torch.Tensor]: ...


Int4Chunk = tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]


def int4_chunks(weight: torch.Tensor | RowBlocks, group_size: int) -> Iterator[Int4Chunk]:
    """(first row, codes 0..15 [r, K], scales [r, K/g], lows [r, K/g]) a block of rows
    at a time, w = code * scale + low: the source's own groups where it has them (kept
    as they are), else quantized from its float rows."""
    own = getattr(weight, "int4_groups", None)
    groups = own(chunk_rows(weight.shape[1]), group_size) if own is not None else None
    if groups is None:
        groups = (int4_groups(rows.float(), group_size) for _, rows in _row_chunks(weight))
    start = 0
    for codes, scales, lows in groups:
        rows = len(codes)
        yield start, codes, scales.reshape(rows, -1), lows.reshape(rows, -1)
        start += rows


def int8_rows(weight: torch.Tensor | RowBlocks) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes [N, K] and float32 scales [N] of a float matrix, a block
    of rows at a time."""
    codes = torch.empty(weight.shape, dtype=torch.int8)
    scales = torch.empty(weight.shape[0])
    for start, rows in _row_chunks(weight):
        rows = rows.float()
        block_scales = absmax_scales(rows)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            codes[start:start + len(rows)] = torch.quantize_per_channel(
                rows, block_scales.double(), torch.zeros_like(block_scales, dtype=torch.long),
                axis=0, dtype=torch.qint8).int_repr()
        scales[start:start + len(rows)] = block_scales
    return codes, scales


def absmax_scales(weight: torch.Tensor) -> torch.Tensor:
    """Symmetric int8 scale per row of [N, K]: w ≈ round(w / scale) * scale."""
    low, high = torch.aminmax(weight, dim=1)  # no |w| temporary of the whole matrix
    return torch.maximum(-low, high).clamp(min=1e-8) / 127.0


FIT_ROUNDS = 4  # least-squares refits of each int4 group's scale and low (docs/design.md, section 4b)


def int4_groups(weight: torch.Tensor, group_size: int,
                rounds: int = FIT_ROUNDS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit codes per group of `group_size` along each row of [N, K]:
    (codes 0..15 [N, K] as int32, scales [N, K/g, 1], lows [N, K/g, 1]);
    w ≈ code * scale + low.

    The codes start from the group's min and max; then, `rounds` times, the scale and
    low are fitted to the codes by least squares and the codes taken again from that
    fit, each group keeping whichever fit left the smallest squared error (never one
    worse than min/max). A min/max grid spends its two end points on the extremes;
    the fit trades them for the bulk of the group, as llama.cpp's Q4_K search does:
    the RMS error of a 0.5B-shape layer's weights fell from 0.090 to 0.084 of theirs in
    groups of 64, from 0.078 to 0.073 in groups of 32 (Q4_K's, from llama-quantize:
    0.071). In groups of 128 it could give up an outlier by more than a step."""
    n, k = weight.shape
    kernel = int4_unpack_kernel() if rounds and group_size <= 256 and k % group_size == 0 else None
    if kernel is not None:   # the same steps in C (int4_unpack.c), in one pass over each group
        x = weight.to(torch.float32).contiguous()
        codes = torch.empty(n, k, dtype=torch.int32)
        scale, low = (torch.empty(n, k // group_size, 1) for _ in range(2))
        kernel.fit(x.data_ptr(), n, k, group_size, rounds, codes.data_ptr(), scale.data_ptr(), low.data_ptr(),
                   torch.get_num_threads())
        return codes, scale, low
    x = weight.reshape(n, k // group_size, group_size)
    low, high = torch.aminmax(x, dim=-1, keepdim=True)
    scale = (high - low).clamp_(min=1e-8).div_(15.0)
    codes = (x - low).div_(scale).round_().clamp_(0, 15)
    if rounds:
        scale, low, codes = _fitted(x, codes, scale, low, rounds)
    return codes.to(torch.int32).reshape(n, k), scale, low


def _fitted(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor,
            rounds: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int4_groups' refits. Per group sums in float32 over the group's few weights, the
    fit and its error from them in float64 (one [N, K/g] value each: the error is a
    difference of sums close to each other)."""
    g = float(x.shape[-1])

    def sums(q: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (q.sum(-1, keepdim=True).double(), (q * q).sum(-1, keepdim=True).double(),
                (q * x).sum(-1, keepdim=True).double())

    def error(a: torch.Tensor, b: torch.Tensor, sq: torch.Tensor, sqq: torch.Tensor, sqx: torch.Tensor) -> torch.Tensor:
        # sum over the group of (a q + b - x)^2, expanded
        return a * a * sqq + 2 * a * b * sq - 2 * a * sqx + g * b * b - 2 * b * sx + sxx

    sx, sxx = x.sum(-1, keepdim=True).double(), (x * x).sum(-1, keepdim=True).double()
    a, b = scale.double(), low.double()
    sq, sqq, sqx = sums(codes)
    best = error(a, b, sq, sqq, sqx)
    for _ in range(rounds):
        det = g * sqq - sq * sq   # 0 where every code is the same: nothing to fit
        fit_a = (g * sqx - sq * sx) / det.clamp(min=1e-30)
        usable = (det > 0) & (fit_a > 0)
        fit_a = torch.where(usable, fit_a, a)
        fit_b = torch.where(usable, (sx - fit_a * sq) / g, b)
        # the fit itself, on the codes it was fitted to
        better = usable & (error(fit_a, fit_b, sq, sqq, sqx) < best)
        a, b = torch.where(better, fit_a, a), torch.where(better, fit_b, b)
        best = error(a, b, sq, sqq, sqx)
        # then the codes nearest to it, kept where they do better still
        again = (x - b.float()).div_(a.float()).round_().clamp_(0, 15)
        new = sums(again)
        improved = error(a, b, *new) < best
        if not bool(improved.any()):
            break
        codes = torch.where(improved, again, codes)
        sq, sqq, sqx = (torch.where(improved, fresh, old) for fresh, old in zip(new, (sq, sqq, sqx)))
        best = torch.where(improved, error(a, b, sq, sqq, sqx), best)
    return a.float(), b.float(), codes


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (int32 codes 0..15 [N, K], bf16 scales+zeros [K/g, N, 2]);
    w ≈ (q - 8) * scale + zero, the int4 kernel's convention."""
    q, scales, low = int4_groups(weight, group_size)
    return q, int4_kernel_params(scales, low)


def int4_kernel_params(scales: torch.Tensor, lows: torch.Tensor) -> torch.Tensor:
    """Scales and lows per group ([N, K/g] float32) as the int4 kernel's bf16 scales
    and zeros [K/g, N, 2], for w = (q - 8) * scale + zero."""
    n = scales.shape[0]
    scales, zeros = scales.reshape(n, -1, 1), (lows + scales * 8).reshape(n, -1, 1)
    return torch.cat([scales, zeros], dim=2).transpose(0, 1).contiguous().to(torch.bfloat16)


def set_input_embeddings(model: Any, replacement: nn.Module) -> None:
    """Put `replacement` in place of the model's embedding, keeping the factor that
    embedding multiplies its rows by: Gemma's (1, 2, 3) scale the looked-up rows by
    sqrt(hidden size), inside the embedding module our tables replace."""
    scale = embedding_scale(model)
    if scale is not None:
        replacement.row_scale = scale
        replacement.register_forward_hook(_scale_rows)
    model.set_input_embeddings(replacement)


def embedding_scale(model: Any) -> float | None:
    """The factor the model's stock embedding module multiplies its rows by (None: 1),
    in the checkpoint's dtype as the module rounds it (`embed_scale.to(weight.dtype)`):
    the same figure whichever dtype a load builds the skeleton in."""
    module = model.get_input_embeddings()
    if getattr(module, "row_scale", None) is not None:
        return module.row_scale   # kept (and rounded) when this one was put in place
    scale = getattr(module, "scalar_embed_scale", None)
    if scale is None:
        buffer = getattr(module, "embed_scale", None)
        if not isinstance(buffer, torch.Tensor) or buffer.numel() != 1 or buffer.is_meta:
            return None
        scale = float(buffer)
    dtype = getattr(model.config, "dtype", None) or getattr(model.config, "torch_dtype", None)
    dtype = dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32
    scale = float(torch.tensor(float(scale), dtype=torch.float32).to(dtype))
    return None if scale == 1.0 else scale


def _scale_rows(module: nn.Module, _: Any, rows: torch.Tensor) -> torch.Tensor:
    return rows * module.row_scale


class Int8Embedding(nn.Module):
    """An embedding table stored as int8 rows with one scale per row."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self._build(embedding.weight.detach(), embedding.padding_idx)

    @classmethod
    def from_weight(cls, weight: torch.Tensor | RowBlocks, padding_idx: int | None,
                    dtype: torch.dtype = torch.bfloat16) -> "Int8Embedding":
        """`dtype`: the activations', which the scales (and so the rows) take."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._build(weight, padding_idx, dtype)
        return layer

    def _build(self, weight: torch.Tensor | RowBlocks, padding_idx: int | None,
               dtype: torch.dtype = torch.bfloat16) -> None:
        codes = torch.empty(weight.shape, dtype=torch.int8)
        scales = torch.empty(weight.shape[0], dtype=dtype)
        for start, rows in _row_chunks(weight):
            rows = rows.float()
            block_scales = absmax_scales(rows)
            codes[start:start + len(rows)] = (rows / block_scales[:, None]).round().clamp(-128, 127)
            scales[start:start + len(rows)] = block_scales
        self.register_buffer("qweight", codes)
        self.register_buffer("scales", scales)
        self.num_embeddings, self.embedding_dim = weight.shape
        self.padding_idx = padding_idx

    @classmethod
    def sharing(cls, head: nn.Module, padding_idx: int | None) -> "Int8Embedding":
        """The lookup table of a tied head's own int8 codes and float32 scales (an
        `int8.Int8Linear`): one copy of the vocabulary matrix serves both."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.register_buffer("qweight", head.qweight)
        layer.register_buffer("scales", head.scales)
        layer.num_embeddings, layer.embedding_dim = head.qweight.shape
        layer.padding_idx = padding_idx
        return layer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # Rows come out in the scales' dtype: the activations' (float32 where our int8
        # kernel runs, and for a table shared with its int8 head; else bfloat16).
        return self.qweight[ids].to(self.scales.dtype) * self.scales[ids].unsqueeze(-1)


class Int4Embedding(nn.Module):
    """An embedding table stored as 4-bit codes (two per byte) with a scale and zero
    per group of 32 values; rows are dequantized as they are looked up."""

    def __init__(self, embedding: nn.Embedding, group_size: int = 32) -> None:
        super().__init__()
        self._build(embedding.weight.detach(), embedding.padding_idx, group_size)

    @classmethod
    def from_weight(cls, weight: torch.Tensor | RowBlocks, padding_idx: int | None, group_size: int = 32) -> "Int4Embedding":
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._build(weight, padding_idx, group_size)
        return layer

    def _build(self, weight: torch.Tensor | RowBlocks, padding_idx: int | None, group_size: int) -> None:
        self.num_embeddings, self.embedding_dim = weight.shape
        self.group_size = group_size if self.embedding_dim % group_size == 0 else self.embedding_dim
        groups = self.embedding_dim // self.group_size
        packed = torch.empty(self.num_embeddings, self.embedding_dim // 2, dtype=torch.uint8)
        scales = torch.empty(self.num_embeddings, groups, dtype=torch.bfloat16)
        lows = torch.empty(self.num_embeddings, groups, dtype=torch.bfloat16)
        for start, codes, block_scales, low in int4_chunks(weight, self.group_size):
            codes = codes.to(torch.uint8)
            end = start + len(codes)
            packed[start:end] = codes[:, 0::2] | (codes[:, 1::2] << 4)
            scales[start:end] = block_scales
            lows[start:end] = low
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)
        self.register_buffer("lows", lows)
        self.padding_idx = padding_idx

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        kernel = int4_unpack_kernel() if ids.device.type == "cpu" and self.embedding_dim % 2 == 0 else None
        if kernel is not None:   # the same bits in one call (a decode step's single id: 35 -> 15 us)
            flat = ids.reshape(-1).to(torch.int64).contiguous()
            out = torch.empty(flat.numel(), self.embedding_dim, dtype=torch.bfloat16)
            kernel.embedding(self.packed.data_ptr(), self.scales.data_ptr(), self.lows.data_ptr(), flat.data_ptr(),
                             flat.numel(), self.embedding_dim, self.group_size, out.data_ptr())
            return out.view(*ids.shape, self.embedding_dim)
        packed = self.packed[ids]
        codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)
        groups = codes.reshape(*ids.shape, -1, self.group_size).to(torch.bfloat16)
        rows = groups * self.scales[ids].unsqueeze(-1) + self.lows[ids].unsqueeze(-1)
        return rows.flatten(-2)


class Int4TiedEmbedding(nn.Module):
    """The lookup table of a tied q4k head: rows read out of the head's own packed int4
    weights (an `Int4Linear`, torch's layout as engine/int4_dense.py reads it), so the
    vocabulary matrix is held once, as q8's tied head and table share their codes."""

    @classmethod
    def sharing(cls, head: Int4Linear, padding_idx: int | None) -> "Int4TiedEmbedding":
        from ruvllm_cli.engine.int4_dense import packed_layout

        layout = packed_layout(INT4_INNER_K_TILES)
        if layout is None or head.out_features % layout.block:
            raise ValueError("torch's packed int4 layout is not one ruvllm reads on this machine")
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.register_buffer("qweight", head.qweight)
        layer.register_buffer("scales_and_zeros", head.scales_and_zeros)
        layer.num_embeddings, layer.embedding_dim = head.out_features, head.in_features
        layer.group_size, layer.padding_idx, layer.layout = head.group_size, padding_idx, layout
        return layer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        from ruvllm_cli.engine.int4_dense import packed_rows

        flat = ids.reshape(-1).to(torch.int64).contiguous()
        rows = packed_rows(self.qweight, self.scales_and_zeros, self.group_size, flat, self.layout)
        return rows.view(*ids.shape, self.embedding_dim)


def kernel_note(model: nn.Module) -> str:
    """Which kernels a model's float16, int4 and int8 layers run on this machine, for the load
    line: a property of the machine, not of the weights, so not part of the description
    a weight cache keeps (the kernels read the cached bytes as they are; q4k's bytes
    follow torch's packing, which the cache's key holds)."""
    from ruvllm_cli.engine.half import HalfLinear
    from ruvllm_cli.engine.int4_dense import own_kernel
    from ruvllm_cli.engine.int8 import Int8Linear
    from ruvllm_cli.engine.kernels import half_kernel, int8_kernel

    kinds = {type(module) for module in model.modules()}
    note = ""
    if HalfLinear in kinds and (half := half_kernel()) is not None:
        note += f"; the float16 kernel in its {'AVX-512' if half.wide else 'AVX2'} form"
    if Int4Linear in kinds:
        int4 = own_kernel()
        which = ("torch's int4pack kernel" if int4 is None else "ruvllm's AVX-512 kernel" if int4.block == 64
                 else "ruvllm's AVX2 kernel (int8 activations)")
        note += f"; int4 layers in {which}"
    if Int8Linear in kinds and (kernel := int8_kernel()) is not None:
        note += ("; up to 32 rows in its AVX-512 VNNI GEMV and GEMM" if kernel.wide
                 else "; every row count in its AVX2 GEMV, 32 rows a pass")
    return note


def int4_group_size(hidden_size: int) -> int:
    """INT4_GROUP where it divides the model's hidden size, else 32."""
    return INT4_GROUP if hidden_size % INT4_GROUP == 0 else 32


class WeightPlan:
    """What each linear and embedding weight becomes for a quantization on a CPU:
    the one rule both the in-place pass (`quantize_model`) and the streamed loader
    (`stream_load`) follow, so they build the same layers from the same tensors.

    `linear`/`embedding` return the replacement module, or None where the plain one
    stays (unpacked 16/32-bit weights, and the embedding outside q8/q4k)."""

    def __init__(self, quantization: Quantization, dtype: torch.dtype, hidden_size: int,
                 int4_group: int | None = None) -> None:
        """`int4_group` overrides q4k's group size (a GGUF file's own: 32)."""
        self.quantization, self.dtype = quantization, dtype
        self.quantized = quantization in (Quantization.Q8_0, Quantization.Q4_K_M)
        # f16 with float32 activations: float16 weights in our own kernel (engine/half.py),
        # which the loader picks only where it runs (dtype_for).
        self.half = quantization is Quantization.F16 and dtype == torch.float32
        self.packed = not self.quantized and not self.half and packing_works(dtype)
        # bfloat16 weights in our own kernel (engine/bf16.py) where it runs; oneDNN's
        # packed layer for the widths it cannot take.
        self.own_bf16 = self.packed and dtype == torch.bfloat16 and bf16_weights_here()
        # q8 in our own int8 kernel (engine/int8.py) where it runs, else fbgemm's.
        self.own_int8 = quantization is Quantization.Q8_0 and int8_weights_here()
        self._last_half: tuple[torch.Tensor, torch.Tensor | None] | None = None
        # Our int8 or bfloat16 layer built last, with its source: a tied head, built just
        # before the embedding, lends it its table.
        self._last_linear: tuple[object, nn.Module] | None = None
        self.shared_table = False   # the embedding reads the tied head's table
        self.group = None
        if quantization is Quantization.Q4_K_M:
            self.group = int4_group or int4_group_size(hidden_size)
        self.linears = 0

    @property
    def unties_head(self) -> bool:
        """A tied LM head gets its own packed or quantized copy (the embedding lookup
        keeps its own table): the vocabulary matrix is held twice, for the fastest
        head at every batch size (docs/design.md)."""
        return self.quantized or self.packed or self.half

    def head_copy(self, rows: int, columns: int) -> bool:
        """Whether a tied head of [rows, columns] holds a copy of the vocabulary matrix of
        its own: not float16 (one table), nor q8 or bfloat16 in our kernels, nor q4k where
        torch's packed layout is one we read (the lookups read the head's codes or
        weights)."""
        return (self.unties_head and not self.half and not self.own_int8 and not self.own_bf16
                and self.tied_int4_group(rows, columns) is None)

    def tied_int4_group(self, rows: int, columns: int) -> int | None:
        """The group a tied q4k head takes when the embedding reads its packed table: the
        embedding's own (32), so the table keeps the precision a separate one had; None
        where the head keeps a copy of its own (no layout we read, odd shapes)."""
        if self.group is None or columns % TIED_INT4_GROUP or not int4_fits(rows, columns, TIED_INT4_GROUP):
            return None
        from ruvllm_cli.engine.int4_dense import packed_layout

        layout = packed_layout(INT4_INNER_K_TILES)
        return None if layout is None or rows % layout.block else TIED_INT4_GROUP

    def tied_head(self, weight: torch.Tensor | RowBlocks) -> nn.Module | None:
        """A tied head's layer, built just before the embedding that may share it."""
        group = self.tied_int4_group(*weight.shape)
        if group is None:
            return self.linear(weight, None)
        self.linears += 1
        layer = Int4Linear.from_weight(weight, None, group)
        self._last_linear = (weight, layer)
        return layer

    def read_dtype(self, dtype: torch.dtype) -> torch.dtype | None:
        """The dtype to read a weight matrix in; None: as stored (the half path converts
        once, from the file's own values, and sees any value float16 cannot hold)."""
        return None if self.half else dtype

    def linear(self, weight: torch.Tensor | RowBlocks, bias: torch.Tensor | None) -> nn.Module | None:
        if self.half:
            return self._half_linear(_whole(weight), bias)
        if not (self.quantized or self.packed):
            return None
        self.linears += 1
        if self.own_bf16:
            layer = self._bf16_linear(_whole(weight), bias)
            if layer is not None:
                return layer
        if self.packed:
            return PackedLinear.from_weight(_whole(weight), bias)
        out_features, in_features = weight.shape
        if self.group is not None and int4_fits(out_features, in_features, self.group):
            return Int4Linear.from_weight(weight, bias, self.group)
        return self._int8_linear(weight, bias)  # q8, and odd shapes under q4k

    def _int8_linear(self, weight: torch.Tensor | RowBlocks, bias: torch.Tensor | None) -> nn.Module:
        """Our kernel's layer where it takes the shape, else fbgemm's, from the same codes.
        The last one built is remembered: a tied head's embedding shares its table."""
        from ruvllm_cli.engine.int8 import int8_linear

        codes, scales = int8_rows(weight)
        layer = int8_linear(codes, scales, bias)
        if layer is None:   # no kernel here, or a width it cannot take
            return DynamicInt8Linear.from_codes(codes, scales, bias)
        self._last_linear = (weight, layer)
        return layer

    def _bf16_linear(self, weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module | None:
        """Our kernel's layer over a copy of `weight` in process memory (a streamed
        source is a view of the file). Remembered: a tied embedding shares it."""
        from ruvllm_cli.engine.bf16 import bf16_linear

        layer = bf16_linear(weight.to(torch.bfloat16, copy=True), bias)
        if layer is not None:
            self._last_linear = (weight, layer)
        return layer

    def _tied_head(self, weight: torch.Tensor | RowBlocks) -> nn.Module | None:
        """The int8 or bfloat16 layer just built from this very matrix, if any."""
        last = self._last_linear
        return last[1] if last is not None and _same_matrix(last[0], weight) else None

    def embedding(self, weight: torch.Tensor | RowBlocks, padding_idx: int | None) -> nn.Module | None:
        if self.half:
            from ruvllm_cli.engine.half import HalfEmbedding

            whole = _whole(weight)
            table = self._half_copy(whole)
            return None if table is None else HalfEmbedding(table, whole.shape[0], padding_idx)
        head = self._tied_head(weight)
        if head is not None and self.own_bf16:
            self.shared_table = True
            table = head.weight
            return nn.Embedding(table.shape[0], table.shape[1], padding_idx, _weight=table, _freeze=True)
        if self.quantization is Quantization.Q8_0:
            if head is not None:
                self.shared_table = True
                return Int8Embedding.sharing(head, padding_idx)
            return Int8Embedding.from_weight(weight, padding_idx, self.dtype)
        if self.quantization is Quantization.Q4_K_M:
            if isinstance(head, Int4Linear):
                self.shared_table = True
                return Int4TiedEmbedding.sharing(head, padding_idx)
            return Int4Embedding.from_weight(weight, padding_idx)
        return None

    def _half_linear(self, weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module | None:
        from ruvllm_cli.engine.half import HalfLinear
        from ruvllm_cli.engine.kernels import half_kernel

        kernel = half_kernel()
        blocks = None if kernel is None else self._half_copy(weight)
        if blocks is None:
            return None
        self.linears += 1
        return HalfLinear(blocks, weight.shape[0], None if bias is None else bias.float(), kernel)

    def _half_copy(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The float16 copy of `weight` in the kernel's blocks (half.to_blocks), made once:
        a tied head and the embedding it shares a matrix with take the same copy (asked
        one after the other)."""
        from ruvllm_cli.engine.half import to_blocks

        # The source is held until the next call, so no other tensor can take its address.
        last = self._last_half
        if last is None or last[0].data_ptr() != weight.data_ptr() or last[0].shape != weight.shape:
            self._last_half = last = (weight, to_blocks(weight))
        return last[1]

    def describe(self) -> str:
        if self.half:
            return (f"float16 weights with float32 arithmetic (ruvllm's kernel), {self.linears} linear "
                    "layers incl. LM head; float16 embeddings")
        if self.own_int8:
            shared = " sharing the tied LM head's table" if self.shared_table else ""
            return (f"int8 per-channel weights in ruvllm's kernel, {self.linears} linear layers "
                    f"incl. LM head; int8 embeddings{shared}")
        if self.quantization is Quantization.Q8_0:
            return (f"int8 per-channel weights, fbgemm dynamic int8 GEMM, {self.linears} linear layers "
                    "incl. LM head; int8 embeddings")
        if self.quantization is Quantization.Q4_K_M:
            shared = f" read from the tied LM head's table (group {TIED_INT4_GROUP})" if self.shared_table else ""
            return (f"int4 weight-only, group {self.group} (torch's int4pack layout), {self.linears} linear "
                    f"layers incl. LM head; int4 embeddings{shared}")
        path = f"{str(self.dtype).replace('torch.', '')} weights, no quantization"
        if self.own_bf16:
            shared = "; the tied LM head shares the embedding's table" if self.shared_table else ""
            return path + f", {self.linears} linear layers incl. LM head in ruvllm's AVX-512 BF16 kernel{shared}"
        if self.packed:
            path += f", {self.linears} linear layers incl. LM head in oneDNN's packed layout"
        return path


def int8_weights_here() -> bool:
    """Whether q8 on this CPU runs our own int8 kernel (AVX2 and a C compiler), and so
    float32 activations (docs/design.md, section 20)."""
    from ruvllm_cli.engine.kernels import int8_kernel

    return int8_kernel() is not None


def bf16_weights_here() -> bool:
    """Whether bfloat16 weights on this CPU run our own kernel (AVX-512 BF16 and a C
    compiler; docs/design.md, section 22)."""
    from ruvllm_cli.engine.kernels import bf16_kernel

    return bf16_kernel() is not None


def _same_matrix(a: torch.Tensor | RowBlocks, b: torch.Tensor | RowBlocks) -> bool:
    """Whether two weight sources are one matrix: the same object (a streamed file's
    rows), or tensors over the same memory (a tied parameter, detached twice)."""
    if a is b:
        return True
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.data_ptr() == b.data_ptr()
            and a.shape == b.shape and a.dtype == b.dtype)


def _whole(weight: torch.Tensor | RowBlocks) -> torch.Tensor:
    return weight if isinstance(weight, torch.Tensor) else torch.cat(list(weight.blocks(CHUNK_ROWS)))


def _replace_linears(module: nn.Module, plan: WeightPlan, skip: nn.Module | None = None) -> None:
    for name, child in list(module.named_children()):
        if child is skip:
            continue
        if isinstance(child, nn.Linear):
            bias = None if child.bias is None else _widened(child.bias, plan.dtype)
            replacement = plan.linear(_widened(child.weight, plan.read_dtype(plan.dtype)), bias)
            if replacement is not None:
                setattr(module, name, replacement)
        else:
            _replace_linears(child, plan, skip)


def _widened(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """`tensor` as the plan reads it: in `dtype` (None: as it is)."""
    tensor = tensor.detach()
    return tensor if dtype is None or tensor.dtype == dtype else tensor.to(dtype)


@torch.no_grad()
def quantize_model(model: nn.Module, quantization: Quantization, device: torch.device,
                   dtype: torch.dtype | None = None) -> str:
    """Quantize `model` in place (CPU paths); returns a one-line description of the path.

    `dtype` is the activations' (default: the model's). A model built in a narrower
    dtype (loader._build_dtype) has each weight widened as it is replaced, and what no
    plan replaces (norms, biases kept as they are) widened after."""
    if device.type != "cpu" and quantization in (Quantization.Q8_0, Quantization.Q4_K_M):
        return "bitsandbytes " + ("8-bit" if quantization is Quantization.Q8_0 else "4-bit NF4")
    built = next(model.parameters()).dtype
    dtype = dtype or built
    if device.type != "cpu":
        return f"{str(dtype).replace('torch.', '')} weights, no quantization"
    plan = WeightPlan(quantization, dtype, model.config.hidden_size)
    embeddings, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and head.weight is embeddings.weight and plan.unties_head
    if plan.unties_head:
        model.config.tie_word_embeddings = False
    _replace_linears(model, plan, skip=head if tied else None)
    # Widened once: a tied head and its embedding must see the same tensor to share a table.
    table = _widened(embeddings.weight, plan.read_dtype(dtype))
    if tied:   # built last, as the streamed loader builds it: the embedding may share it
        replacement = plan.tied_head(table) if head.bias is None else \
            plan.linear(table, _widened(head.bias, dtype))
        if replacement is not None:
            model.set_output_embeddings(replacement)
    replacement = plan.embedding(table, embeddings.padding_idx)
    if replacement is not None:
        set_input_embeddings(model, replacement)
    if built != dtype:
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.dtype == built:
                tensor.data = tensor.data.to(dtype)
    return plan.describe()
