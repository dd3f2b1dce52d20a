"""Peak memory as the operating system and CUDA report it (MiB, 2^20 bytes)."""

from __future__ import annotations

import sys
from typing import Any

MIB = 1024**2


def peak_rss_mb() -> float | None:
    """This process's resident-set high-water mark since it started (model load included)."""
    try:
        import resource
    except ImportError:  # Windows
        return _psutil_peak_mb()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # ru_maxrss is in kilobytes on Linux and the BSDs, in bytes on macOS.
    peak_bytes = peak if sys.platform == "darwin" else peak * 1024
    return peak_bytes / MIB


def _psutil_peak_mb() -> float | None:
    import psutil

    info = psutil.Process().memory_info()
    peak = getattr(info, "peak_wset", None)  # Windows' peak working set
    return peak / MIB if peak is not None else None


def cuda_max_allocated_mb(device: Any) -> float | None:
    """torch's peak of CUDA memory allocated on `device`; None off CUDA."""
    if getattr(device, "type", None) != "cuda":
        return None
    import torch

    return torch.cuda.max_memory_allocated(device) / MIB
