"""A fused decode step for Llama-family models on a CPU (Llama, Qwen2, Mistral, Phi-3).

A decode step through transformers' layer code issues some 1,400 small ATen calls
besides its 169 linear layers (RMSNorm, RoPE, SiLU, residual adds, the attention's
gathers and softmax): 6 ms of a 31 ms q8 step on the 0.5B shape at one stream, 26 of
85 at sixteen (docs/design.md, section 21). Here each layer is its seven linear modules, as
loaded (packed, int8, int4, or wrapped for LoRA), and four C calls
(`kernels/decode_step.c`) for everything between them. Only steps made of decodes
alone take it; prompt chunks, X-LoRA and every other architecture keep the stock
forward, which is also the reference the tests compare it with.
"""

from __future__ import annotations

import ctypes
import operator
from dataclasses import dataclass
from itertools import repeat
from typing import Any

import torch
from torch import nn

from ruvllm_cli.engine import bf16, half, int4_dense, int8, native
from ruvllm_cli.engine.attention import PagedKVCache
from ruvllm_cli.engine.kernels import (LINEAR_BF16, LINEAR_F16, LINEAR_INT4, LINEAR_Q8, AttendStep, DecodeKernel,
                                       LayerPlan, LinearPlan, decode_kernel)
from ruvllm_cli.engine.lora import LoRALinear
from ruvllm_cli.engine.quantize import Int4Linear

FAMILIES = ("llama", "qwen2", "mistral", "phi3")
_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_FUSED_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")   # Phi-3's
# decode_step.c's array kinds (caches, activations, logits)
DTYPE_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@dataclass(frozen=True)
class DecodeBatch:
    """One step's decodes as the kernels read them: a token each."""

    input_ids: torch.Tensor   # [B] int64
    positions: torch.Tensor   # [1, B] int64
    slots: torch.Tensor       # [B] int64, the cache slot each new token is written to
    tables: torch.Tensor      # [B, W] int32 block ids, zero-padded
    lengths: torch.Tensor     # [B] int32 tokens cached after this step
    last_position: int = -1   # the furthest position among them (-1: not given)


