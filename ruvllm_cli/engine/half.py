"""float16 weights with float32 arithmetic, for CPUs without AVX-512 BF16.

On such a CPU (every AVX2-only x86-64, most laptops among them) oneDNN cannot pack
bfloat16, so a 16-bit model ran float32: twice the memory and a quarter of the speed
of llama.cpp's F16; on AVX-512 CPUs without BF16 its bfloat16 is emulated (0.7x of
this path's decode). Here the weights stay float16 (a bfloat16 checkpoint converts
exactly, its 7-bit mantissa fitting in float16's 10, except for values below
float16's normal range) and `kernels.half_kernel()` widens them in registers, so
every sum is float32 as in `-q none`; prompt chunks of GEMM_ROWS rows and more run
MKL's float32 GEMM on the weights widened a block at a time (docs/design.md, sections
5a and 19).
"""

from __future__ import annotations

import threading

import torch
from torch import nn
from torch.nn import functional as F

from ruvllm_cli.engine.kernels import HalfKernel, half_kernel

_scratch = threading.local()   # engines of a multi-model server step in threads of their own
# Rows from which a call takes dense_gemm's blockwise GEMM (MKL's float32 GEMM on the
# weights widened a block at a time): the kernel took 0.76-0.79x its time at 16 rows,
# 0.99-1.19x at 32, 1.14x at 48, 1.30x at 64, 2.6x at 512 (docs/design.md, section 19).
GEMM_ROWS = 48


def scratch_buffer(size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-thread room for a kernel's temporaries (widened weight blocks, quantized
    activations), one buffer per dtype, grown as needed."""
    key = f"buffer_{dtype}"
    buffer = getattr(_scratch, key, None)
    if buffer is None or buffer.numel() < size:
        buffer = torch.empty(size, dtype=dtype)
        setattr(_scratch, key, buffer)
    return buffer


def kernel_rows(x: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    """x as the contiguous [rows, width] matrix of `dtype` our linear kernels read, with
    no conversion or copy where it already is one (a decode step asks 169 times)."""
    rows = x.reshape(-1, width)
    if rows.dtype != dtype or not rows.is_contiguous():
        rows = rows.to(dtype).contiguous()
    return rows


def to_half(weight: torch.Tensor) -> torch.Tensor | None:
    """A float16 copy of `weight` in process memory, or None where float16 cannot hold
    it (values beyond its range would become infinities)."""
    copy = weight.to(torch.float16, copy=True).contiguous()
    if bool(torch.isinf(copy).any()) and not bool(torch.isinf(weight).any()):
        return None
    return copy


def scratch_floats(rows: int, width: int, threads: int) -> int:
    """The room `ruvllm_f16_linear` works in: a widened block of weights a thread, none
    for one row."""
    return threads * 4 * width if rows > 1 else 0


class HalfLinear(nn.Module):
    """A linear layer whose [out, in] weight is float16 and whose inputs, outputs and
    bias are float32; the product runs in ruvllm's C kernel."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernel: HalfKernel) -> None:
        super().__init__()
        assert weight.dtype == torch.float16 and weight.is_contiguous()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight16", weight)
        self.bias = None if bias is None else nn.Parameter(bias.float().clone(), requires_grad=False)
        self._kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A decode step calls this 169 times: plain attribute reads, no no-op conversions
        # (60 -> 52 us a call for a small layer here; docs/design.md, section 20).
        rows = kernel_rows(x, self.in_features, torch.float32)
        count = rows.shape[0]
        if count >= GEMM_ROWS:
            return self._gemm(rows).view(*x.shape[:-1], self.out_features)
        out = torch.empty(count, self.out_features, dtype=torch.float32)
        threads = torch.get_num_threads()
        room = scratch_floats(count, self.in_features, threads)
        scratch = scratch_buffer(room).data_ptr() if room else None   # one row: the kernel takes none
        self._kernel.linear(rows.data_ptr(), count, self.in_features, self._buffers["weight16"].data_ptr(),
                            self.out_features, None if self.bias is None else self.bias.data_ptr(),
                            out.data_ptr(), scratch, threads)
        return out.view(*x.shape[:-1], self.out_features)

    def _gemm(self, rows: torch.Tensor) -> torch.Tensor:
        """Many rows (prompt chunks): float32 GEMM over the weights widened a block of
        rows at a time."""
        from ruvllm_cli.engine.dense_gemm import plain_weight_gemm   # it imports this module

        return plain_weight_gemm(rows, self._buffers["weight16"], self.bias)


class HalfEmbedding(nn.Module):
    """An embedding table kept in float16; looked-up rows come out float32."""

    def __init__(self, weight: torch.Tensor, padding_idx: int | None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.shape
        self.padding_idx = padding_idx
        self.register_buffer("weight16", weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight16).float()


def half_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> HalfLinear | None:
    """A HalfLinear for `weight` (any float dtype), or None where the kernel cannot take
    it: no kernel here, an input width not a multiple of 8, or values float16 cannot hold."""
    kernel = half_kernel()
    if kernel is None or weight.shape[1] % 8:
        return None
    half = weight if weight.dtype == torch.float16 else to_half(weight)
    return None if half is None else HalfLinear(half, bias, kernel)
