"""LoRA adapters served beside their base model, chosen per token.

The engine packs every scheduled request of a step into one token row, so the
adapter is a property of each token, not of the step. `LoRALinear` wraps whatever
linear module the loader produced (packed bf16/float32, fbgemm int8, int4,
`nn.Linear`, bitsandbytes on CUDA: all of them have `in_features`,
`out_features` and a forward) and adds `scaling * B_a(A_a x)` to the rows of each
adapter `a`. From each step's (first token, end, slot) segments the manager builds
once a 0/1 mask [tokens, slots x rank], published in a `LoRAStep` every wrapper holds
by reference (docs/design.md sections 8 and 11), so
a wrapped layer adds every adapter's update in three calls whatever the mix:
`(x @ A_all^T) * mask`, then `addmm` with the stacked, pre-scaled B (vLLM's
BGMV idea in dense torch ops, measured faster here than a pair of matmuls per
segment). Base-model rows get a zero mask row.

Adapters' weights live in host memory; a fixed number of slots (`max_loras`, each of
rank up to `max_lora_rank`) hold the stacked A/B weights the forward reads, on the
model's device. An adapter a step needs is copied into a free slot, or into the
least recently used one no request of the step needs. The scheduler keeps the
adapters of running requests within the slots.

peft reads the files (its config class and weight loader); the serving path is ours.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from ruvllm_cli.errors import RuvllmError, UsageError

DEFAULT_MAX_LORAS = 4
DEFAULT_MAX_LORA_RANK = 16
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<part>[AB])(?:\.[^.]+)?\.weight$")


class AdapterError(UsageError):
    """An adapter that cannot be read or does not fit the base model."""


class AdapterNotFoundError(RuvllmError):
    http_status = 404


class AdapterInUseError(RuvllmError):
    http_status = 409


@dataclass
class LoRAModule:
    """One targeted linear layer: A [r, in], B [out, r], and alpha / r (or / sqrt r)."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


_uids = itertools.count(1)


@dataclass(eq=False)
class LoRAAdapter:
    """A loaded adapter. `uid` is unique per load (0 is the base model): it keys the
    adapter's slot and its prefix-cache blocks, so reloading a name never reuses
    blocks computed with the old weights."""

    name: str
    source: str
    modules: dict[str, LoRAModule]
    uid: int = field(default_factory=lambda: next(_uids))
    mixture = False   # X-LoRA's XLoRAAdapter (engine/xlora.py) says True

    @property
    def rank(self) -> int:
        return max(m.rank for m in self.modules.values())

    @property
    def nbytes(self) -> int:
        return sum(m.a.nbytes + m.b.nbytes for m in self.modules.values())

    def describe(self) -> str:
        targets = sorted({name.rsplit(".", 1)[-1] for name in self.modules})
        return f"{self.name} (rank {self.rank}, {len(self.modules)} layers: {', '.join(targets)})"


def adapter_dir(path: str | Path) -> Path | None:
    """`path` if it is a PEFT adapter directory, else None."""
    path = Path(path).expanduser()
    return path if (path / ADAPTER_CONFIG).is_file() else None


def quiet_bitsandbytes() -> None:
    """peft imports bitsandbytes where it is installed (`import_peft` keeps it from doing
    so where it can), and its CPU backend warns, on a CPU with AVX-512 BF16, that an
    optional kernel package (`kernels`) is missing: a fast path for its own 4-bit layers,
    which ruvllm never runs on a CPU. Said to our users at every --lora start, that line
    asks for a package they do not need."""
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


