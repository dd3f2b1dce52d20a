"""float16 weights with float32 arithmetic, for CPUs without AVX-512 BF16.

On such a CPU (every AVX2-only x86-64, most laptops among them) oneDNN cannot pack
bfloat16, so a 16-bit model ran float32: twice the memory and a quarter of the speed
of llama.cpp's F16; on AVX-512 CPUs without BF16 its bfloat16 is emulated (0.7x of
this path's decode). Here the weights stay float16 (a bfloat16 checkpoint converts
exactly, its 7-bit mantissa fitting in float16's 10, except for values below
float16's normal range) and `kernels.half_kernel()` widens them in registers, so
every sum is float32 as in `-q none`. They are stored in blocks of BLOCK output rows,
k-major (`to_blocks`), which the kernel reads as a register-blocked GEMM for any
number of rows, one decode row to a whole prompt chunk (docs/design.md, section 19).
"""

from __future__ import annotations

import threading

import torch
from torch import nn

from ruvllm_cli.engine.kernels import HalfKernel, half_kernel

_scratch = threading.local()   # engines of a multi-model server step in threads of their own
BLOCK = 32   # output rows a block of the kernel's layout (half_gemm.c's BLOCK)
CHUNK_ROWS = 1024   # rows converted at a time into that layout (a 7B down_proj's: 37 MiB)


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


def _overflows(half: torch.Tensor, source: torch.Tensor) -> bool:
    """Whether float16 made infinities of values `source` holds as finite ones."""
    return bool(torch.isinf(half).any()) and not bool(torch.isinf(source).any())


def to_blocks(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` [N, K] (any float dtype) as float16 in the kernel's layout, or None where
    float16 cannot hold it: [ceil(N / BLOCK), K, BLOCK], block b's [k, j] holding
    weight[BLOCK * b + j, k], rows past N zeros. Converted CHUNK_ROWS rows at a time, so
    no second whole copy exists on the way."""
    n, k = weight.shape
    count = -(-n // BLOCK)
    blocks = torch.empty(count, k, BLOCK, dtype=torch.float16)
    for first in range(0, count, CHUNK_ROWS // BLOCK):
        last = min(count, first + CHUNK_ROWS // BLOCK)
        rows = weight[first * BLOCK:min(n, last * BLOCK)]
        half = rows.to(torch.float16)
        if _overflows(half, rows):
            return None
        if half.shape[0] < (last - first) * BLOCK:   # the last block's padding
            half = torch.cat([half, half.new_zeros((last - first) * BLOCK - half.shape[0], k)])
        blocks[first:last] = half.view(last - first, BLOCK, k).transpose(1, 2)
    return blocks


def block_rows(blocks: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the [N, K] weight that `blocks` (to_blocks' layout) holds: [*ids.shape, K]."""
    flat = ids.reshape(-1)
    return blocks[flat // BLOCK, :, flat % BLOCK].view(*ids.shape, blocks.shape[1])


class HalfLinear(nn.Module):
    """A linear layer whose weight is float16 in the kernel's blocks (`to_blocks`) and
    whose inputs, outputs and bias are float32; every call runs ruvllm's C kernel."""

    def __init__(self, blocks: torch.Tensor, out_features: int, bias: torch.Tensor | None,
                 kernel: HalfKernel) -> None:
        super().__init__()
        assert blocks.dtype == torch.float16 and blocks.is_contiguous() and blocks.shape[2] == BLOCK
        assert blocks.shape[0] == -(-out_features // BLOCK)
        self.out_features, self.in_features = out_features, blocks.shape[1]
        self.register_buffer("blocks16", blocks)
        self.bias = None if bias is None else nn.Parameter(bias.float().clone(), requires_grad=False)
        self._kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A decode step calls this 169 times: plain attribute reads, no no-op conversions
        # (60 -> 52 us a call for a small layer here; docs/design.md, section 20).
        rows = kernel_rows(x, self.in_features, torch.float32)
        count = rows.shape[0]
        out = torch.empty(count, self.out_features, dtype=torch.float32)
        self._kernel.linear(rows.data_ptr(), count, self.in_features, self._buffers["blocks16"].data_ptr(),
                            self.out_features, None if self.bias is None else self.bias.data_ptr(),
                            out.data_ptr(), None, torch.get_num_threads())
        return out.view(*x.shape[:-1], self.out_features)


class HalfEmbedding(nn.Module):
    """An embedding table kept in float16 in the kernel's blocks (a tied head's own
    table); looked-up rows come out float32."""

    def __init__(self, blocks: torch.Tensor, num_embeddings: int, padding_idx: int | None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, blocks.shape[1]
        self.padding_idx = padding_idx
        self.register_buffer("blocks16", blocks)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings):
            raise IndexError(f"token id out of range for an embedding of {self.num_embeddings} rows")
        return block_rows(self._buffers["blocks16"], ids).float()


def half_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> HalfLinear | None:
    """A HalfLinear for `weight` (any float dtype), or None where the kernel cannot take
    it: no kernel here, or values float16 cannot hold."""
    kernel = half_kernel()
    if kernel is None:
        return None
    blocks = to_blocks(weight)
    return None if blocks is None else HalfLinear(blocks, weight.shape[0], bias, kernel)
