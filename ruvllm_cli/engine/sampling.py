"""Per-request sampling parameters (light: no torch at import time)."""

from __future__ import annotations

import json
import math
import logging
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from ruvllm_cli.errors import UsageError

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from ruvllm_cli.engine.grammar import GrammarSpec

# A logits processor sees the ids generated so far and the next-token logits row
# (a 1-D float tensor) and returns the row to sample from: the hook for grammar masks.
LogitsProcessor = Callable[[Sequence[int], Any], Any]


@dataclass(frozen=True)
class SamplingKnobs:
    """The sampling settings a user turns, each defaulting to "off" (plain sampling
    at temperature 1). The engine's SamplingParams, chat's settings and the server's
    request fields all extend it, so each knob is declared once."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None

    def knobs(self) -> dict[str, Any]:
        """The knobs alone, by name (what a subclass passes on to SamplingParams)."""
        return {f.name: getattr(self, f.name) for f in fields(SamplingKnobs)}


@dataclass(frozen=True)
class ReasoningBlock:
    """A reasoning model's block in a reply, which a constraint waits out and a thinking
    budget counts: open from the start (`inside`: the prompt opened it) or from the
    reply's first token where that is `start_id`, until `end_id`."""

    end_id: int
    start_id: int | None = None
    inside: bool = False