def import_peft() -> None:
    """Import peft, without bitsandbytes where that is not loaded already. peft imports
    bitsandbytes where it is installed, for its own 4-bit LoRA layers, which ruvllm never
    builds (it reads adapters' files with peft and wraps the layers itself), and
    bitsandbytes brings torch's compiler stack with it: 2.3 s and 46 MiB of the 6 s and
    169 MiB that importing peft added to a --lora start, measured in a process with a
    model loaded. Should a peft release need bitsandbytes to import, it is imported with
    it, as before."""
    import importlib
    import sys

    quiet_bitsandbytes()
    if "peft" in sys.modules or "bitsandbytes" in sys.modules:
        importlib.import_module("peft")
        return
    sys.modules["bitsandbytes"] = None   # type: ignore[assignment]  # find_spec: not installed
    try:
        importlib.import_module("peft")
    except ImportError:
        for module in [m for m in sys.modules if m == "peft" or m.startswith("peft.")]:
            del sys.modules[module]
        del sys.modules["bitsandbytes"]
        importlib.import_module("peft")
    finally:
        if sys.modules.get("bitsandbytes", True) is None:
            del sys.modules["bitsandbytes"]


def read_adapter(name: str, path: str | Path) -> Any:
    """Read a PEFT LoRA (or X-LoRA) adapter directory into host memory (float32),
    refusing what the serving path does not do, with the reason."""
    from ruvllm_cli.engine.tokenizer import imports_settled

    imports_settled()
    import_peft()
    from peft import PeftConfig
    from peft.utils import load_peft_weights

    path = Path(path).expanduser()
    if adapter_dir(path) is None:
        raise AdapterError(f"adapter {name}: {path} is not a PEFT adapter directory (no {ADAPTER_CONFIG})")
    try:
        config = PeftConfig.from_pretrained(str(path))
    except (OSError, ValueError, TypeError, KeyError, json.JSONDecodeError) as error:
        raise AdapterError(f"adapter {name}: cannot read {path / ADAPTER_CONFIG}: {error}") from None
    kind = str(getattr(config, "peft_type", "")).split(".")[-1].upper()
    if kind == "XLORA":
        from ruvllm_cli.engine.xlora import read_xlora

        return read_xlora(name, path)
    if kind != "LORA":
        raise AdapterError(f"adapter {name}: a {kind} adapter; ruvllm serves LoRA and X-LoRA adapters")
    _refuse_unsupported(name, config)
    if not any((path / f).is_file() for f in ADAPTER_WEIGHTS):
        raise AdapterError(f"adapter {name}: {path} has no {' or '.join(ADAPTER_WEIGHTS)}")
    try:
        weights = load_peft_weights(str(path), device="cpu")
    except Exception as error:  # noqa: BLE001 - safetensors/pickle errors of every kind
        raise AdapterError(f"adapter {name}: cannot read its weights: {error}") from None
    return LoRAAdapter(name, str(path), _modules(name, config, weights))


def _refuse_unsupported(name: str, config: Any) -> None:
    """What peft's config says that changes the forward beyond x @ A^T @ B^T * scaling:
    served from the weights alone, such an adapter gave other tokens than peft's with
    nothing said (an activated LoRA applied to every token, replicated layers left out)."""
    merge = "merge it into the model with peft's merge_and_unload() instead"
    checks = [
        (getattr(config, "use_dora", False), "uses DoRA", merge),
        (getattr(config, "modules_to_save", None), "trains whole modules (modules_to_save)", merge),
        (getattr(config, "lora_bias", False), "trains a LoRA bias (lora_bias)", merge),
        (getattr(config, "fan_in_fan_out", False), "targets Conv1D layers (fan_in_fan_out)", merge),
        (getattr(config, "trainable_token_indices", None), "trains embedding rows (trainable_token_indices)", merge),
        (getattr(config, "use_bdlora", False), "is a block-diagonal LoRA (use_bdlora)", merge),
        (getattr(config, "use_qalora", False), "is a QA-LoRA (use_qalora), whose input is pooled by groups", merge),
        (getattr(config, "layer_replication", None), "replicates the base model's layers (layer_replication)",
         "serve the model peft builds with it, saved whole"),
        (getattr(config, "alora_invocation_tokens", None),
         "is an activated LoRA (alora_invocation_tokens), applied only from its invocation tokens on",
         "use peft, or a LoRA trained to apply throughout"),
        (getattr(config, "arrow_config", None), "routes between adapters (arrow_config)", "use peft"),
    ]
    for present, what, hint in checks:
        if present:
            raise AdapterError(f"adapter {name} {what}, which ruvllm does not serve; {hint}")


