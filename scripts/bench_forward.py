#!/usr/bin/env python
"""The engine's decode step through transformers' layer code (A) against a minimal
hand-written forward over the very same modules (B), inside one engine.

B is a measurement, not engine code: it runs Llama/Qwen2-style decoder layers by
calling the loaded model's own embedding, q/k/v/o and gate/up/down modules (packed,
int8 or int4 as loaded), norm weights, rotary frequencies and LM head, and the
engine's paged attention (`attention.paged_attention_forward`) with the step's own
StepMetadata; `ModelRunner.execute` builds the step for both, only the model it
calls differs. Every decode step runs A and B (the order flips each step, so
neither always goes first), then the step's linear layers alone on the inputs B
gave them. Printed: median ms per step, operator calls per step (torch.profiler
events: those the Python code issues, and all dispatched, nested ones included),
the largest |logit difference| between A and B and how often their argmax agrees.

    .venv/bin/python scripts/bench_forward.py [--quantization f16|q4k|q8] [--steps 40]
    .venv/bin/python scripts/bench_forward.py --quantization none --check   # exactness
    .venv/bin/python scripts/bench_forward.py --quantization q8 --float32-activations
    .venv/bin/python scripts/bench_forward.py --quantization none --compiled-pieces

--float32-activations loads q8/q4k with float32 instead of bfloat16 activations (the
loader's dtype and the int8 embedding's output patched here; a probe, not an option
of the engine). --compiled-pieces makes B call its elementwise work (add + RMSNorm,
RoPE of q and k, SiLU * up) through four `torch.compile`d functions per layer.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time
from collections import Counter
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from ruvllm_cli.bench.harness import script_model, script_parser  # noqa: E402
from ruvllm_cli.bench.runner import random_prompts  # noqa: E402
from ruvllm_cli.engine import attention  # noqa: E402
from ruvllm_cli.engine.config import EngineConfig  # noqa: E402
from ruvllm_cli.engine.engine import LLMEngine  # noqa: E402
from ruvllm_cli.engine.int8 import Int8Linear  # noqa: E402
from ruvllm_cli.engine.quantize import DynamicInt8Linear, Int4Linear, PackedLinear  # noqa: E402
from ruvllm_cli.engine.sampling import SamplingParams  # noqa: E402
from ruvllm_cli.quantization import parse_quantization  # noqa: E402

LINEAR_TYPES = (nn.Linear, PackedLinear, Int4Linear, DynamicInt8Linear, Int8Linear)
MAX_LOAD = 1.5      # 1-minute load above which a phase waits (2 cores, other work beside us)
LOAD_POLL_S = 30


class OpCounter:
    """Counts, with torch.profiler, the operator calls made inside it: `issued` are the
    ones the Python code makes (F.linear or F.rms_norm count once), `dispatched` adds
    the ops those run inside them (rms_norm's pow, mean, rsqrt ...; linear's addmm)."""

    def __enter__(self) -> "OpCounter":
        # kineto writes two lines to stderr per profile: keep them off the terminal.
        sys.stderr.flush()
        self.saved_stderr = os.dup(2)
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
        self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        self.profiler.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.profiler.__exit__(*exc)
        os.dup2(self.saved_stderr, 2)
        os.close(self.saved_stderr)
        events = [e for e in self.profiler.events() if "::" in e.name]
        self.dispatched = Counter(e.name for e in events)
        self.issued = Counter(e.name for e in events if e.cpu_parent is None or "::" not in e.cpu_parent.name)


class HandForward:
    """Llama/Qwen2/Mistral-style decoder layers written out over a loaded model's own
    modules; called like the model by `ModelRunner.execute`, on the packed [T, H] rows."""

    def __init__(self, model: Any) -> None:
        inner, config = model.model, model.config
        rotary = inner.rotary_emb
        layer = inner.layers[0]
        if not (hasattr(layer.self_attn, "q_proj") and hasattr(layer.mlp, "gate_proj")):
            raise SystemExit(f"{type(model).__name__}: B covers separate q/k/v and gate/up layers only")
        if config.hidden_act != "silu" or "dynamic" in rotary.rope_type:
            raise SystemExit("B covers SiLU MLPs and static RoPE only")
        self.embed, self.layers, self.norm = inner.embed_tokens, list(inner.layers), inner.norm
        self.lm_head = model.lm_head
        self.inv_freq = rotary.inv_freq.float()
        self.rope_scale = float(rotary.attention_scaling)
        self.head_dim = layer.self_attn.head_dim
        self.dtype = inner.norm.weight.dtype

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                 logits_to_keep: torch.Tensor, ruvllm_step: attention.StepMetadata, **_: object
                 ) -> SimpleNamespace:
        x = self.embed(input_ids[0])                                   # [T, H]
        cos, sin = self._rope_tables(position_ids[0])
        for layer in self.layers:
            x = self._layer(layer, x, cos, sin, ruvllm_step)
        # The kept rows are distinct and ascending: all T of them iff there are T.
        if logits_to_keep.numel() != x.shape[0]:
            x = x.index_select(0, logits_to_keep)
        return SimpleNamespace(logits=self.lm_head(self._rms(x, self.norm)).unsqueeze(0))

    def _rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin [T, 1, D], once per step for every layer:
        x*cos + roll(x, D/2)*sin equals transformers' x*cos + rotate_half(x)*sin (the
        roll swaps the halves; rotate_half's minus moves into sin, an exact negation)."""
        freqs = positions.unsqueeze(1).float() * self.inv_freq         # [T, D/2]
        cos, sin = freqs.cos(), freqs.sin()
        if self.rope_scale != 1.0:
            cos, sin = cos * self.rope_scale, sin * self.rope_scale
        cos = torch.cat((cos, cos), -1).to(self.dtype).unsqueeze(1)
        sin = torch.cat((-sin, sin), -1).to(self.dtype).unsqueeze(1)
        return cos, sin

    def _layer(self, layer: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               step: attention.StepMetadata) -> torch.Tensor:
        attn, mlp = layer.self_attn, layer.mlp
        h = self._rms(x, layer.input_layernorm)
        q = self._rope(attn.q_proj(h), cos, sin)                       # [1, T, Hq, D]
        k = self._rope(attn.k_proj(h), cos, sin)
        v = attn.v_proj(h).view(1, x.shape[0], -1, self.head_dim)
        out, _ = attention.paged_attention_forward(attn, q.transpose(1, 2), k.transpose(1, 2),
                                                   v.transpose(1, 2), None, attn.scaling,
                                                   ruvllm_step=step)  # [1, T, Hq, D]
        x = x + attn.o_proj(out.view(x.shape[0], -1))
        h = self._rms(x, layer.post_attention_layernorm)
        return x + mlp.down_proj(F.silu(mlp.gate_proj(h)).mul_(mlp.up_proj(h)))

    def _rope(self, y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        y = y.view(1, y.shape[0], -1, self.head_dim)
        return torch.addcmul(y * cos, y.roll(self.head_dim // 2, -1), sin)

    @staticmethod
    def _rms(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        # One aten::rms_norm, with Qwen2RMSNorm/LlamaRMSNorm's float32 arithmetic inside
        # (pow, mean, add, rsqrt, mul, mul); in bfloat16 it rounds once, after the
        # weight, where transformers also rounds before it.
        return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)


class CompiledPieces(HandForward):
    """B with the work between the matmuls in `torch.compile`d pieces (inductor's C++
    code): per layer, add + RMSNorm twice, RoPE of q and k, SiLU(gate) * up; the
    residual add of the MLP moves into the next layer's add + RMSNorm."""

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        compiled = torch.compile(dynamic=True)
        self.norm_in = compiled(_norm)
        self.add_norm = compiled(_add_norm)
        self.rope_qk = compiled(_rope_qk)
        self.silu_mul = compiled(_silu_mul)

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                 logits_to_keep: torch.Tensor, ruvllm_step: attention.StepMetadata, **_: object
                 ) -> SimpleNamespace:
        x = self.embed(input_ids[0])
        cos, sin = self._rope_tables(position_ids[0])
        mlp_out = None
        for layer in self.layers:
            attn, mlp, norm = layer.self_attn, layer.mlp, layer.input_layernorm
            if mlp_out is None:
                h = self.norm_in(x, norm.weight, norm.variance_epsilon)
            else:
                x, h = self.add_norm(x, mlp_out, norm.weight, norm.variance_epsilon)
            q, k = self.rope_qk(attn.q_proj(h), attn.k_proj(h), cos, sin, self.head_dim)
            v = attn.v_proj(h).view(1, x.shape[0], -1, self.head_dim)
            out, _ = attention.paged_attention_forward(attn, q, k, v.transpose(1, 2), None, attn.scaling,
                                                       ruvllm_step=ruvllm_step)
            norm = layer.post_attention_layernorm
            x, h = self.add_norm(x, attn.o_proj(out.view(x.shape[0], -1)), norm.weight, norm.variance_epsilon)
            mlp_out = mlp.down_proj(self.silu_mul(mlp.gate_proj(h), mlp.up_proj(h)))
        x = x + mlp_out
        if logits_to_keep.numel() != x.shape[0]:
            x = x.index_select(0, logits_to_keep)
        return SimpleNamespace(logits=self.lm_head(self._rms(x, self.norm)).unsqueeze(0))


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _add_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
    x = x + delta
    return x, F.rms_norm(x, (x.shape[-1],), weight, eps)


def _rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
    q, k = q.view(1, q.shape[0], -1, head_dim), k.view(1, k.shape[0], -1, head_dim)
    return (torch.addcmul(q * cos, q.roll(head_dim // 2, -1), sin).transpose(1, 2),
            torch.addcmul(k * cos, k.roll(head_dim // 2, -1), sin).transpose(1, 2))


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def float32_activations() -> None:
    """q8/q4k with float32 activations: the loader's dtype and the int8 embedding's
    output, patched for this process."""
    from ruvllm_cli.engine import loader, quantize

    loader.dtype_for = lambda quantization, device: torch.float32
    quantize.Int8Embedding.forward = (
        lambda self, ids: self.qweight[ids].float() * self.scales[ids].float().unsqueeze(-1))


class StepPair:
    """Stands in for `ModelRunner.execute`: each step runs through A (the stock model)
    and B (HandForward), A's result goes on to the sampler. Of the decode steps with
    `batch` requests, the first `warmup` are untimed, the next captures the linear
    layers' inputs, `steps` are timed, and one more counts ops."""

    def __init__(self, runner: Any, hand: HandForward, batch: int, warmup: int, steps: int) -> None:
        self.runner, self.execute = runner, runner.execute
        self.models = {"A": runner.model, "B": hand}
        self.batch, self.warmup, self.steps = batch, warmup, steps
        self.check_prefill = False   # also run B on prompt steps and compare their logits
        self.times: dict[str, list[float]] = {"A": [], "B": [], "linear": []}
        self.cpu_times: dict[str, list[float]] = {"A": [], "B": [], "linear": []}
        self.ops: dict[str, OpCounter] = {}
        self.max_diff = {"prefill": 0.0, "decode": 0.0}
        self.argmax_rows = [0, 0]   # decode rows where A's and B's argmax agree, all decode rows
        self.linear_calls: list[tuple[nn.Module, torch.Tensor]] = []
        self.decode_steps = 0

    @property
    def done(self) -> bool:
        return self.decode_steps > self.warmup + 1 + self.steps

    def _mode(self, chunks: list[Any]) -> str:
        if len(chunks) != self.batch or any(c.num_new_tokens != 1 for c in chunks):
            return "prefill"
        index, self.decode_steps = self.decode_steps, self.decode_steps + 1
        if index < self.warmup:
            return "warmup"
        if index == self.warmup:
            return "capture"
        return "timed" if index <= self.warmup + self.steps else "count"

    def __call__(self, chunks: list[Any]) -> tuple[torch.Tensor | None, list[Any]]:
        mode = self._mode(chunks)
        if mode == "prefill" and not self.check_prefill:
            return self._run("A", chunks, mode)   # prompts only fill the cache: once is enough
        order = ("B", "A") if self.decode_steps % 2 else ("A", "B")
        results = {name: self._run(name, chunks, mode) for name in order}
        if mode in ("timed", "count"):
            self._run_linears(mode)
        if results["A"][0] is not None:
            self._compare(results["A"][0], results["B"][0], "prefill" if mode == "prefill" else "decode")
        return results["A"]

    def _compare(self, a: torch.Tensor, b: torch.Tensor, kind: str) -> None:
        self.max_diff[kind] = max(self.max_diff[kind], (a.float() - b.float()).abs().max().item())
        if kind == "decode":
            self.argmax_rows[0] += int((a.argmax(-1) == b.argmax(-1)).sum())
            self.argmax_rows[1] += a.shape[0]

    def _run(self, name: str, chunks: list[Any], mode: str) -> tuple[torch.Tensor | None, list[Any]]:
        self.runner.model = self.models[name]
        hooks = self._capture_hooks() if mode == "capture" and name == "B" else []
        counter = OpCounter() if mode == "count" else nullcontext()
        try:
            with counter:
                start, cpu = time.perf_counter(), time.process_time()
                result = self.execute(chunks)
                spent, cpu = time.perf_counter() - start, time.process_time() - cpu
        finally:
            self.runner.model = self.models["A"]
            for hook in hooks:
                hook.remove()
        if mode == "timed":
            self.times[name].append(spent)
            self.cpu_times[name].append(cpu)
        if mode == "count":
            self.ops[name] = counter
        return result

    def _capture_hooks(self) -> list[Any]:
        def keep(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            self.linear_calls.append((module, args[0].clone()))

        model = self.models["A"]
        return [m.register_forward_pre_hook(keep) for m in model.modules() if isinstance(m, LINEAR_TYPES)]

    @torch.inference_mode()
    def _run_linears(self, mode: str) -> None:
        """The step's linear layers alone: the same modules on B's inputs, in order."""
        counter = OpCounter() if mode == "count" else nullcontext()
        with counter:
            start, cpu = time.perf_counter(), time.process_time()
            for module, rows in self.linear_calls:
                module(rows)
            spent, cpu = time.perf_counter() - start, time.process_time() - cpu
        if mode == "timed":
            self.times["linear"].append(spent)
            self.cpu_times["linear"].append(cpu)
        else:
            self.ops["linear"] = counter


def one_minute_load() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def wait_for_quiet(max_wait: float) -> float:
    """Waits while the 1-minute load is above MAX_LOAD (up to max_wait seconds);
    returns the load the phase starts at."""
    waited = 0.0
    while (load := one_minute_load()) > MAX_LOAD and waited < max_wait:
        print(f"load {load:.2f} > {MAX_LOAD}: waiting {LOAD_POLL_S} s", file=sys.stderr)
        time.sleep(LOAD_POLL_S)
        waited += LOAD_POLL_S
    return load


def prompt_lengths(batch: int, prompt: int, rng: random.Random) -> list[int]:
    """One prompt of `prompt` tokens, or `batch` unequal ones around it."""
    return [prompt] if batch == 1 else [rng.randint(prompt // 2, prompt * 3 // 2) for _ in range(batch)]


def run_phase(engine: LLMEngine, batch: int, args: Any, rng: random.Random) -> dict[str, Any]:
    """Decode `batch` requests until StepPair has its steps; returns the phase's figures."""
    load = wait_for_quiet(args.max_wait)
    forward = CompiledPieces if args.compiled_pieces else HandForward
    pair = StepPair(engine.runner, forward(engine.loaded.model), batch, args.warmup, args.steps)
    pair.check_prefill = args.check
    engine.runner.execute = pair
    vocab = engine.loaded.model.config.vocab_size
    params = SamplingParams(max_tokens=args.warmup + args.steps + 32, temperature=0.0, ignore_eos=True)
    lengths = prompt_lengths(batch, args.prompt, rng)
    requests = [engine.add_request(random_prompts(range(10, vocab), 1, n, rng)[0], params) for n in lengths]
    try:
        while not pair.done:
            engine.step()
    finally:
        del engine.runner.execute   # the class's own method again
        for request in requests:
            engine.abort(request.request_id)
    return phase_figures(pair, batch, lengths, load)


def phase_figures(pair: StepPair, batch: int, lengths: list[int], load: float) -> dict[str, Any]:
    ms = {name: statistics.median(values) * 1e3 for name, values in pair.times.items()}
    pairs = list(zip(pair.times["A"], pair.times["B"]))
    issued = {name: sum(c.issued.values()) for name, c in pair.ops.items()}
    dispatched = {name: sum(c.dispatched.values()) for name, c in pair.ops.items()}
    return {
        "batch": batch, "prompt_lengths": lengths, "load_start": load, "load_end": one_minute_load(),
        "timed_steps": len(pair.times["A"]), "ms_A": ms["A"], "ms_B": ms["B"], "ms_linear": ms["linear"],
        "ratio_A_over_B": ms["A"] / ms["B"],
        # Per-step pairs share the machine's state of that moment: their median ratio
        # is the steadier figure when the load moves during the run.
        "median_step_ratio": statistics.median(a / b for a, b in pairs),
        "median_step_saving_ms": statistics.median(a - b for a, b in pairs) * 1e3,
        "step_ms": {name: [round(t * 1e3, 3) for t in values] for name, values in pair.times.items()},
        "ms_other_A": ms["A"] - ms["linear"],
        "ms_other_B": ms["B"] - ms["linear"], "linear_calls": len(pair.linear_calls),
        # CPU time of the whole process (all threads): unlike wall time, it leaves out
        # the time other work on the machine held our cores; with --threads 1 it is
        # the cleanest figure here.
        "cpu_ms": {name: statistics.median(values) * 1e3 for name, values in pair.cpu_times.items()},
        "ops_issued": issued, "ops_dispatched": dispatched,
        "ops_issued_by_name": {name: dict(c.issued.most_common()) for name, c in pair.ops.items()},
        "ops_dispatched_by_name": {name: dict(c.dispatched.most_common()) for name, c in pair.ops.items()},
        "max_abs_diff_decode": pair.max_diff["decode"],
        "max_abs_diff_prefill": pair.max_diff["prefill"] if pair.check_prefill else None,
        "argmax_agree_decode": f"{pair.argmax_rows[0]}/{pair.argmax_rows[1]}",
    }


def print_table(report: dict[str, Any]) -> None:
    variant = ("B: torch.compile'd pieces" if report["compiled_pieces"] else "B: eager") + (
        ", float32 activations" if report["float32_activations"] else "")
    print(f"{report['quantization']}, {report['threads']} threads, {report['path']}; {variant}")
    print("batch  load start/end  A ms/step  B ms/step   A/B  step pairs: A/B  A-B ms  "
          "linear ms  other A  other B")
    for p in report["phases"]:
        print(f"{p['batch']:5d}  {p['load_start']:5.2f} / {p['load_end']:5.2f}  {p['ms_A']:9.2f}  "
              f"{p['ms_B']:9.2f}  {p['ratio_A_over_B']:4.2f}x  {p['median_step_ratio']:14.3f}x  "
              f"{p['median_step_saving_ms']:6.2f}  {p['ms_linear']:9.2f}  "
              f"{p['ms_other_A']:7.2f}  {p['ms_other_B']:7.2f}")
    print("batch  process CPU ms/step: A / B / linear alone")
    for p in report["phases"]:
        cpu = p["cpu_ms"]
        print(f"{p['batch']:5d}  {cpu['A']:9.2f} / {cpu['B']:9.2f} / {cpu['linear']:9.2f}")
    print(f"(medians of {report['phases'][0]['timed_steps']} decode steps; A and B both run every step, "
          "in alternating order; 'step pairs' = medians of the per-step ratio and difference; "
          "'other' = step minus its linear layers alone)")
    print("batch  ops issued A / B / linear  dispatched A / B / linear  "
          "max|A-B| decode / prefill  argmax agree")
    for p in report["phases"]:
        issued, dispatched = p["ops_issued"], p["ops_dispatched"]
        print(f"{p['batch']:5d}  {issued['A']:9d} / {issued['B']:4d} / {issued['linear']:4d}  "
              f"{dispatched['A']:13d} / {dispatched['B']:4d} / {dispatched['linear']:4d}  "
              f"{p['max_abs_diff_decode']:15.3g} / {_figure(p['max_abs_diff_prefill']):>7s}  "
              f"{p['argmax_agree_decode']:>12s}")
    if report["check"] is not None:
        print(f"check: max |A-B| {report['max_abs_diff']:.3g} "
              f"{'<=' if report['check'] else '>'} {report['tolerance']:g}: "
              f"{'pass' if report['check'] else 'FAIL'}")


def _figure(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--batches", default="1,16", help="decode batch sizes (default: %(default)s)")
    parser.add_argument("--prompt", type=int, default=256,
                        help="prompt tokens (batches > 1: unequal lengths from half to 1.5x this)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed decode steps per batch")
    parser.add_argument("--steps", type=int, default=40, help="timed decode steps per batch")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if any logit of B differs from A's by more than --tolerance, "
                             "prompt steps included (meant for --quantization none)")
    parser.add_argument("--tolerance", type=float, default=1e-4)
    parser.add_argument("--max-wait", type=float, default=600, help="seconds to wait for a quiet machine")
    parser.add_argument("--format", choices=["table", "json"], default="table")
    parser.add_argument("--float32-activations", action="store_true",
                        help="q8/q4k: float32 instead of bfloat16 activations (a probe)")
    parser.add_argument("--compiled-pieces", action="store_true",
                        help="B calls its elementwise work through torch.compile'd pieces")
    args = parser.parse_args()
    if args.float32_activations:
        float32_activations()
    model_dir = script_model(args)
    # A and B are both the model ModelRunner.execute calls: the fused step would bypass both.
    engine = LLMEngine.from_path(str(model_dir), EngineConfig(
        device="cpu", quantization=parse_quantization(args.quantization), fused_decode=False))
    rng = random.Random(0)
    phases = [run_phase(engine, int(b), args, rng) for b in args.batches.split(",")]
    worst = max(max(p["max_abs_diff_decode"], p["max_abs_diff_prefill"] or 0.0) for p in phases)
    report = {"quantization": args.quantization, "threads": args.threads, "model": str(model_dir),
              "float32_activations": args.float32_activations, "compiled_pieces": args.compiled_pieces,
              "path": engine.loaded.quantization_path,
              "op_counter": "torch.profiler events (issued: top-level; dispatched: nested included)",
              "phases": phases, "max_abs_diff": worst, "tolerance": args.tolerance,
              "check": (worst <= args.tolerance) if args.check else None}
    if args.format == "json":
        print(json.dumps(report, indent=2))
    else:
        print_table(report)
    if args.check and worst > args.tolerance:
        sys.exit(1)


if __name__ == "__main__":
    main()
