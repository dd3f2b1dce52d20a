"""bfloat16 weights in ruvllm's own kernel, on CPUs with AVX-512 BF16.

oneDNN's packed layout (`quantize.PackedLinear`) read the 0.5B shape's weights at
about 21 GB/s in a one-row decode step, and its packed copy of a tied LM head held
the vocabulary matrix a second time (260 MiB at 0.5B). Here the weights stay plain
[out, in] bfloat16: up to 191 rows run our kernel (`kernels/bf16_gemm.c`: the
weights widened to float32 in registers four rows at a time, held in L1 while the
activation rows pass by fours; a row's result is the same bits in any batch), and a
tied head shares the embedding's table. Prompt chunks of 192 rows and more run
`dense_gemm.blockwise_gemm` (MKL's float32 GEMM on weights widened a block of rows at
a time). Both sum in float32 and round to bfloat16 once, as oneDNN does.
"""

from __future__ import annotations

import torch
from torch import nn

from ruvllm_cli.engine.dense_gemm import blockwise_gemm
from ruvllm_cli.engine.half import kernel_rows, scratch_buffer
from ruvllm_cli.engine.kernels import Bf16Kernel, bf16_kernel

BLOCK = 32   # the kernel reads 32 values a step: K must be a multiple
# Rows from which a call takes the blockwise GEMM: our kernel took 0.86x its time at 128
# rows, 0.99x at 192, 1.18x at 256 (docs/design.md, section 22).
GEMM_ROWS = 192


def scratch_floats(rows: int, width: int) -> int:
    """The room `ruvllm_bf16_linear` works in: the rows widened to float32."""
    return rows * width


class Bf16Linear(nn.Module):
    """A linear layer with plain bfloat16 weights [out, in]; bfloat16 in and out."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernel: Bf16Kernel) -> None:
        super().__init__()
        assert weight.dtype == torch.bfloat16 and weight.is_contiguous() and weight.shape[1] % BLOCK == 0
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight)
        self.bias = None if bias is None else nn.Parameter(bias.to(torch.float32, copy=True), requires_grad=False)
        self._kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = kernel_rows(x, self.in_features, torch.bfloat16)
        count = rows.shape[0]
        if count >= GEMM_ROWS:
            out = self._gemm(rows)
        else:
            out = torch.empty(count, self.out_features, dtype=torch.bfloat16)
            bias = None if self.bias is None else self.bias.data_ptr()
            room = scratch_buffer(scratch_floats(count, self.in_features))
            self._kernel.linear(rows.data_ptr(), count, self.in_features, self._buffers["weight"].data_ptr(),
                                self.out_features, bias, out.data_ptr(), room.data_ptr(), torch.get_num_threads())
        return out.view(*x.shape[:-1], self.out_features)

    def _gemm(self, rows: torch.Tensor) -> torch.Tensor:
        """Many rows: float32 GEMM over the weights widened a block of rows at a time."""
        weight = self._buffers["weight"]
        out = blockwise_gemm(rows, self.out_features,
                             lambda start, count, room: room.copy_(weight[start:start + count]))
        if self.bias is not None:
            out += self.bias
        return out.to(torch.bfloat16)


def bf16_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> Bf16Linear | None:
    """A Bf16Linear over `weight` as given (no copy when it is contiguous bfloat16),
    or None where the kernel cannot take it (none here, or an input width not a
    multiple of 32)."""
    kernel = bf16_kernel()
    if kernel is None or weight.shape[1] % BLOCK:
        return None
    return Bf16Linear(weight.to(torch.bfloat16).contiguous(), bias, kernel)