class RopeTable:
    """A step's cos and sin [1, B, D], rows of tables the model's rotary module computed
    itself for positions 0..n-1 in one call (a position's values are the same operations
    on the same numbers as in a call of its own; tests hold them equal), grown 1,024
    positions at a time: the module's dozen small ATen calls cost 0.03-0.08 ms a step.
    Our own RotaryEmbedding (native.py) only, and not longrope's, whose frequencies
    depend on the step's furthest position; any other module is called each step."""

    def __init__(self, rotary: nn.Module) -> None:
        self.rotary = rotary
        self.ours = isinstance(rotary, native.RotaryEmbedding)
        self.tabled = self.ours and rotary.long_inv_freq is None
        self.tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, last: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.tabled or last < 0:
            # each decode is a sequence of its own (longrope's choice is per sequence)
            cos, sin = self.rotary(x, positions, positions) if self.ours else self.rotary(x, positions)
            return cos.contiguous(), sin.contiguous()
        table = self.tables.get(x.dtype)
        if table is None or table[0].shape[0] <= last:
            size = (last // 1024 + 1) * 1024
            cos, sin = self.rotary(x, torch.arange(size, device=x.device).unsqueeze(0))
            table = self.tables[x.dtype] = (cos[0], sin[0])
        at = positions.view(-1)
        return table[0].index_select(0, at).unsqueeze(0), table[1].index_select(0, at).unsqueeze(0)


class FusedDecoder:
    """Next-token logits [B, V] for a decode-only step, over the model's own modules."""

    def __init__(self, model: Any, kernel: DecodeKernel, dtype: torch.dtype, block_size: int,
                 kv_dtype: torch.dtype) -> None:
        inner, config = model.model, model.config
        self.kernel, self.block_size = kernel, block_size
        self.dtype, self.bf16 = dtype, int(dtype == torch.bfloat16)
        self.kv = DTYPE_KINDS[kv_dtype]
        self.embed, self.lm_head = inner.embed_tokens, model.lm_head
        self.rotary = RopeTable(inner.rotary_emb)
        self.layers = list(inner.layers)
        self.final_norm = _norm_args(inner.norm)
        # What a step reads of each layer, looked up once: the norms' weights and eps, and
        # the attention's and MLP's module dicts, read at each call (an adapter installed
        # later replaces a linear module in its dict). Module.__getattr__ and __call__ cost
        # about 0.3 ms a step at one stream (section 21).
        self.norms = [(_norm_args(layer.input_layernorm), _norm_args(layer.post_attention_layernorm))
                      for layer in self.layers]
        self.modules = [(layer.self_attn._modules, layer.mlp._modules) for layer in self.layers]
        attn = self.layers[0].self_attn
        self.head_dim = int(attn.head_dim)
        self.q_heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.q_heads)
        self.scaling = float(attn.scaling)
        self.window = native.layer_windows(config)[0] or 0   # one for every layer (supported)
        self.hidden = int(config.hidden_size)
        self.qkv_sizes = (self.q_heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim)
        self.intermediate = int(config.intermediate_size)
        # Where every linear layer is one of our kernels, the whole layer loop is one C call.
        self.layers_in_c = True   # tests and benchmarks turn it off to compare
        self.zero_linears = False   # scripts/bench_fused.py's "other": the C loop's linear layers answer zeros
        self._phi3 = "qkv_proj" in self.modules[0][0]
        self.c_steps = 0
        self._plans: LayerPlans | None = None
        self._plan_modules: list[tuple[nn.Module, ...]] | None = None
        self._module_attrs: list[dict[str, Any]] = []
        # One of the plan's adapter wrappers: all come from one LoRAManager (the same
        # dtype, device and kernel) and read one LoRAStep. None: no adapters installed.
        self._lora: LoRALinear | None = None

    @torch.inference_mode()
    def __call__(self, batch: DecodeBatch, cache: PagedKVCache) -> torch.Tensor:
        x = self.embed(batch.input_ids)                                   # [B, H]
        if x.dtype != self.dtype:   # an untied q8 table gives bfloat16 rows; the kernels read x as the model's dtype
            x = x.to(self.dtype)
        cos, sin = self.rotary(x, batch.positions, batch.last_position)   # [1, B, D] each, contiguous
        rows = x.shape[0]
        h = torch.empty_like(x)
        attended = x.new_empty(rows, self.q_heads * self.head_dim)
        delta = None
        threads = torch.get_num_threads()
        kernel = self.kernel
        # What every layer's RoPE + attention call shares, set once (the tensors it points
        # into live to the end of the step).
        step = AttendStep(cos.data_ptr(), sin.data_ptr(), rows, self.q_heads, self.kv_heads, self.head_dim,
                          cache.keys[0].shape[1], batch.slots.data_ptr(), batch.tables.data_ptr(),
                          batch.tables.shape[1], batch.lengths.data_ptr(), self.block_size, self.scaling,
                          attended.data_ptr(), self.bf16, self.kv, kernel.wide, threads, self.window)
        plans = self._layer_plans(rows) if self.layers_in_c else None
        if plans is not None:
            mask = None if self._lora is None else self._lora.step.mask
            if mask is not None:   # adapters' rows: their updates after each kernel, in C too
                step.lora_mask, step.lora_width = mask.data_ptr(), mask.shape[1]
            plans.run(self, step, cache, x, h, attended)
            self.c_steps += 1
            return self.lm_head(h)
        for index, ((before, after), (attn, mlp)) in enumerate(zip(self.norms, self.modules)):
            self._add_norm(x, delta, before, h, threads)
            q, k, v = self._qkv(attn, h)
            kernel.rope_attend(step, q.data_ptr(), k.data_ptr(), v.data_ptr(), cache.keys[index].data_ptr(),
                               cache.values[index].data_ptr())
            self._add_norm(x, _out(attn["o_proj"], attended), after, h, threads)
            gate, up = self._gate_up(mlp, h)
            kernel.silu_mul(gate.data_ptr(), up.data_ptr(), gate.numel(), self.bf16, kernel.wide, threads)
            delta = _out(mlp["down_proj"], gate)
        self._add_norm(x, delta, self.final_norm, h, threads)
        return self.lm_head(h)

    def _layer_plans(self, rows: int) -> "LayerPlans | None":
        """The C layer loop's plan for this step, or None where a linear layer is not one
        of our kernels at this many rows (another class, a forward replaced on the
        instance), for X-LoRA rows, for LoRA rows where the wrappers do not add their
        updates in C (bfloat16 activations: q4k), or for Phi-3's fused matrices. LoRA's
        wrappers (lora.LoRALinear) are looked through to their base layers: a step of
        the base model alone is their arithmetic, and a step with LoRA rows adds the
        updates by the function their forward calls (decode_step.c's lora_add)."""
        if self._phi3:
            return None
        # Each module dict's values as the plan saw them (identity: a module replaced since,
        # an adapter installed), compared a dict at a time in C rather than a module at a
        # time in Python (35 us a step).
        held = [tuple(group.values()) for attn, mlp in self.modules for group in (attn, mlp)]
        if held != self._plan_modules:
            self._plan_modules = held
            modules = [group[name] for attn, mlp in self.modules
                       for group, names in ((attn, _LINEARS[:4]), (mlp, _LINEARS[4:])) for name in names]
            wrappers = [m for m in modules if isinstance(m, LoRALinear)]
            self._plans = LayerPlans.build(self, modules)
            self._module_attrs = [m.__dict__ for m in [_base(m) for m in modules] + wrappers]
            self._lora = wrappers[0] if wrappers else None
        plans = self._plans
        if plans is None or rows > plans.max_rows or (
                not self.zero_linears and any(map(operator.contains, self._module_attrs, repeat("forward")))):
            return None   # a forward replaced on an instance runs as replaced
        lora = self._lora
        if lora is not None and (lora.step.mixtures or (lora.step.mask is not None
                                                        and not lora.adds_in_c(rows, self.dtype))):
            return None   # adapters' rows the C loop does not take: the wrappers add their updates
        return plans if plans.kernels_run() else None

    def _qkv(self, attn: dict[str, nn.Module], h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if "qkv_proj" in attn:   # Phi-3: one matrix; the kernels take each part contiguous
            return tuple(part.contiguous() for part in _out(attn["qkv_proj"], h).split(self.qkv_sizes, dim=1))
        return _out(attn["q_proj"], h), _out(attn["k_proj"], h), _out(attn["v_proj"], h)

    @staticmethod
    def _gate_up(mlp: dict[str, nn.Module], h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if "gate_up_proj" in mlp:
            gate, up = _out(mlp["gate_up_proj"], h).chunk(2, dim=1)
            return gate.contiguous(), up.contiguous()
        return _out(mlp["gate_proj"], h), _out(mlp["up_proj"], h)

    def _add_norm(self, x: torch.Tensor, delta: torch.Tensor | None, norm: tuple[torch.Tensor, float],
                  out: torch.Tensor, threads: int) -> None:
        """x += delta (in place), out = norm(x); `norm`: its weight and eps."""
        self.kernel.add_rms_norm(x.data_ptr(), None if delta is None else delta.data_ptr(), norm[0].data_ptr(),
                                 out.data_ptr(), x.shape[0], self.hidden, norm[1], self.bf16, self.kernel.wide,
                                 threads)


class LayerPlans:
    """Every layer as decode_step.c's LayerPlan array, for `ruvllm_decode_layers`: one C
    call a step runs the norms, the linear kernels the modules would call (same arrays,
    same order, so the same bits), RoPE + attention and SiLU * up. The modules' own
    forwards cost about 8 us a call in Python around their kernel (an output tensor,
    checks, a ctypes call converting ten arguments): 1.3 ms of a one-stream q8 step."""

    def __init__(self, array: Any, shapes: list[tuple[int, int, int, int]], max_rows: float,
                 kernels: dict[int, Any], held: list[torch.Tensor]) -> None:
        self.array, self.shapes, self.max_rows = array, shapes, max_rows
        self.kernels = kernels   # each kind's kernel object, as its modules hold it (int4: None, the module asks)
        self.kinds = set(kernels)
        self.held = held   # the tensors the plan points into, kept alive with it
        self.cache_at: tuple[int, ...] = ()

    @classmethod
    def build(cls, decoder: FusedDecoder, modules: list[nn.Module]) -> "LayerPlans | None":
        """The plan of `modules` (LoRA wrappers among them: their base layers, with
        their slots' A and B for the steps with adapter rows)."""
        plans = [_linear_plan(_base(m), decoder.dtype) for m in modules]
        if any(p is None for p in plans):
            return None
        for plan, module in zip(plans, modules):
            if isinstance(module, LoRALinear):
                plan[0].lora_a, plan[0].lora_b = module.lora_a.data_ptr(), module.lora_b.data_ptr()
                plan[2].extend((module.lora_a, module.lora_b))
        array = (LayerPlan * len(decoder.layers))()
        held: list[torch.Tensor] = []
        for index, ((before, after), plan) in enumerate(zip(decoder.norms, array)):
            for name, (linear, _, tensors) in zip(("q", "k", "v", "o", "gate", "up", "down"), plans[7 * index:7 * index + 7]):
                setattr(plan, name, linear)
                held += tensors
            plan.norm_in, plan.eps_in = before[0].data_ptr(), before[1]
            plan.norm_post, plan.eps_post = after[0].data_ptr(), after[1]
            held += [before[0], after[0]]
        shapes = sorted({(p[0].kind, p[0].in_, p[0].out, p[0].group) for p in plans})
        kernels = {p[0].kind: getattr(_base(m), "_kernel", None) for p, m in zip(plans, modules)}
        return cls(array, shapes, min(p[1] for p in plans), kernels, held)

    def kernels_run(self) -> bool:
        """Whether the int4 kernel still runs (q4k's layers ask at each call: not after
        `--no-compile`'s turn_off)."""
        if LINEAR_INT4 not in self.kinds:
            return True
        return int4_dense.own_runs()

    def kernel_table(self, zero: bool) -> Any:
        """The linear kernels' addresses by kind, read at each step (tests swap the int8
        GEMV on its kernel object); with `zero`, none: a NULL kernel leaves its output as
        given (bench_fused.py's zeros)."""
        table = (ctypes.c_void_p * 4)()
        for kind, kernel in ({} if zero else self.kernels).items():
            function = int4_dense.own_kernel().linear if kind == LINEAR_INT4 else kernel.linear_few if kind == LINEAR_Q8 \
                else kernel.linear
            table[kind] = ctypes.cast(function, ctypes.c_void_p).value
        return table

    def room_bytes(self, rows: int) -> int:
        """The largest scratch any of the kernels asks for `rows` rows (what the modules
        ask of scratch_buffer, by the same functions)."""
        need = 0
        for kind, width, out, group in self.shapes:
            if kind == LINEAR_Q8:
                need = max(need, int8.scratch_bytes(rows, width, out))
            elif kind == LINEAR_BF16:
                need = max(need, 4 * bf16.scratch_floats(rows, width))
            elif kind == LINEAR_INT4:
                need = max(need, 4 * int4_dense.scratch_floats(rows, width, group))
        return need   # the float16 kernel works in registers

    def run(self, decoder: FusedDecoder, step: AttendStep, cache: PagedKVCache, x: torch.Tensor, h: torch.Tensor,
            attended: torch.Tensor) -> None:
        at = (cache.keys[0].data_ptr(), cache.values[0].data_ptr())
        if at != self.cache_at:   # the pools' addresses, read once per cache
            for plan, keys, values in zip(self.array, cache.keys, cache.values):
                plan.k_cache, plan.v_cache = keys.data_ptr(), values.data_ptr()
            self.cache_at = at
        rows = x.shape[0]
        q_size, kv_size = decoder.qkv_sizes[0], decoder.qkv_sizes[1]
        # Zeros where the linear layers do not run (bench_fused.py): every later write to
        # these arrays (RoPE, SiLU * up, in place) keeps a zero a zero.
        make = x.new_zeros if decoder.zero_linears else x.new_empty
        q, k, v = (make(rows, size) for size in (q_size, kv_size, kv_size))
        o, down = make(rows, decoder.hidden), make(rows, decoder.hidden)
        gate, up = (make(rows, decoder.intermediate) for _ in range(2))
        room = torch.empty(self.room_bytes(rows), dtype=torch.int8)
        table = self.kernel_table(decoder.zero_linears)
        decoder.kernel.decode_layers(step, self.array, len(self.array), table, x.data_ptr(),
                                     h.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(),
                                     gate.data_ptr(), up.data_ptr(), down.data_ptr(), room.data_ptr(), decoder.hidden,
                                     decoder.final_norm[0].data_ptr(), decoder.final_norm[1])


def _base(module: nn.Module) -> nn.Module:
    """A LoRA wrapper's base layer; any other module itself."""
    return module.base_layer if isinstance(module, LoRALinear) else module


def _linear_plan(module: nn.Module, dtype: torch.dtype) -> tuple[LinearPlan, float, list[torch.Tensor]] | None:
    """A linear module as decode_step.c's LinearPlan, the most rows its kernel takes, and
    the tensors it points into; None where it is not one of our kernels for `dtype`."""
    kind, bias = type(module), getattr(module, "bias", None)
    buffers = module._buffers
    if kind is int8.Int8Linear and dtype == torch.float32:
        tensors = [buffers["qweight"], buffers["scales"]]
        plan = LinearPlan(LINEAR_Q8, module.out_features, module.in_features, 0, tensors[0].data_ptr(),
                          tensors[1].data_ptr(), None)
        rows: float = module._kernel.rows
    elif kind is bf16.Bf16Linear and dtype == torch.bfloat16:
        tensors = [buffers["weight"]]
        plan = LinearPlan(LINEAR_BF16, module.out_features, module.in_features, 0, tensors[0].data_ptr(), None, None)
        rows = bf16.GEMM_ROWS - 1
    elif kind is half.HalfLinear and dtype == torch.float32:
        tensors = [buffers["blocks16"]]
        plan = LinearPlan(LINEAR_F16, module.out_features, module.in_features, 0, tensors[0].data_ptr(), None, None)
        rows = float("inf")
    elif kind is Int4Linear and dtype == torch.bfloat16:
        packed, scales, group = buffers["qweight"], buffers["scales_and_zeros"], module.group_size
        if not int4_dense.own_takes(packed, group):
            return None   # own_linear declines it too
        tensors = [packed, scales]
        plan = LinearPlan(LINEAR_INT4, module.out_features, module.in_features, group, packed.data_ptr(),
                          scales.data_ptr(), None)
        rows = float("inf")
    else:
        return None
    if bias is not None:
        tensors.append(bias)
        plan.bias = bias.data_ptr()
    return plan, rows, tensors


def _norm_args(norm: nn.Module) -> tuple[torch.Tensor, float]:
    return norm.weight, float(norm.variance_epsilon)


def _out(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A linear layer's output as the kernels read it: contiguous, in x's dtype. Its
    forward is called directly: no hooks are set on the engine's models."""
    y = linear.forward(x)
    if y.dtype != x.dtype:
        y = y.to(x.dtype)
    return y if y.is_contiguous() else y.contiguous()


def fused_decoder(model: Any, dtype: torch.dtype, device: torch.device, block_size: int,
                  kv_dtype: torch.dtype | None = None) -> FusedDecoder | None:
    """The fused decode step for this model, or None where it does not apply (another
    architecture or device, an unusual layer, no kernel: RUVLLM_COMPILE=0 or no compiler)."""
    kv_dtype = kv_dtype or dtype
    if (device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16) or kv_dtype not in DTYPE_KINDS
            or not supported(model, dtype)):
        return None
    kernel = decode_kernel()
    return None if kernel is None else FusedDecoder(model, kernel, dtype, block_size, kv_dtype)


def supported(model: Any, dtype: torch.dtype) -> bool:
    """Whether every layer is the plain Llama shape the kernels compute: q/k/v/o and
    gate/up/down modules (Phi-3's q/k/v and gate/up fused), RMSNorms, SiLU, a rotary
    module giving [1, T, D] tables, head and intermediate sizes the AVX2 loops take."""
    config = getattr(model, "config", None)
    inner = getattr(model, "model", None)
    if config is None or inner is None or getattr(config, "model_type", None) not in FAMILIES:
        return False
    if config.hidden_act != "silu" or not hasattr(inner, "rotary_emb") or not hasattr(model, "lm_head"):
        return False
    if (getattr(config, "rope_parameters", None) or {}).get("partial_rotary_factor", 1.0) != 1.0:
        return False   # the kernels rotate whole heads
    if len(set(native.layer_windows(config))) > 1:
        return False   # the kernel takes one sliding window for every layer
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim % 8 or config.intermediate_size % 8:
        return False
    norms = [inner.norm] + [n for layer in inner.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    if any(not hasattr(n, "variance_epsilon") or n.weight.dtype != dtype for n in norms):
        return False
    names = _FUSED_LINEARS if config.model_type == "phi3" else _LINEARS
    return all(hasattr(layer.self_attn, name) or hasattr(layer.mlp, name) for layer in inner.layers for name in names)
