"""System information for a benchmark report: what ran it, read from the machine.

Anything that cannot be read is None (JSON null, "n/a" in tables), never a guess.
"""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path
from typing import Any

import psutil

import ruvllm_cli

GIB = 1024**3


def cpu_model() -> str | None:
    """The CPU's marketing name: /proc/cpuinfo on Linux, else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Hardware", "Processor") and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or None


def git_commit() -> str | None:
    """HEAD of the git checkout ruvllm runs from (with `-dirty` for local edits);
    None for an installed package or a repository without commits."""
    package_dir = Path(ruvllm_cli.__file__).resolve().parent

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(package_dir), *args], capture_output=True,
                                  text=True, timeout=5)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != package_dir.parent:
        return None  # some other repository that happens to contain site-packages
    commit = git("rev-parse", "HEAD")
    if commit is None:
        return None
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return f"{commit}-dirty" if dirty else commit


def device_name(device: Any) -> str | None:
    """The accelerator's name (CUDA), or the CPU model on a CPU."""
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "mps":
        return f"Apple MPS ({cpu_model() or platform.machine()})"
    return cpu_model()


def system_info(loaded: Any) -> dict[str, Any]:
    """Machine, software and model-placement facts for the report's `system` object."""
    import torch

    return {
        "cpu_model": cpu_model(),
        "cpu_cores_physical": psutil.cpu_count(logical=False),
        "cpu_cores_logical": psutil.cpu_count(logical=True),
        "torch_threads": torch.get_num_threads(),
        "ram_total_gb": round(psutil.virtual_memory().total / GIB, 2),
        "os": platform.platform(),
        "python_version": platform.python_version(),
        "torch_version": torch.__version__,
        "transformers_version": ruvllm_cli.installed_version("transformers"),
        "device": loaded.device.type,
        "device_name": device_name(loaded.device),
        "dtype": str(loaded.dtype).replace("torch.", ""),
        "quantization": loaded.quantization.label,
        "quantization_path": loaded.quantization_path,
        "ruvllm_version": ruvllm_cli.__version__,
        "git_commit": git_commit(),
    }
