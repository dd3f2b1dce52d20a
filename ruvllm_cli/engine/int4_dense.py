"""q4k layers beside torch's CPU int4 kernel: a kernel of our own, or for prompt chunks
where it does not run, float32 GEMM on weights unpacked a block at a time.

torch's CPU int4 kernel (`_weight_int4pack_mm_for_cpu`) dequantizes every weight once
per activation row: one row of a whole model read its weights at about 12 GB/s here, 16
rows cost 7 times one, and a 512-token prompt prefilled 1.5x slower under q4k than
under f16 (docs/design.md, sections 22 and 23). On AVX-512 CPUs, `kernels/int4_gemm.c`
takes every call: each group's sum keeps the scale and zero out of the inner loop, up
to six rows take the codes straight from memory, more pass up to six at a time over a
float32 tile of one group's codes in L1; a row's result is the same bits alone, in any
batch, or in a prompt chunk. On AVX2 CPUs `kernels/int4_gemm_avx2.c` takes every call,
the activations quantized to int8 per weight group and the products summed exactly in
integers (llama.cpp's Q4_K x Q8_K arithmetic; one row twice as fast as float32
activations, design section 23), the same bits for a row in any batch too. Elsewhere, for 64 rows and more, `Int4Linear` unpacks its
codes a block of output rows at a time into float32 (w = (q - 8) * scale + zero,
torch's kernel's own formula) for `dense_gemm.blockwise_gemm`, as `Bf16Linear` widens
bfloat16 weights.

The packed layout is torch's and depends on the CPU capability it dispatched to, so it
is read off torch itself once per process: probe matrices whose codes spell out their
own row index reveal which row each nibble holds; a random layer unpacked here must
then equal what the kernel computes against the identity, or the dense path stays off.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

import torch

from ruvllm_cli.engine.dense_gemm import blockwise_gemm
from ruvllm_cli.engine.half import scratch_buffer
from ruvllm_cli.engine.kernels import Int4Kernel, int4_avx2_kernel, int4_kernel, int4_unpack_kernel


@dataclass(frozen=True)
class PackedLayout:
    """Packed bytes as [N / block, K, block / 2]; byte j of a k holds row low[j] of the
    block in its low nibble and row high[j] in its high nibble; the same read the other
    way, row r of a block sits in byte byte_of[r] at bit shift_of[r] (0 or 4)."""

    block: int
    low: torch.Tensor    # [block / 2] int64
    high: torch.Tensor
    byte_of: torch.Tensor   # [block] int64
    shift_of: torch.Tensor

    @classmethod
    def of(cls, block: int, low: torch.Tensor, high: torch.Tensor) -> "PackedLayout":
        byte_of, shift_of = torch.empty(block, dtype=torch.int64), torch.empty(block, dtype=torch.int64)
        halves = torch.arange(block // 2)
        byte_of[low], shift_of[low] = halves, 0
        byte_of[high], shift_of[high] = halves, 4
        return cls(block, low, high, byte_of, shift_of)


def dense_weight(packed: torch.Tensor, scales_and_zeros: torch.Tensor, group: int, start: int, rows: int,
                 layout: PackedLayout, out: torch.Tensor) -> torch.Tensor:
    """Rows [start, start + rows) of the weight as float32 into `out` ([rows, K]);
    start and rows multiples of the layout's block. In C where the kernel runs, else
    in torch (the check below, and machines without a compiler)."""
    n_total, half_k = packed.shape
    k, block = half_k * 2, layout.block
    kernel = int4_unpack_kernel()
    if kernel is not None:
        kernel.unpack(packed.data_ptr(), n_total, k, block, layout.low.data_ptr(), layout.high.data_ptr(),
                      scales_and_zeros.data_ptr(), group, start, rows, out.data_ptr(), torch.get_num_threads())
        return out
    blocks = packed.view(-1)[start * half_k:(start + rows) * half_k].view(rows // block, k, block // 2)
    codes = torch.empty(rows // block, k, block, dtype=torch.uint8)
    codes[:, :, layout.low] = blocks & 0xF
    codes[:, :, layout.high] = blocks >> 4
    out.view(rows // block, block, k).copy_(codes.transpose(1, 2))
    sz = scales_and_zeros[:, start:start + rows].float()                   # [K / g, rows, 2]
    out.sub_(8).mul_(sz[:, :, 0].t().repeat_interleave(group, dim=1)).add_(sz[:, :, 1].t().repeat_interleave(group, 1))
    return out


def packed_rows(packed: torch.Tensor, scales_and_zeros: torch.Tensor, group: int, ids: torch.Tensor,
                layout: PackedLayout) -> torch.Tensor:
    """Rows `ids` (int64, 1-D) of the weight as bfloat16 [len(ids), K]: a tied head's
    packed weights read as its embedding's table, each value the float32 one
    `dense_weight` gives, rounded once. In C where the kernel runs, else each id's block
    unpacked in torch."""
    n_total, half_k = packed.shape
    k = half_k * 2
    kernel = int4_unpack_kernel()
    if kernel is not None:
        out = torch.empty(len(ids), k, dtype=torch.bfloat16)
        kernel.packed_rows(packed.data_ptr(), n_total, k, layout.block, layout.byte_of.data_ptr(),
                           layout.shift_of.data_ptr(),
                           scales_and_zeros.data_ptr(), group, ids.data_ptr(), len(ids), out.data_ptr())
        return out
    room = torch.empty(layout.block, k)
    rows = [dense_weight(packed, scales_and_zeros, group, int(i) - int(i) % layout.block, layout.block, layout,
                         room)[int(i) % layout.block].clone() for i in ids]
    return torch.stack(rows).to(torch.bfloat16) if rows else torch.empty(0, k, dtype=torch.bfloat16)


def dense_linear(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group: int,
                 layout: PackedLayout) -> torch.Tensor:
    """x [M, K] (M >= GEMM_ROWS) times the int4 weight, float32 sums; float32 [M, N]."""
    return blockwise_gemm(x, packed.shape[0], functools.partial(_unpacked, packed, scales_and_zeros, group, layout),
                          layout.block)


def own_takes(packed: torch.Tensor, group: int) -> bool:
    """Whether our int4 kernel takes this packed weight's shape (whole blocks of torch's
    rows here, 64 or 32; groups of 32, 64 or 128 that divide K)."""
    n, half_k = packed.shape
    block = _natural_block()
    return block is not None and n % block == 0 and group in (32, 64, 128) and (2 * half_k) % group == 0


def scratch_floats(rows: int, k: int, group: int) -> int:
    """The room the int4 kernels work in: the rows widened, and their group sums."""
    return rows * (k + k // group)


def own_linear(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group: int,
               bias: torch.Tensor | None, kernel: Int4Kernel | None = None) -> torch.Tensor | None:
    """x [M, K] bfloat16 (contiguous) times the int4 weight (+ the bfloat16 bias, added
    as torch adds it), bfloat16 [M, N], through int4_gemm.c or int4_gemm_avx2.c (or
    `kernel`, another build of the one here); None where neither can take it (none
    here, another packed layout, other shapes)."""
    kernel = kernel or own_kernel()
    if kernel is None or not own_takes(packed, group):
        return None
    rows, k = x.shape
    n = packed.shape[0]
    out = torch.empty(rows, n, dtype=torch.bfloat16)
    room = scratch_buffer(scratch_floats(rows, k, group))
    kernel.linear(x.data_ptr(), rows, k, packed.data_ptr(), n, scales_and_zeros.data_ptr(), group,
                  None if bias is None else bias.data_ptr(), out.data_ptr(), room.data_ptr(), torch.get_num_threads())
    return out


def own_kernel() -> Int4Kernel | None:
    """The int4 kernel that reads torch's packed layout here: int4_gemm.c where torch packs
    blocks of 64 rows (its AVX-512 layout; the kernel needs AVX-512), int4_gemm_avx2.c
    where it packs blocks of 32 (its AVX2 one); None elsewhere. Asked at each call
    (`--no-compile` turns the kernels off)."""
    block = _natural_block()
    return int4_kernel() if block == 64 else int4_avx2_kernel() if block == 32 else None


def own_runs() -> bool:
    """Whether q4k layers take one of our int4 kernels here (for the load line)."""
    return own_kernel() is not None


@functools.cache
def _natural_block() -> int | None:
    """The rows of a block where torch packs row j of it in the low nibble of byte j and
    row block / 2 + j in the high one, the layout our kernels read; None where it packs
    otherwise."""
    from ruvllm_cli.engine.quantize import INT4_INNER_K_TILES

    layout = packed_layout(INT4_INNER_K_TILES)
    if layout is None or layout.block not in (32, 64):
        return None
    half = layout.block // 2
    natural = torch.equal(layout.low, torch.arange(half)) and torch.equal(layout.high, torch.arange(half, 2 * half))
    return layout.block if natural else None


def _unpacked(packed: torch.Tensor, scales_and_zeros: torch.Tensor, group: int, layout: PackedLayout,
              start: int, rows: int, room: torch.Tensor) -> torch.Tensor:
    return dense_weight(packed, scales_and_zeros, group, start, rows, layout, room)


@functools.cache
def pack_signature(inner_k_tiles: int) -> str:
    """A short hash of how torch packs int4 codes in this process: the packed bytes of
    a fixed matrix. They depend on the CPU capability torch dispatched to (blocks of
    64 rows under AVX-512, 32 under AVX2, another order without either; and
    ATEN_CPU_CAPABILITY picks it), so packed weights saved by one process are read
    right only by a process whose signature is the same (weight_cache's key)."""
    codes = (torch.arange(128).view(-1, 1) * 7 + torch.arange(64).view(1, -1) * 3).remainder(16).to(torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, inner_k_tiles)
    return hashlib.sha256(packed.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


@functools.cache
def packed_layout(inner_k_tiles: int) -> PackedLayout | None:
    """torch's packed int4 layout on this CPU, or None where it is not one this module
    reads (checked against the kernel itself)."""
    try:
        layout = _probe(inner_k_tiles)
        return layout if layout is not None and _unpacks_exactly(layout, inner_k_tiles) else None
    except (RuntimeError, ValueError, IndexError):   # a torch build whose private ops differ
        return None


def _probe(inner_k_tiles: int) -> PackedLayout | None:
    """Which row each nibble holds: codes n % 16 and n // 16 % 16 packed, read back."""
    n, k = 256, 64
    rows = torch.arange(n, dtype=torch.int32).unsqueeze(1).expand(n, k)
    def pack(codes: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), inner_k_tiles).reshape(-1)

    low_digit, high_digit = pack(rows % 16).to(torch.int64), pack(rows // 16 % 16).to(torch.int64)
    nibbles = [(low_digit >> shift & 0xF) + 16 * (high_digit >> shift & 0xF) for shift in (0, 4)]
    for block in (64, 32, 16):
        if n % block:
            continue
        found = [r.view(n // block, k, block // 2) for r in nibbles]
        base = (torch.arange(n // block) * block).view(-1, 1, 1)
        low, high = found[0] - base, found[1] - base
        if bool((low == low[0, 0]).all()) and bool((high == high[0, 0]).all()):
            order = torch.cat([low[0, 0], high[0, 0]]).sort().values
            if torch.equal(order, torch.arange(block)):
                return PackedLayout.of(block, low[0, 0].clone(), high[0, 0].clone())
    return None


def _unpacks_exactly(layout: PackedLayout, inner_k_tiles: int) -> bool:
    """A random layer unpacked here against the kernel's product with the identity."""
    n, k, group = 2 * layout.block, 256, 32
    with torch.random.fork_rng(devices=[]):
        generator = torch.Generator().manual_seed(0)
        codes = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=generator)
        sz = (torch.rand(k // group, n, 2, generator=generator) - 0.5).to(torch.bfloat16)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, inner_k_tiles)
    kernel = torch.ops.aten._weight_int4pack_mm_for_cpu(torch.eye(k, dtype=torch.bfloat16), packed, group, sz)
    ours = dense_weight(packed, sz, group, 0, n, layout, torch.empty(n, k))
    # One bfloat16 step apart at most (the kernel may fuse the multiply-add); a wrong
    # layout would be wrong everywhere.
    return torch.allclose(ours.t().to(torch.bfloat16).float(), kernel.float(), rtol=2.0 ** -7, atol=1e-3)
