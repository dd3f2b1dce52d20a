"""Small C kernels of our own, for what torch's CPU kernels do slowly here.

Plain C (no torch headers), so the system's C compiler builds one in under a second
to four (the decode step's) on first use; the library is kept in the cache under a
name that hashes its source and flags, and loaded through ctypes. Where there is no
compiler, no suitable CPU, or `RUVLLM_COMPILE=0`, callers get None and keep torch's
kernels (docs/design.md, section 5a).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Callable, TypeVar

K = TypeVar("K")
COMPILE_ENV = "RUVLLM_COMPILE"   # "0": no kernels of our own
# "avx2": our kernels take their AVX2 forms on an AVX-512 CPU too, as oneDNN's
# ONEDNN_MAX_CPU_ISA caps its own (an AVX2 laptop's paths measured or tested here).
ISA_ENV = "RUVLLM_MAX_CPU_ISA"
HEADER = "common.h"   # included by every kernel file: built beside it, hashed with it
# No contraction of a * b + c into one FMA: the int8 epilogue must round as torch does.
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
CPU_FLAGS = ("avx2", "fma", "f16c")
# bf16_gemm.c: AVX-512 with its BF16 conversions (oneDNN's bfloat16 CPUs).
BF16_FLAGS = FLAGS + ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16")
BF16_CPU_FLAGS = CPU_FLAGS + ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")
# decode_step.c's attention in AVX-512 (functions compiled for it by target attributes),
# and int4_gemm.c (built for it whole; int4_gemm_avx2.c serves other CPUs).
AVX512_CPU_FLAGS = CPU_FLAGS + ("avx512f", "avx512bw", "avx512vl", "avx512dq")
AVX512_FLAGS = FLAGS + ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")
# int8_gemm.c's GEMV in AVX-512 VNNI (target attributes, as the attention).
VNNI_CPU_FLAGS = CPU_FLAGS + ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")
_pointer, _size = ctypes.c_void_p, ctypes.c_int64


class HalfKernel:
    """half_gemm.c: float32 activations times float16 weights in the kernel's blocks.
    `linear` is its AVX-512 form (`wide`) where the CPU has it, else `linear_avx2`,
    which runs anywhere: the same bits, which the tests check."""

    def __init__(self, library: ctypes.CDLL) -> None:
        arguments = [_pointer, _size, _size, _pointer, _size, _pointer, _pointer, _pointer, ctypes.c_int]
        self.linear_avx2 = _bind(library.ruvllm_f16_linear_avx2, arguments)
        self.linear_avx512 = _bind(library.ruvllm_f16_linear_avx512, list(arguments))
        self.wide = cpu_has(AVX512_CPU_FLAGS)
        self.linear = self.linear_avx512 if self.wide else self.linear_avx2


class Int8Kernel:
    """int8_gemm.c: `linear_few` (up to `rows` float32 rows times int8 weights with a
    float32 scale per row, each weight read once: in AVX-512 VNNI where the CPU has it,
    `wide`, else in AVX2, `linear_few_avx2`; the same bits), and for more rows
    `quantize` (float32 rows to int8 codes and a scale per row) and `scale` (oneDNN's
    exact int32 sums to float32 outputs, rounded as `linear_few` rounds).

    `rows`: the most rows sent to `linear_few`, more going to oneDNN's int8 GEMM. That
    is 32 (FEW_ROWS) where the CPU has AVX-512 VNNI; without VNNI oneDNN's signed int8
    GEMM ran some 25x slower than a float32 one on an AVX2 CPU (a 128-token q8 prompt
    took 23 s), so there `linear_few` takes every count, 32 rows at a time."""

    FEW_ROWS = 32   # the rows one pass of either form takes (int8_gemm.c's FEW_ROWS)

    def __init__(self, library: ctypes.CDLL) -> None:
        self.quantize = _bind(library.ruvllm_q8_quantize, [_pointer, _size, _size, _pointer, _pointer, ctypes.c_int])
        arguments = [_pointer, _size, _size, _pointer, _pointer, _size, _pointer, _pointer, _pointer, ctypes.c_int]
        self.linear_few_avx2 = _bind(library.ruvllm_q8_linear_few, arguments)
        self.linear_few_wide = _bind(library.ruvllm_q8_linear_few_wide, list(arguments))
        self.wide = cpu_has(VNNI_CPU_FLAGS)
        self.linear_few = self.linear_few_wide if self.wide else self.linear_few_avx2
        self.rows: float = self.FEW_ROWS if self.wide else math.inf
        self.scale = _bind(library.ruvllm_q8_scale, [_pointer, _size, _size, _pointer, _pointer, _pointer, _pointer,
                                                     ctypes.c_int])


class Bf16Kernel:
    """`ruvllm_bf16_linear` from bf16_gemm.c: bfloat16 activations times bfloat16
    weights, float32 sums, for a few rows."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self.linear = _bind(library.ruvllm_bf16_linear, [_pointer, _size, _size, _pointer, _size, _pointer, _pointer,
                                                         _pointer, ctypes.c_int])