@dataclass(frozen=True)
class SamplingParams(SamplingKnobs):
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias in [-100, 100]), OpenAI's semantics
    structured: "GrammarSpec | None" = None         # constrained decoding (JSON schema, regex, choice, ...)
    reasoning_block: ReasoningBlock | None = None   # the constraint and thinking_budget skip / count it
    thinking_budget: int | None = None              # its end marker forced after this many tokens in it
    skip_special_tokens: bool = True                # False: special tokens reach the text
    kept_special_tokens: tuple[str, ...] = ()       # left in the text where the others are skipped (tool-call markers)
    stop_fence: str | None = None                   # a regex: `stop` applies before its first match (a call's opening)
    min_tokens: int = 0                             # EOS and stop_token_ids held off until this many (vLLM's)
    # None: repetition_penalty over prompt and output, presence and frequency over the
    # output (transformers', vLLM's, OpenAI's). N: all three over the last N tokens of
    # prompt and output (llama.cpp's and Ollama's repeat_last_n).
    penalty_last_n: int | None = None
    include_stop_str_in_output: bool = False        # the stop string that ended the reply stays in its text
    logits_processors: list[LogitsProcessor] = field(default_factory=list, hash=False)

    def __post_init__(self) -> None:
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        object.__setattr__(self, "stop", tuple(s for s in stop if s))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in bias))
        self.validate()

    def validate(self) -> None:
        checks = [
            (self.max_tokens >= 1, "max_tokens", "must be at least 1"),
            (0 <= self.min_tokens <= self.max_tokens, "min_tokens", "must be between 0 and max_tokens"),
            # Not capped at OpenAI's 2 (its routes are): Ollama's and vLLM's take more.
            (0.0 <= self.temperature < math.inf, "temperature", "must be 0 or more"),
            (0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]"),
            (self.top_k >= 0, "top_k", "must be 0 (off) or positive"),
            (0.0 <= self.min_p <= 1.0, "min_p", "must be between 0 and 1"),
            (self.repetition_penalty > 0.0, "repetition_penalty", "must be positive"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be between -2 and 2"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be between -2 and 2"),
            (self.penalty_last_n is None or self.penalty_last_n >= 1, "penalty_last_n", "must be at least 1"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "must be between 0 and 20"),
            (all(-100.0 <= b <= 100.0 for _, b in self.logit_bias), "logit_bias", "values must be in [-100, 100]"),
            # what torch.Generator.manual_seed takes: a larger one had failed every reply
            # with "Overflow when unpacking long long"
            (self.seed is None or SEED_RANGE[0] <= self.seed <= SEED_RANGE[1], "seed",
             f"must be between {SEED_RANGE[0]} and {SEED_RANGE[1]}"),
        ]
        for ok, name, rule in checks:
            if not ok:
                raise UsageError(f"{name} {rule} (got {getattr(self, name)})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def needs_history(self) -> bool:
        """True when sampling must look at the tokens so far (penalties, processors)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0 or bool(self.logits_processors))


# generation_config.json's sampling fields a model's defaults may set, with the values
# transformers takes when a field is absent: a field at that value is not a
# recommendation (vLLM reads the file's difference from transformers' defaults, so
# `top_k: 50` written out is transformers' default, not the creator's choice).
SEED_RANGE = (-(2**63), 2**64 - 1)   # what torch.Generator.manual_seed accepts
# The highest temperature chat and the OpenAI routes take (OpenAI's); the engine takes
# any, as Ollama's and vLLM's do, for /api's options.
MAX_TEMPERATURE = 2.0

MODEL_SAMPLING_FIELDS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": None, "repetition_penalty": 1.0}


def model_sampling_defaults(path: str | Path, gguf_metadata: dict[str, Any] | None = None
                            ) -> dict[str, float | int]:
    """The sampling values a model's creator recommends, which requests that do not set
    them get, as vLLM's `--generation-config auto` and llama.cpp do: a directory's
    generation_config.json (the fields of MODEL_SAMPLING_FIELDS it sets away from
    transformers' defaults), or a GGUF file's `general.sampling.*` keys (given as
    `gguf_metadata`, its checked header's). Each within SamplingParams' bounds (others
    are left out, with a log line). Empty where the model says nothing."""
    if gguf_metadata is not None:
        return gguf_sampling_defaults(gguf_metadata, str(path))
    file = Path(path) / "generation_config.json"
    if not file.is_file():
        return {}
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(raw, dict):
        return {}
    found: dict[str, float | int] = {}
    for name, transformers_default in MODEL_SAMPLING_FIELDS.items():
        value = raw.get(name)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)) \
                or value == transformers_default:
            continue
        value = int(value) if name == "top_k" and float(value).is_integer() else value
        if _usable(name, value, str(file)):
            found[name] = value
    return found


# llama.cpp's GGUF keys for the creator's sampling (convert_hf_to_gguf.py writes those
# generation_config.json sets), for the fields ruvllm samples with; mirostat and xtc
# have no counterpart here, and penalty_last_n is the Ollama API's per request.
GGUF_SAMPLING_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
                      "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
                      "general.sampling.penalty_repeat": "repetition_penalty"}


def gguf_sampling_defaults(metadata: dict[str, Any], source: str) -> dict[str, float | int]:
    """MODEL_SAMPLING_FIELDS from a GGUF header's `general.sampling.*` keys: each key
    written is the creator's choice (llama.cpp takes it as its default). Float32 values
    are rounded back to the decimal written (0.699999988 -> 0.7)."""
    found: dict[str, float | int] = {}
    for key, name in GGUF_SAMPLING_KEYS.items():
        value = metadata.get(key)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        value = int(value) if name == "top_k" else float(f"{float(value):.6g}")
        if _usable(name, value, source):
            found[name] = value
    return {name: found[name] for name in MODEL_SAMPLING_FIELDS if name in found}


def _usable(name: str, value: float | int, source: str) -> bool:
    try:
        SamplingParams(**{name: value})
        if name == "temperature" and value > MAX_TEMPERATURE:
            raise ValueError(value)
    except (UsageError, TypeError, ValueError, OverflowError):
        log.warning("%s: %s %r is outside what ruvllm samples with; not used", source, name, value)
        return False
    return True


def describe_defaults(defaults: dict[str, float | int]) -> str:
    """`temperature 0.7, top_p 0.8, top_k 20` (the fields in MODEL_SAMPLING_FIELDS' order)."""
    return ", ".join(f"{name} {defaults[name]:g}" for name in MODEL_SAMPLING_FIELDS if name in defaults)
