"""int8 weights in ruvllm's own kernel: plain codes, a float32 scale per row.

fbgemm's dynamic int8 GEMM (`quantize.DynamicInt8Linear`) keeps its weights in a
packed copy of its own: packing them was most of a cached q8 load, the packed form
cannot be read back row by row (so a tied head needed a second int8 table for the
embedding lookups), it quantizes activations over the whole batch (so a row's result
depended on its company), and at one row it read 26 GB/s of about 40 here. Here the
codes stay as they are, so they map straight from the weight cache and a tied head
and the embedding share one table. Activations are quantized per row to int8
(`kernels/int8_gemm.c`); up to 32 rows (a decode step) run in our GEMV, more in
torch's `_int_mm` (oneDNN's int8 GEMM) over the same codes where the CPU has VNNI, in
ours 32 rows at a time where it has not (`Int8Kernel.rows`). Both sum in exact int32
and apply the same two float32 roundings after, so a row gives the same bits alone
or in any batch (docs/design.md, section 20).
"""

from __future__ import annotations

import torch
from torch import nn

from ruvllm_cli.engine.half import kernel_rows, scratch_buffer
from ruvllm_cli.engine.kernels import Int8Kernel, int8_kernel
from ruvllm_cli.engine.quantize import bucket_rows

BLOCK = 32   # the GEMV reads 32 codes a step: K must be a multiple


def scratch_bytes(rows: int, width: int, out_features: int) -> int:
    """The room `linear_few` (int8_gemm.c) works in for `rows` rows: the codes, their
    offset copy, the row scales and the int32 sums of one pass (32 rows at most)."""
    rows = min(rows, Int8Kernel.FEW_ROWS)
    return 2 * rows * width + 4 * (rows + 8) + 4 * rows * out_features


class Int8Linear(nn.Module):
    """A linear layer with int8 codes [out, in] in [-127, 127] and float32 scales [out]
    (w = code * scale); inputs and outputs in the model's dtype, sums exact in int32."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                 kernel: Int8Kernel) -> None:
        super().__init__()
        assert codes.dtype == torch.int8 and codes.is_contiguous() and codes.shape[1] % BLOCK == 0
        self.out_features, self.in_features = codes.shape
        self.register_buffer("qweight", codes)
        self.register_buffer("scales", scales.to(torch.float32).contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.to(torch.float32, copy=True), requires_grad=False)
        self._kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A decode step calls this 169 times: plain attribute reads, no no-op conversions.
        width, kernel, buffers = self.in_features, self._kernel, self._buffers
        rows = kernel_rows(x, width, torch.float32)
        count = rows.shape[0]
        out = torch.empty(count, self.out_features, dtype=torch.float32)
        bias = None if self.bias is None else self.bias.data_ptr()
        if count <= kernel.rows:   # ours: each weight read once a pass of 32 rows
            room = scratch_buffer(scratch_bytes(count, width, self.out_features), torch.int8)
            kernel.linear_few(rows.data_ptr(), count, width, buffers["qweight"].data_ptr(),
                              buffers["scales"].data_ptr(), self.out_features, bias, out.data_ptr(),
                              room.data_ptr(), torch.get_num_threads())
        else:
            self._many(rows, out, bias)
        if x.dtype != torch.float32:
            out = out.to(x.dtype)
        return out.view(*x.shape[:-1], self.out_features)

    def _many(self, rows: torch.Tensor, out: torch.Tensor, bias: int | None) -> None:
        """Many rows on a CPU with VNNI: oneDNN's int8 GEMM over the same codes, scaled as the GEMV scales.
        Padded to a few row counts, since oneDNN keeps a primitive per shape (bucket_rows)."""
        count, width = rows.shape
        threads = torch.get_num_threads()
        codes = torch.zeros(bucket_rows(count), width, dtype=torch.int8)
        scales = torch.empty(count, dtype=torch.float32)
        self._kernel.quantize(rows.data_ptr(), count, width, codes.data_ptr(), scales.data_ptr(), threads)
        sums = torch._int_mm(codes, self.qweight.t())
        self._kernel.scale(sums.data_ptr(), count, self.out_features, scales.data_ptr(), self.scales.data_ptr(),
                           bias, out.data_ptr(), threads)


def int8_linear(codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> Int8Linear | None:
    """An Int8Linear, or None where the kernel cannot take it (none here, or an input
    width not a multiple of 32). A code of -128 (not made by our quantizers, which stay
    within +-127) becomes -127: the GEMV's sign trick cannot negate it."""
    kernel = int8_kernel()
    if kernel is None or codes.shape[1] % BLOCK:
        return None
    return Int8Linear(codes.clamp_(min=-127), scales, bias, kernel)