class Int4UnpackKernel:
    """int4_unpack.c: torch's packed int4 rows to float32 (`unpack`), the rows of an
    int4 embedding table looked up (`embedding`), rows of a tied head's packed weights
    looked up as an embedding's (`packed_rows`), and float32 rows quantized into int4
    groups with fitted scales and lows (`fit`, quantize.int4_groups)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self.unpack = _bind(library.ruvllm_int4_unpack, [_pointer, _size, _size, _size, _pointer, _pointer, _pointer,
                                                         _size, _size, _size, _pointer, ctypes.c_int])
        self.embedding = _bind(library.ruvllm_int4_embedding, [_pointer] * 4 + [_size] * 3 + [_pointer])
        self.packed_rows = _bind(library.ruvllm_int4_packed_rows, [_pointer] + [_size] * 3 + [_pointer] * 3
                                 + [_size, _pointer, _size, _pointer])
        self.fit = _bind(library.ruvllm_int4_fit, [_pointer] + [_size] * 3 + [ctypes.c_int] + [_pointer] * 3
                         + [ctypes.c_int])


class Int4Kernel:
    """bfloat16 activations times torch's packed int4 weights, any number of rows, each
    row's result the same bits in any batch: `ruvllm_int4_linear` from int4_gemm.c
    (AVX-512; torch's blocks of `block` = 64 rows there; float32 sums) or
    `ruvllm_int4_linear_avx2` from int4_gemm_avx2.c (torch's blocks of 32 rows under
    AVX2; the activations quantized to int8 per weight group, exact integer sums)."""

    def __init__(self, library: ctypes.CDLL, symbol: str = "ruvllm_int4_linear", block: int = 64) -> None:
        self.block = block
        self.linear = _bind(getattr(library, symbol), [_pointer, _size, _size, _pointer, _size, _pointer, _size,
                                                       _pointer, _pointer, _pointer, ctypes.c_int])


class AttendStep(ctypes.Structure):
    """decode_step.c's AttendStep: what each layer's `rope_attend` call of one decode step
    shares, set once a step (each argument of a ctypes call is converted on its own)."""

    _fields_ = [("cos", _pointer), ("sin", _pointer), ("rows", _size), ("q_heads", _size), ("kv_heads", _size),
                ("dim", _size), ("cache_slots", _size), ("slots", _pointer), ("tables", _pointer), ("width", _size),
                ("lengths", _pointer), ("block_size", _size), ("scale", ctypes.c_float), ("out", _pointer),
                ("bf16", ctypes.c_int), ("kv", ctypes.c_int), ("wide", ctypes.c_int), ("threads", ctypes.c_int),
                ("window", _size), ("lora_mask", _pointer), ("lora_width", _size)]


class LinearPlan(ctypes.Structure):
    """decode_step.c's LinearPlan: one linear layer as `ruvllm_decode_layers` runs it
    (`kind`: LINEAR_Q8, LINEAR_BF16, LINEAR_INT4 or LINEAR_F16, its kernel's slot in the
    step's function table)."""

    _fields_ = [("kind", _size), ("out", _size), ("in_", _size), ("group", _size), ("weight", _pointer),
                ("scales", _pointer), ("bias", _pointer), ("lora_a", _pointer), ("lora_b", _pointer)]


LINEAR_Q8, LINEAR_BF16, LINEAR_INT4, LINEAR_F16 = range(4)


class LayerPlan(ctypes.Structure):
    """decode_step.c's LayerPlan: a decoder layer's seven linear layers, norms and caches."""

    _fields_ = [(name, LinearPlan) for name in ("q", "k", "v", "o", "gate", "up", "down")] + [
        ("norm_in", _pointer), ("norm_post", _pointer), ("eps_in", ctypes.c_float), ("eps_post", ctypes.c_float),
        ("k_cache", _pointer), ("v_cache", _pointer)]


class DecodeKernel:
    """decode_step.c: the work between a Llama-family decode step's linear layers
    (engine/fused.py), on float32 or bfloat16 activations (the `bf16` argument).
    `wide`: the attention, RMSNorm, SiLU * up and the argmax take their AVX-512
    functions (1, where the CPU has them; 2 where it has AVX-512 BF16 too: bfloat16
    roundings by its conversion instruction, the attention's bfloat16 scores by its
    dot product; 0: AVX2). `decode_layers` runs every layer of a step,
    calling the linear kernels itself (fused.py's LayerPlans)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self.wide = (2 if cpu_has(AVX512_CPU_FLAGS + ("avx512_bf16",)) else 1) if cpu_has(AVX512_CPU_FLAGS) else 0
        self.add_rms_norm = _bind(library.ruvllm_add_rms_norm, [_pointer] * 4 + [_size, _size, ctypes.c_float]
                                  + [ctypes.c_int] * 3)
        self.rope_attend = _bind(library.ruvllm_rope_attend, [ctypes.POINTER(AttendStep)] + [_pointer] * 5)
        self.silu_mul = _bind(library.ruvllm_silu_mul, [_pointer, _pointer, _size] + [ctypes.c_int] * 3)
        self.decode_layers = _bind(library.ruvllm_decode_layers, [ctypes.POINTER(AttendStep), ctypes.POINTER(LayerPlan),
                                                                  _size, _pointer] + [_pointer] * 10
                                   + [_size, _pointer, ctypes.c_float])
        self.argmax_rows = _bind(library.ruvllm_argmax_rows, [_pointer, _size, _size, ctypes.c_int, _pointer,
                                                               ctypes.c_int, ctypes.c_int])
        self.lora_add = _bind(library.ruvllm_lora_add, [_pointer, _size, _size, _pointer, _size, _pointer, _pointer,
                                                        _size, _pointer, ctypes.c_int])


def _bind(function: Any, argtypes: list[Any]) -> Any:
    function.argtypes, function.restype = argtypes, None
    return function


KERNEL_DIR_ENV = "RUVLLM_KERNEL_DIR"


def kernels_dir() -> Path:
    """Built libraries: beside the user cache, not in the model cache (`--cache-dir`
    moves models, and a model cache per test would rebuild the kernel each time)."""
    if os.environ.get(KERNEL_DIR_ENV):
        return Path(os.environ[KERNEL_DIR_ENV]).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("ruvllm")) / "kernels"


@functools.cache
def half_kernel() -> HalfKernel | None:
    """The float16-weight linear kernel, built on first use; None where it cannot run."""
    return _loaded(HalfKernel, "half_gemm", "float16", "float16 weights take torch's slower path")


@functools.cache
def int8_kernel() -> Int8Kernel | None:
    """The int8-weight linear kernel, built on first use; None where it cannot run."""
    return _loaded(Int8Kernel, "int8_gemm", "int8", "int8 weights take fbgemm's kernel")


@functools.cache
def bf16_kernel() -> Bf16Kernel | None:
    """The bfloat16-weight linear kernel (AVX-512 BF16 CPUs), built on first use."""
    return _loaded(Bf16Kernel, "bf16_gemm", "bfloat16", "bfloat16 weights take oneDNN's packed layout",
                   BF16_FLAGS, BF16_CPU_FLAGS)


@functools.cache
def int4_unpack_kernel() -> Int4UnpackKernel | None:
    """The int4 unpacking kernel (q4k prompt chunks), built on first use."""
    return _loaded(Int4UnpackKernel, "int4_unpack", "int4 unpacking", "q4k prompt chunks take torch's int4 kernel")


@functools.cache
def int4_kernel() -> Int4Kernel | None:
    """The int4-weight linear kernel (AVX-512 CPUs), built on first use."""
    return _loaded(Int4Kernel, "int4_gemm", "int4", "q4k layers take torch's int4 kernel",
                   AVX512_FLAGS, AVX512_CPU_FLAGS)


@functools.cache
def int4_avx2_kernel() -> Int4Kernel | None:
    """The int4-weight linear kernel for torch's AVX2 layout, built on first use."""
    return _loaded(functools.partial(Int4Kernel, symbol="ruvllm_int4_linear_avx2", block=32), "int4_gemm_avx2",
                   "int4 (AVX2)", "q4k layers take torch's int4 kernel")


@functools.cache
def decode_kernel() -> DecodeKernel | None:
    """The fused decode step's kernels, built on first use; None where they cannot run."""
    return _loaded(DecodeKernel, "decode_step", "decode step", "decode steps take transformers' layer code")


# Every kernel's loader (turn_off clears their caches; the tests build them all first).
LOADERS = (half_kernel, int8_kernel, bf16_kernel, int4_unpack_kernel, int4_kernel, int4_avx2_kernel, decode_kernel)


@dataclass(frozen=True)
class Build:
    """How a loaded kernel was built: its file, the flags and the wrapper (a loaded
    kernel's `build`; scripts/bench_kernel_ab.py builds another revision's source so)."""
    name: str
    flags: tuple[str, ...]
    wrapper: Callable[[ctypes.CDLL], Any]


def _loaded(wrapper: Callable[[ctypes.CDLL], K], name: str, what: str, fallback: str,
            flags: tuple[str, ...] = FLAGS, cpu_flags: tuple[str, ...] = CPU_FLAGS) -> K | None:
    """`name`.c's library wrapped for its callers, or None where it cannot run."""
    library = _library(name, what, fallback, flags, cpu_flags)
    if library is None:
        return None
    kernel = wrapper(library)
    kernel.build = Build(name, flags, wrapper)  # type: ignore[attr-defined]
    return kernel


def turn_off() -> None:
    """No kernels of our own from here on, in this process and the ones it starts
    (`--no-compile`): as RUVLLM_COMPILE=0, including for kernels already loaded."""
    os.environ[COMPILE_ENV] = "0"
    for loader in LOADERS:
        loader.cache_clear()


def _library(name: str, what: str, fallback: str, flags: tuple[str, ...] = FLAGS,
             cpu_flags: tuple[str, ...] = CPU_FLAGS) -> ctypes.CDLL | None:
    """`name`.c built (once, into the kernels directory) and loaded; None, with one line
    saying so, where there is no compiler or the build fails, and silently where the
    CPU lacks the instructions or RUVLLM_COMPILE=0."""
    if os.environ.get(COMPILE_ENV, "1") == "0" or not cpu_has(cpu_flags):
        return None
    files = resources.files(__package__)
    source, header = files.joinpath(f"{name}.c").read_bytes(), files.joinpath(HEADER).read_bytes()
    compiler = c_compiler()
    if compiler is None:
        _say(f"no C compiler (cc or gcc) found: {fallback}")
        return None
    key = hashlib.sha256(source + header + " ".join(flags).encode()).hexdigest()[:16]
    path = kernels_dir() / f"{name}-{key}.so"
    if not path.is_file() and not _build(compiler, source, header, path, what, fallback, flags):
        return None
    try:
        return ctypes.CDLL(str(path))
    except OSError as error:
        _say(f"the {what} kernel in {path} does not load ({error}): {fallback} instead")
        return None


def half_weights_expected() -> bool:
    """Without torch (for `ruvllm info`): whether `f16` would mean float16 weights in our
    kernel here, as loader.half_weights_here finds by loading the kernels: a CPU with
    the float16 kernel's instructions but not AVX-512 BF16, a C compiler, and our
    kernels not turned off."""
    return (os.environ.get(COMPILE_ENV, "1") != "0" and c_compiler() is not None and cpu_has(CPU_FLAGS)
            and not cpu_has(BF16_CPU_FLAGS))


def c_compiler() -> str | None:
    """The C compiler the kernels are built with: $CC, else cc or gcc on the PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def cpu_has(flags: tuple[str, ...]) -> bool:
    """Whether this is an x86-64 CPU whose /proc/cpuinfo lists every flag (AVX-512 ones
    never under RUVLLM_MAX_CPU_ISA=avx2)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    if os.environ.get(ISA_ENV, "").lower() == "avx2" and any(flag.startswith("avx512") for flag in flags):
        return False
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            line = next((line for line in info if line.startswith("flags")), "")
    except OSError:
        return False
    present = set(line.split(":", 1)[-1].split())
    return all(flag in present for flag in flags)


def _build(compiler: str, source: bytes, header: bytes, path: Path, what: str, fallback: str,
           flags: tuple[str, ...]) -> bool:
    """Compile into a temporary file renamed into place: a reader never sees half a library."""
    _say(f"building ruvllm's {what} kernel (once; a few seconds at most)")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as work:
            c_file, so_file = Path(work) / path.with_suffix(".c").name, Path(work) / path.name
            c_file.write_bytes(source)
            (Path(work) / HEADER).write_bytes(header)
            done = subprocess.run([compiler, *flags, "-o", str(so_file), str(c_file)],
                                  capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                reason = (done.stderr.strip().splitlines() or ["no output"])[-1]
                _say(f"the {what} kernel did not build ({reason}): {fallback} instead")
                return False
            os.replace(so_file, path)
        return True
    except (OSError, subprocess.SubprocessError) as error:
        _say(f"the {what} kernel could not be built in {path.parent} ({error}): {fallback} instead")
        return False


def _say(message: str) -> None:
    # One line on stderr: never a silent pause, and nothing on stdout, which may carry JSON.
    print(f"ruvllm: {message}", file=sys.stderr, flush=True)