def _modules(name: str, config: Any, weights: dict[str, torch.Tensor]) -> dict[str, LoRAModule]:
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in weights.items():
        match = _KEY.match(key)
        if match is None:
            raise AdapterError(f"adapter {name}: unexpected tensor {key} (only lora_A/lora_B weights are served)")
        parts.setdefault(match["module"], {})[match["part"]] = tensor
    if not parts:
        raise AdapterError(f"adapter {name}: its weights file holds no LoRA tensors")
    _check_targets(name, config, list(parts))
    modules = {}
    for module, pair in sorted(parts.items()):
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"adapter {name}: {module} has lora_{''.join(pair)} without its pair")
        a, b = pair["A"].float(), pair["B"].float()
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise AdapterError(f"adapter {name}: {module} is not a linear LoRA pair "
                               f"(A {tuple(a.shape)}, B {tuple(b.shape)})")
        modules[module] = LoRAModule(a.contiguous(), b.contiguous(), _scaling(name, config, module, a.shape[0]))
    return modules


def _check_targets(name: str, config: Any, modules: list[str]) -> None:
    """The weights' layers are those the config's `target_modules` name (peft's own
    match: a list by name suffix, a string as a regex; "all-linear" takes any): an
    adapter whose config says other layers is refused, as peft refuses it ("Target
    modules ... not found"), not served from its weights alone."""
    from peft.tuners.tuners_utils import check_target_module_exists

    target = getattr(config, "target_modules", None)
    if not target or target == "all-linear":
        return
    try:
        stray = [module for module in modules if not check_target_module_exists(config, module)]
    except Exception:  # noqa: BLE001 - a config peft's matcher cannot read: the weights decide
        return
    if stray:
        named = sorted(target) if isinstance(target, (set, list, tuple)) else target
        raise AdapterError(f"adapter {name}: its weights hold {stray[0]}"
                           f"{f' (and {len(stray) - 1} more)' if len(stray) > 1 else ''}, which its "
                           f"{ADAPTER_CONFIG}'s target_modules ({named}) do not name")


def _scaling(name: str, config: Any, module: str, rank: int) -> float:
    """peft's rule: alpha / r, or alpha / sqrt(r) with rsLoRA; alpha per module from
    alpha_pattern (peft's own pattern match)."""
    from peft.utils.other import get_pattern_key

    pattern = getattr(config, "alpha_pattern", None) or {}
    alpha = pattern.get(get_pattern_key(pattern.keys(), module), config.lora_alpha)
    ranks = getattr(config, "rank_pattern", None) or {}
    said = ranks.get(get_pattern_key(ranks.keys(), module), config.r)
    if not is_number(alpha) or not is_number(said) or said <= 0:
        raise AdapterError(f"adapter {name}: lora_alpha and r must be numbers (r above 0), not "
                           f"{alpha!r} and {said!r}")
    if said != rank:   # peft refuses such an adapter too: its scaling would be another
        raise AdapterError(f"adapter {name}: {module} has weights of rank {rank}; its config says r={said}")
    return alpha / math.sqrt(rank) if getattr(config, "use_rslora", False) else alpha / rank


def is_number(value: Any) -> bool:
    """An int or a float, not a bool (JSON's numbers as json.load gives them)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# ---- the forward -----------------------------------------------------------------------------
@dataclass
class LoRAStep:
    """What the wrappers read during one forward: the LoRA tokens' mask, and (first
    token, end, X-LoRA adapter, scalings [tokens, layers, experts]) segments of X-LoRA
    tokens. No mask and no segment: the base model alone."""

    mixtures: list[tuple[int, int, Any, torch.Tensor]] = field(default_factory=list)
    # [tokens, columns of the slots up to the highest in use]: 1 where a token's slot owns the column
    mask: torch.Tensor | None = None

    def publish(self, num_tokens: int, segments: Sequence[tuple[int, int, int]], rank: int,
                dtype: torch.dtype, device: torch.device) -> None:
        """Set the mask the step's (start, end, slot) segments make (none without segments)."""
        self.mask = None
        if segments:
            mask = torch.zeros(num_tokens, (max(slot for _, _, slot in segments) + 1) * rank, dtype=dtype)
            for start, end, slot in segments:
                mask[start:end, slot * rank:(slot + 1) * rank] = 1
            self.mask = mask.to(device)

    def clear(self) -> None:
        self.mixtures, self.mask = [], None


