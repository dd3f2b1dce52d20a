"""Option types and decorators shared by several commands."""

from __future__ import annotations

from typing import Any

import click
from click.shell_completion import CompletionItem

from ruvllm_cli.errors import UsageError
from ruvllm_cli.quantization import CHOICES, QUANTIZATION_NAMES, Quantization, parse_quantization


class FiniteFloatRange(click.FloatRange):
    """click's FloatRange without NaN and the infinities: NaN passes every bound
    (each comparison with it is false), and it then reached the JSON (`NaN`, which
    strict parsers refuse) or turned --compare's gate off."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        import math

        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return number


class QuantizationType(click.ParamType):
    """q4k|q8|f16|none and their other names (quantization.py), any case."""

    name = "quantization"

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:
        return f"[{CHOICES}]"  # as typed: Click would show the type's name in capitals

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Quantization:
        try:
            return parse_quantization(value)
        except UsageError as error:
            self.fail(f"{error.message} ({error.hint})", param, ctx)

    def shell_complete(self, ctx: click.Context, param: click.Parameter, incomplete: str) -> list[CompletionItem]:
        """The four names; another spelling (q4_k_m, fp16, ...) once it is being typed."""
        typed = incomplete.lower()
        names = [q.value for q in Quantization if q.value.startswith(typed)]
        names = names or [name for name in QUANTIZATION_NAMES if name.startswith(typed)]
        return [CompletionItem(name, help=parse_quantization(name).label) for name in names]


QUANTIZATION = QuantizationType()
DEVICE = click.Choice(["auto", "cpu", "cuda", "mps"], case_sensitive=False)


# What chat, serve and benchmark load when -q is not given (cli/engine_setup.py decides).
LOAD_DEFAULT = ("what the files are: a GGUF file keeps its type (Q4_K_M as q4k, Q8_0 as q8, F16 as none); "
                "safetensors load as f16 (on a CPU without AVX-512 BF16: float16 weights in ruvllm's "
                "kernel; with no C compiler to build it, bfloat16 where oneDNN emulates it, else none)")


def quantization_option(help_text: str, default_text: str) -> Any:
    """-q/--quantization, None when not given; --help shows `default_text` as its default
    (Click would wrap a text default in parentheses)."""
    return click.option("-q", "--quantization", type=QUANTIZATION, default=None,
                        help=f"{help_text}.  [default: {default_text}]")


def load_quantization_option() -> Any:
    """chat, serve and benchmark's -q: the quantization applied when the model loads."""
    return quantization_option("Quantization applied when the model loads", LOAD_DEFAULT)


def device_option() -> Any:
    return click.option("--device", type=DEVICE, default="auto", show_default=True,
                        help="Where to run the model: CUDA, then MPS, then CPU when auto.")


def prefix_cache_option() -> Any:
    """--no-prefix-cache, exposed as `no_prefix_cache`."""
    return click.option("--no-prefix-cache", is_flag=True,
                        help="Turn automatic prefix caching off (it is on by default).")


def weight_cache_option() -> Any:
    """--no-weight-cache, exposed as `no_weight_cache`."""
    return click.option("--no-weight-cache", is_flag=True,
                        help="q8/q4k: neither read nor write the quantized-weight cache kept next to "
                             "the model (docs/design.md, section 9); quantize at every load.")


def compile_option() -> Any:
    """--no-compile, exposed as `no_compile`."""
    return click.option("--no-compile", is_flag=True,
                        help="Use none of ruvllm's own C kernels (the fused decode step, the int8 and "
                             "float16 layers): torch's kernels and transformers' layers only, as "
                             "RUVLLM_COMPILE=0 does. Slower; for comparison or a machine whose compiler fails.")


def threads_option() -> Any:
    """--threads N, exposed as `threads` (None: torch's own choice, one a core or
    OMP_NUM_THREADS)."""
    return click.option("--threads", type=click.IntRange(min=1), default=None, metavar="N",
                        help="CPU threads for the model's arithmetic, as llama.cpp's -t. Every step waits "
                             "for its slowest thread, so with other programs busy, fewer threads than cores "
                             "run faster.  [default: one a core, or OMP_NUM_THREADS]")


def lora_options(use: str, slots_default: str = "4") -> Any:
    """--lora NAME=PATH (repeatable), --max-loras, --max-lora-rank: exposed as `lora`,
    `max_loras`, `max_lora_rank`. `use` says what the command does with the adapters."""

    def decorate(command: Any) -> Any:
        for option in reversed((
            click.option("--lora", multiple=True, metavar="NAME=PATH",
                         help=f"Load a PEFT LoRA or X-LoRA adapter (a directory or a hub id) as NAME; "
                              f"repeatable. {use}"),
            click.option("--max-loras", type=click.IntRange(min=0), default=None,
                         help="Adapters decoded at once (their slots); more are kept in memory and swapped "
                              f"in least-recently-used first.  [default: {slots_default}]"),
            click.option("--max-lora-rank", type=click.IntRange(min=1), default=None,
                         help="Largest adapter rank a slot holds.  [default: the largest --lora rank, at least 16]"),
        )):
            command = option(command)
        return command

    return decorate


def prefix_caching(no_prefix_cache: bool) -> bool | None:
    """The EngineConfig value for the flag (None keeps the engine's default: on)."""
    return False if no_prefix_cache else None
