"""Small C kernels of our own, for what torch's CPU kernels do slowly here.

Plain C (no torch headers), so the system's C compiler builds one in about a second
on first use; the library is kept in the cache under a name that hashes its source
and flags, and loaded through ctypes. Where there is no compiler, no suitable CPU,
or `RUVLLM_COMPILE=0`, callers get None and keep torch's kernels (docs/design.md,
section 5a).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from importlib import resources
from pathlib import Path

COMPILE_ENV = "RUVLLM_COMPILE"   # "0": no kernels of our own
HALF_FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC")
HALF_CPU_FLAGS = ("avx2", "fma", "f16c")


class HalfKernel:
    """`ruvllm_f16_linear` from half_gemm.c: float32 activations times float16 weights."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self.linear = library.ruvllm_f16_linear
        pointer, size = ctypes.c_void_p, ctypes.c_int64
        self.linear.argtypes = [pointer, size, size, pointer, size, pointer, pointer, pointer, ctypes.c_int]
        self.linear.restype = None


def kernels_dir() -> Path:
    from ruvllm_cli.paths import resolve_cache_dir

    return resolve_cache_dir() / "kernels"


@functools.cache
def half_kernel() -> HalfKernel | None:
    """The float16-weight linear kernel, built on first use; None where it cannot run."""
    if os.environ.get(COMPILE_ENV, "1") == "0" or not cpu_has(HALF_CPU_FLAGS):
        return None
    source = resources.files(__package__).joinpath("half_gemm.c").read_bytes()
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        _say("no C compiler (cc or gcc) found: float16 weights take torch's slower path")
        return None
    key = hashlib.sha256(source + " ".join(HALF_FLAGS).encode()).hexdigest()[:16]
    path = kernels_dir() / f"half_gemm-{key}.so"
    if not path.is_file() and not _build(compiler, source, path):
        return None
    try:
        return HalfKernel(ctypes.CDLL(str(path)))
    except OSError as error:
        _say(f"the float16 kernel in {path} does not load ({error}): torch's slower path instead")
        return None


def cpu_has(flags: tuple[str, ...]) -> bool:
    """Whether this is an x86-64 CPU whose /proc/cpuinfo lists every flag."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            line = next((line for line in info if line.startswith("flags")), "")
    except OSError:
        return False
    present = set(line.split(":", 1)[-1].split())
    return all(flag in present for flag in flags)


def _build(compiler: str, source: bytes, path: Path) -> bool:
    """Compile into a temporary file renamed into place: a reader never sees half a library."""
    _say("building ruvllm's float16 kernel (once; about a second)")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as work:
            c_file, so_file = Path(work) / "half_gemm.c", Path(work) / path.name
            c_file.write_bytes(source)
            done = subprocess.run([compiler, *HALF_FLAGS, "-o", str(so_file), str(c_file)],
                                  capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                reason = (done.stderr.strip().splitlines() or ["no output"])[-1]
                _say(f"the float16 kernel did not build ({reason}): torch's slower path instead")
                return False
            os.replace(so_file, path)
        return True
    except (OSError, subprocess.SubprocessError) as error:
        _say(f"the float16 kernel could not be built in {path.parent} ({error}): torch's slower path instead")
        return False


def _say(message: str) -> None:
    # One line on stderr: never a silent pause, and nothing on stdout, which may carry JSON.
    print(f"ruvllm: {message}", file=sys.stderr, flush=True)
