"""Engine configuration (frozen): block size, batch bounds, KV memory, device."""

from __future__ import annotations

from dataclasses import dataclass

from ruvllm_cli.quantization import Quantization

# The context a model runs with when max_model_len is not given (chat, benchmark), or
# the model's own where that is shorter: a chat needs its conversation, not 32k tokens.
DEFAULT_CONTEXT = 4096


@dataclass(frozen=True)
class EngineConfig:
    device: str = "auto"
    quantization: Quantization = Quantization.F16
    block_size: int = 16
    max_num_seqs: int = 16                   # --max-concurrent
    max_num_batched_tokens: int | None = None  # per-step token budget; device default when None
    max_model_len: int | None = None         # prompt + output; min(model context, DEFAULT_CONTEXT) when None
    kv_cache_memory: int | None = None       # bytes for the KV pool (--kv-cache-memory)
    kv_cache_fraction: float = 0.25          # else this share of free memory, capped by need
    enable_prefix_caching: bool = True
    max_loras: int = 4                       # LoRA adapter slots: adapters decoded at once (--max-loras)
    max_lora_rank: int = 16                  # the largest adapter rank a slot holds (--max-lora-rank)
    scheduling_policy: str = "fcfs"          # or "priority" (--scheduling-policy)
    preemption_mode: str = "recompute"       # or "swap" (--preemption-mode)
    swap_space: int = 1 << 30                # bytes of the swap pool when preempting by swap (--swap-space)
    fused_decode: bool = True                # Llama-family decode steps through engine/fused.py (--no-compile)

    def token_budget(self, device_type: str) -> int:
        if self.max_num_batched_tokens:
            return self.max_num_batched_tokens
        # On a CPU a step of 1024 tokens already runs the matmuls at full speed, and a
        # smaller budget keeps decodes from stalling behind a long prompt.
        return 1024 if device_type == "cpu" else 8192