class LoRALinear(nn.Module):
    """A base linear layer plus the adapters' low-rank updates for the rows that ask
    for them. The slots' weights are stacked: A [slots, R, in] and B transposed and
    multiplied by the adapter's scaling, [slots, R, out]; rows past a slot's rank,
    and slots whose adapter leaves this layer alone, are zero."""

    def __init__(self, base: nn.Module, step: LoRAStep, num_slots: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device, name: str = "") -> None:
        super().__init__()
        self.base_layer = base
        self.name = name
        self.in_features, self.out_features = int(base.in_features), int(base.out_features)
        self.step = step
        self.register_buffer("lora_a", torch.zeros(num_slots, max_rank, self.in_features, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("lora_b", torch.zeros(num_slots, max_rank, self.out_features, dtype=dtype, device=device),
                             persistent=False)
        self._kernel = _lora_kernel(dtype, device)

    def set_slot(self, slot: int, module: LoRAModule | None) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        if module is not None:
            rank = module.rank
            self.lora_a[slot, :rank].copy_(module.a)
            self.lora_b[slot, :rank].copy_(module.b.T * module.scaling)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base_layer(x)
        step = self.step
        if step.mask is None and not step.mixtures:
            return out
        rows = x.reshape(-1, self.in_features).to(self.lora_a.dtype)
        flat = out.view(-1, self.out_features)
        if step.mask is not None and self.adds_in_c(flat.shape[0], flat.dtype):
            # A decode step's rows: one C call (the C layer loop's), not four torch ones.
            self._add_in_c(rows, step.mask, flat)
        elif step.mask is not None and self._kernel is not None and flat.shape[0] <= C_ROWS:
            # bfloat16 outputs (int4's): the update in float32 by the same C function,
            # rounded once into them. torch's float32 matmul gave a row other bits among
            # other rows than alone, and the tokens of an adapter on q4k moved with the batch.
            update = torch.zeros(flat.shape, dtype=torch.float32, device=flat.device)
            self._add_in_c(rows, step.mask, update)
            flat += update.to(flat.dtype)
        elif step.mask is not None:
            width = step.mask.shape[1]
            shrunk = (rows @ self.lora_a.view(-1, self.in_features)[:width].T).mul_(step.mask)
            expand = self.lora_b.view(-1, self.out_features)[:width]
            if flat.dtype == shrunk.dtype:
                flat.addmm_(shrunk, expand)
            else:   # int4's bfloat16 output beside float32 activations
                flat += (shrunk @ expand).to(flat.dtype)
        for start, end, mixture, scalings in step.mixtures:
            self._mix(rows[start:end], flat[start:end], mixture, scalings)
        return out

    def _add_in_c(self, rows: torch.Tensor, mask: torch.Tensor, out: torch.Tensor) -> None:
        """decode_step.c's lora_add: each row's update from its slots (`mask`) added into
        `out` (float32), a row alone whatever the others."""
        rows = rows.contiguous()
        self._kernel.lora_add(rows.data_ptr(), rows.shape[0], self.in_features, self.lora_a.data_ptr(),
                              mask.shape[1], mask.data_ptr(), self.lora_b.data_ptr(), self.out_features,
                              out.data_ptr(), torch.get_num_threads())

    def adds_in_c(self, rows: int, dtype: torch.dtype) -> bool:
        """Whether the update of `rows` rows of `dtype` outputs is decode_step.c's lora_add
        (float32 slots on a CPU, a decode step's rows); the C layer loop takes a step's
        LoRA rows only then, so both loops add it the same way."""
        return self._kernel is not None and dtype == torch.float32 and rows <= C_ROWS

    def _mix(self, rows: torch.Tensor, out: torch.Tensor, mixture: Any, scalings: torch.Tensor) -> None:
        """X-LoRA: each expert's update of x scaled by the token's weight for it, in peft's order."""
        layer = mixture.layer_of.get(self.name)
        if layer is None:
            return
        weight = mixture.settings["global_scaling_weight"]
        for index, expert in enumerate(mixture.experts):
            module = expert.get(self.name)
            if module is not None:
                scaled = rows * scalings[:, layer, index:index + 1].to(rows.dtype)
                expanded = (scaled @ module.a.T) @ module.b.T
                out += (expanded * module.scaling * weight).to(out.dtype)


C_ROWS = 64   # rows up to which lora_add adds the update (decode steps); a prompt's take torch's GEMMs


def _lora_kernel(dtype: torch.dtype, device: torch.device) -> Any:
    """decode_step.c's lora_add for float32 slots on a CPU, or None (torch's matmuls)."""
    if torch.device(device).type != "cpu" or dtype != torch.float32:
        return None
    from ruvllm_cli.engine.kernels import decode_kernel

    return decode_kernel()


# ---- the registry and its slots ------------------------------------------------------------
class LoRAManager:
    """The adapters one engine serves by name, and the slots the forward reads.

    Only the engine thread calls `install`, `remove` and `begin_step`; `get` and
    `names` are plain dict reads, safe from any thread."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.model = model
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.dtype, self.device = compute_dtype(dtype, device), device
        self.adapters: dict[str, LoRAAdapter] = {}
        self.layers: dict[str, LoRALinear] = {}
        self.step = LoRAStep()
        self.slot_of: OrderedDict[int, int] = OrderedDict()   # uid -> slot, least recently used first
        self.loads = 0   # adapters copied into a slot (the first use and after evictions)

    # ---- registry ----
    def get(self, name: str) -> LoRAAdapter | None:
        return self.adapters.get(name)

    def names(self) -> list[str]:
        return list(self.adapters)

    def by_uid(self, uid: int) -> LoRAAdapter | None:
        return next((a for a in self.adapters.values() if a.uid == uid), None)

    def check(self, adapter: Any) -> None:
        """Refuse an adapter this model or these slots cannot take (before installing)."""
        if self.max_loras < 1:
            raise AdapterError("LoRA adapters are off (--max-loras 0)")
        if not adapter.mixture and adapter.rank > self.max_rank:
            raise AdapterError(f"adapter {adapter.name} has rank {adapter.rank}, above --max-lora-rank "
                               f"{self.max_rank}; start with --max-lora-rank {adapter.rank}")
        # Every expert's modules: an X-LoRA's `modules` holds one expert's per layer, and
        # an earlier expert made for another base had passed, then failed the engine.
        pairs = ([(name, module) for expert in adapter.experts for name, module in expert.items()]
                 if adapter.mixture else list(adapter.modules.items()))
        for name, module in pairs:
            layer = self._target(name)
            if layer is None:
                raise AdapterError(f"adapter {adapter.name} targets {name}, which this model does not "
                                   "have: it was trained for another base model")
            if isinstance(layer, LoRALinear):
                layer = layer.base_layer
            if not hasattr(layer, "in_features") or _is_embedding_or_head(self.model, name, layer):
                raise AdapterError(f"adapter {adapter.name} targets {name} ({type(layer).__name__}); ruvllm "
                                   "serves LoRA on the decoder's linear layers only")
            shape = (int(layer.out_features), int(layer.in_features))
            if (module.b.shape[0], module.a.shape[1]) != shape:
                raise AdapterError(f"adapter {adapter.name}: {name} is {module.b.shape[0]}x{module.a.shape[1]}, "
                                   f"the model's layer is {shape[0]}x{shape[1]}: another base model")

    def install(self, adapter: Any) -> None:
        """Serve `adapter` (a LoRAAdapter or an XLoRAAdapter) under its name."""
        if adapter.name in self.adapters:
            raise AdapterError(f"an adapter named {adapter.name} is already loaded")
        self.check(adapter)
        if adapter.mixture:
            from ruvllm_cli.engine.xlora import number_layers

            number_layers(self.model, adapter)
            adapter.to(self.dtype, self.device)   # its experts stay out of the slots
        for name in adapter.modules:
            self._wrap(name)
        self.adapters[adapter.name] = adapter

    def is_mixture(self, uid: int) -> bool:
        adapter = self.by_uid(uid)
        return adapter is not None and adapter.mixture

    def remove(self, name: str) -> LoRAAdapter:
        adapter = self.adapters.pop(name)
        slot = self.slot_of.pop(adapter.uid, None) if not adapter.mixture else None
        if slot is not None:
            for layer in self.layers.values():
                layer.set_slot(slot, None)
        return adapter

    # ---- the step ----
    def begin_step(self, num_tokens: int, segments: Sequence[tuple[int, int, int]],
                   mixtures: Sequence[tuple[int, int, Any, torch.Tensor]] = ()) -> None:
        """Point the wrappers at this step's (start, end, adapter uid) segments of its
        `num_tokens` packed tokens, bringing each adapter into a slot first, and at
        its X-LoRA segments."""
        needed = {uid for _, _, uid in segments}
        assert len(needed) <= self.max_loras, "the scheduler admits at most max_loras adapters"
        slots = {uid: self._slot(uid, needed) for uid in needed}
        self.step.publish(num_tokens, [(start, end, slots[uid]) for start, end, uid in segments],
                          self.max_rank, self.dtype, self.device)
        self.step.mixtures = list(mixtures)

    def end_step(self) -> None:
        self.step.clear()

    def _slot(self, uid: int, needed: set[int]) -> int:
        if uid in self.slot_of:
            self.slot_of.move_to_end(uid)
            return self.slot_of[uid]
        taken = set(self.slot_of.values())
        free = [s for s in range(self.max_loras) if s not in taken]
        if free:
            slot = free[0]
        else:
            victim = next(u for u in self.slot_of if u not in needed)
            slot = self.slot_of.pop(victim)
        adapter = self.by_uid(uid)
        assert adapter is not None, f"adapter uid {uid} is not loaded"
        for name, layer in self.layers.items():
            layer.set_slot(slot, adapter.modules.get(name))
        self.slot_of[uid] = slot
        self.loads += 1
        return slot

    def _target(self, name: str) -> nn.Module | None:
        try:
            return self.model.get_submodule(name)
        except AttributeError:
            return None

    def _wrap(self, name: str) -> None:
        if name in self.layers:
            return
        parent_name, _, child = name.rpartition(".")
        parent = self.model.get_submodule(parent_name) if parent_name else self.model
        base = getattr(parent, child)
        if isinstance(base, LoRALinear):  # another engine's wrapper around a shared model: replace it
            base = base.base_layer
        wrapper = LoRALinear(base, self.step, self.max_loras, self.max_rank, self.dtype, self.device, name)
        setattr(parent, child, wrapper)
        self.layers[name] = wrapper

    @property
    def slot_bytes(self) -> int:
        return sum(layer.lora_a.nbytes + layer.lora_b.nbytes for layer in self.layers.values())


def compute_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The adapters' dtype: the activations', except 16-bit on a CPU without bfloat16
    kernels (AVX-512), where their small matmuls would take a slow generic path: there
    float32 (q8 at 16 streams, 3 adapters: 0.53x of the base model's decode in bf16)."""
    if device.type == "cpu" and dtype in (torch.bfloat16, torch.float16):
        from ruvllm_cli.engine.quantize import cpu_has_bf16_kernels

        if not cpu_has_bf16_kernels():
            return torch.float32
    return dtype


def _is_embedding_or_head(model: nn.Module, name: str, layer: nn.Module) -> bool:
    if isinstance(layer, nn.Embedding) or "Embedding" in type(layer).__name__:
        return True
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return head is not None and layer is head
