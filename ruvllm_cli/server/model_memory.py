"""Giving an unloaded model's memory back to the system (docs/design.md, section 17)."""

from __future__ import annotations

import gc
import sys
from typing import Any


def release_engine(box: list[Any]) -> None:
    """Stop the engine thread of the ServedModel in `box`, drop it, and hand its memory
    back: what stops a model's weights, KV pool and LoRA slots from being freed is a
    reference, so `box` must hold the last one (the caller keeps none, not even a local).

    Blocks until the engine thread has finished its step (run it off the event loop)."""
    served = box.pop()
    served.shutdown()
    del served
    # The model's modules sit in reference cycles: with the engine dropped, a weakref
    # showed the nn.Module (and so its weights) still alive until a collection ran.
    gc.collect()
    from ruvllm_cli.engine.loader import release_freed_memory

    # glibc keeps freed heap pages in its arenas: the tensors a model frees below its
    # mmap threshold (which has risen to 32 MiB after large frees) stay resident
    # until trimmed, so without this RSS would barely fall after an unload.
    release_freed_memory()
    torch = sys.modules.get("torch")
    if torch is None:
        return
    # The caching allocators keep freed blocks for the next allocation otherwise.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    if torch.backends.mps.is_available():
        torch.mps.empty_cache()
