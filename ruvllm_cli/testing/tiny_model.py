"""Tiny random-weight Hugging Face models, built offline in about a second.

`build_tiny_model` writes a complete model directory (LLaMA config, random weights,
a byte-level BPE tokenizer trained here on a built-in corpus, a ChatML chat template
with tool support, generation config) that `AutoModelForCausalLM` and `AutoTokenizer`
load like any hub download. `build_bench_model` writes the exact shape of
Qwen2.5-0.5B-Instruct with a tokenizer of its vocabulary's size (`synthetic_vocab`),
for benchmarks that feed token ids.

The architecture is LLaMA, not Qwen2, on purpose: transformers 5 swaps the tokenizer
of any `qwen2` model for its own, which would disagree with ours on every id.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from tokenizers import Tokenizer
    from transformers import LlamaConfig, PreTrainedModel, PreTrainedTokenizerFast

# Bump when the output of the builders changes, so cached models are rebuilt.
BUILDER_VERSION = 3

BOS_TOKEN = "<|begin_of_text|>"
END_OF_TEXT_TOKEN = "<|end_of_text|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|pad|>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
# Skipped by `decode(skip_special_tokens=True)`; the tool-call markers are not, as in
# Qwen2.5, so tool parsers see them in decoded text.
SPECIAL_TOKENS = (BOS_TOKEN, END_OF_TEXT_TOKEN, IM_START_TOKEN, IM_END_TOKEN, PAD_TOKEN)
TOOL_TOKENS = (TOOL_CALL_START, TOOL_CALL_END)
# A reasoning model's (`reasoning=`): added, not special, as in Qwen3 and DeepSeek-R1.
THINK_START = "<think>"
THINK_END = "</think>"
THINK_TOKENS = (THINK_START, THINK_END)

# Linear weights get std 1/sqrt(fan_in): with the usual 0.02 every layer is so weak that
# a tied model only echoes its last input token, which would make greedy tests vacuous.
EMBEDDING_STD = 0.1
BIAS_STD = 0.02

# The shape of Qwen/Qwen2.5-0.5B-Instruct's config.json.
QWEN25_05B_SHAPE: dict[str, Any] = {
    "hidden_size": 896,
    "num_layers": 24,
    "num_heads": 14,
    "num_kv_heads": 2,
    "intermediate_size": 4864,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": True,
    "attention_bias": True,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
}

CORPUS = """\
The quick brown fox jumps over the lazy dog. A small model can still learn to say hello.
Hello! How are you today? I am fine, thank you. What is the weather like in Paris?
The weather in Paris is sunny and warm, with a light wind from the west. In London it
is cloudy and cool, and it may rain in the evening. Tomorrow will be colder in Berlin.
Please tell me a short story about a cat who lived in a library. Once upon a time, a
grey cat named Ada lived among the books. Every night she walked between the shelves
and listened to the pages turn. She liked the old maps best, because they smelled of
dust and adventure. One morning the librarian found her asleep on an atlas of the sea.

To make a cup of tea, boil fresh water, warm the pot, add one spoon of leaves for each
person, and pour. Wait three to five minutes before you serve it. Some people add milk
or lemon, and others prefer honey. Coffee is made from roasted beans that are ground
and brewed with hot water. Bread needs flour, water, salt and yeast, and time to rise.

Computers store numbers in binary. A byte has eight bits, and a kilobyte has 1024 bytes.
The numbers one, two, three, four, five, six, seven, eight, nine and ten are written
1, 2, 3, 4, 5, 6, 7, 8, 9 and 10. The year 2024 followed 2023, and 100 + 250 = 350.
A function takes arguments and returns a value. def add(a, b): return a + b
for i in range(10): print(i * i) if x > 0 and y < 5: result = x - y else: result = 0
class Model: def __init__(self, name): self.name = name  # a simple Python class
import json; data = json.loads(text); print(data["name"], data["arguments"])

{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
{"name": "search", "arguments": {"query": "best pizza in Naples", "limit": 3}}
{"type": "function", "function": {"name": "get_time", "description": "Get the current
time in a city", "parameters": {"type": "object", "properties": {"city": {"type":
"string", "description": "The name of the city"}}, "required": ["city"]}}}
{"temperature": 21.5, "condition": "sunny", "humidity": 40, "wind": "light"}
{"error": {"message": "The model was not found", "type": "invalid_request_error"}}

You are a helpful assistant. Answer the question as well as you can, and say so when
you do not know. The user asked about the history of the printing press. It was built
by Johannes Gutenberg around the year 1440, and it changed how people shared ideas.
Books became cheaper, more people learned to read, and news travelled much faster.
Science is the careful study of the world through observation and experiment. Water
freezes at zero degrees and boils at one hundred degrees Celsius at sea level. The
Earth goes around the Sun once a year, and the Moon goes around the Earth once a month.
Light from the Sun takes about eight minutes to reach us. Plants use sunlight, water
and air to make their food, and they give us the oxygen we breathe every day.

Rivers run to the sea, mountains rise above the clouds, and forests cover the hills.
The train leaves the station at nine o'clock and arrives in the city before noon.
She opened the window, looked at the garden, and smiled at the first flowers of spring.
They walked along the beach, collected shells, and watched the boats come back home.
He wrote a letter to his friend, put it in an envelope, and took it to the post office.
We should meet next week to talk about the project, the budget and the new design.
Could you summarise this text in three sentences? Sure, here is a short summary.
Translate "good morning" into French: bonjour. Into Spanish: buenos dias. Thank you!
Why is the sky blue? Because air scatters blue light from the Sun more than red light.
What is the capital of France? The capital of France is Paris. And of Italy? Rome.
"""

CHAT_TEMPLATE = """\
{%- macro render_text(content) -%}
{%- if content is none -%}
{%- elif content is string -%}{{- content -}}
{%- else -%}{%- for part in content -%}{%- if part['type'] == 'text' -%}{{- part['text'] -}}\
{%- endif -%}{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(system=none, start=0) -%}
{%- if messages and messages[0]['role'] == 'system' -%}
{%- set ns.system = render_text(messages[0]['content']) -%}
{%- set ns.start = 1 -%}
{%- endif -%}
{%- if tools -%}
{{- '<|im_start|>system\\n' -}}
{%- if ns.system -%}{{- ns.system + '\\n\\n' -}}{%- endif -%}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' -}}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}
{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and ' -}}
{{- 'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n' -}}
{{- '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' -}}
{%- elif ns.system is not none -%}
{{- '<|im_start|>system\\n' + ns.system + '<|im_end|>\\n' -}}
{%- endif -%}
{%- for message in messages[ns.start:] -%}
{%- if message['role'] == 'tool' -%}
{%- if loop.first or loop.previtem['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
{{- '\\n<tool_response>\\n' + render_text(message['content']) + '\\n</tool_response>' -}}
{%- if loop.last or loop.nextitem['role'] != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}
{%- elif message['role'] == 'assistant' -%}
{{- '<|im_start|>assistant\\n' + render_text(message['content']) -}}
{%- for call in message['tool_calls'] or [] -%}
{%- set fn = call['function'] if call['function'] is defined else call -%}
{%- if not loop.first or message['content'] -%}{{- '\\n' -}}{%- endif -%}
{{- '<tool_call>\\n{"name": "' + fn['name'] + '", "arguments": ' -}}
{%- if fn['arguments'] is string -%}{{- fn['arguments'] -}}{%- else -%}{{- fn['arguments'] | tojson -}}\
{%- endif -%}
{{- '}\\n</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>\\n' -}}
{%- else -%}
{{- '<|im_start|>' + message['role'] + '\\n' + render_text(message['content']) + '<|im_end|>\\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}
"""


def reasoning_template(opens_block: bool) -> str:
    """CHAT_TEMPLATE for a reasoning model: an assistant turn's `reasoning_content` in
    its <think> block, `enable_thinking` false closing an empty block in the generation
    prompt (Qwen3's), and where `opens_block` the generation prompt opening the block
    itself (DeepSeek-R1's and QwQ's), else the model opening it (Qwen3's)."""
    turn = "{{- '<|im_start|>assistant\\n' + render_text(message['content']) -}}"
    with_reasoning = ("{{- '<|im_start|>assistant\\n' -}}{%- if message['reasoning_content'] is string -%}"
                      "{{- '<think>\\n' + message['reasoning_content'] + '\\n</think>\\n\\n' -}}{%- endif -%}"
                      "{{- render_text(message['content']) -}}")
    prompt = "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    opened = "{{- '<think>\\n' -}}" if opens_block else ""
    reasoning_prompt = ("{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
                        "{%- if enable_thinking is defined and enable_thinking is false -%}"
                        "{{- '<think>\\n\\n</think>\\n\\n' -}}{%- else -%}" + opened + "{%- endif -%}{%- endif -%}")
    assert turn in CHAT_TEMPLATE and prompt in CHAT_TEMPLATE
    return CHAT_TEMPLATE.replace(turn, with_reasoning).replace(prompt, reasoning_prompt)


def train_tokenizer(vocab_size: int = 512, added: tuple[str, ...] = TOOL_TOKENS) -> "Tokenizer":
    """A byte-level BPE tokenizer of exactly `vocab_size` tokens, trained on `CORPUS`,
    `added` (not special) at its end."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    minimum = len(alphabet) + len(SPECIAL_TOKENS) + len(added)
    if vocab_size < minimum:
        raise ValueError(f"vocab_size must be at least {minimum}, got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(added),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tokenizer.train_from_iterator([CORPUS], trainer=trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(
            f"the built-in corpus yields {tokenizer.get_vocab_size()} tokens, not {vocab_size}"
        )
    return tokenizer


def build_tokenizer(vocab_size: int = 512, model_max_length: int = 4096,
                    reasoning: str | None = None) -> "PreTrainedTokenizerFast":
    """The trained tokenizer wrapped for transformers, with the ChatML template set;
    `reasoning` ("opens", "model"): a reasoning model's, with <think> and </think>
    and `reasoning_template` (the template opening the block, or the model)."""
    if reasoning is None:
        return _wrap(train_tokenizer(vocab_size), model_max_length)
    wrapped = _wrap(train_tokenizer(vocab_size, TOOL_TOKENS + THINK_TOKENS), model_max_length)
    wrapped.chat_template = reasoning_template(opens_block=reasoning == "opens")
    return wrapped


def build_bench_tokenizer(model_max_length: int = 32768) -> "PreTrainedTokenizerFast":
    """A tokenizer of Qwen2.5's size: the synthetic vocabulary's 151,643 tokens
    (`synthetic_vocab`), then the same special and tool tokens as `build_tokenizer`'s,
    and its chat template."""
    from tokenizers import AddedToken

    from ruvllm_cli.testing.synthetic_vocab import synthetic_tokenizer

    backend = synthetic_tokenizer()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    return _wrap(backend, model_max_length)


def _wrap(backend: "Tokenizer", model_max_length: int) -> "PreTrainedTokenizerFast":
    from transformers import PreTrainedTokenizerFast

    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS_TOKEN,
        eos_token=IM_END_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=model_max_length,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def _token_ids(tokenizer: "PreTrainedTokenizerFast") -> dict[str, int]:
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    return {
        "bos_token_id": ids[BOS_TOKEN],
        "eos_token_id": ids[IM_END_TOKEN],
        "end_of_text_id": ids[END_OF_TEXT_TOKEN],
        "pad_token_id": ids[PAD_TOKEN],
    }


def _llama_config(shape: dict[str, Any], ids: dict[str, int], dtype: str) -> "LlamaConfig":
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=shape["vocab_size"],
        hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"],
        num_hidden_layers=shape["num_layers"],
        num_attention_heads=shape["num_heads"],
        num_key_value_heads=shape["num_kv_heads"],
        max_position_embeddings=shape["max_position_embeddings"],
        tie_word_embeddings=shape["tie_word_embeddings"],
        attention_bias=shape["attention_bias"],
        mlp_bias=False,
        rms_norm_eps=shape.get("rms_norm_eps", 1e-6),
        rope_parameters={"rope_type": "default", "rope_theta": shape.get("rope_theta", 10000.0)},
        bos_token_id=ids["bos_token_id"],
        eos_token_id=ids["eos_token_id"],
        pad_token_id=ids["pad_token_id"],
        dtype=dtype,
    )


def _tensor_seed(seed: int, name: str) -> int:
    # One generator per tensor: a tensor's values depend only on (seed, name, shape).
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")


def _init_std(tensor: "torch.Tensor", name: str) -> float:
    if "embed_tokens" in name or "lm_head" in name:
        return EMBEDDING_STD
    if tensor.dim() == 1:
        return BIAS_STD
    return tensor.shape[-1] ** -0.5


def _fill_(tensor: "torch.Tensor", name: str, seed: int) -> None:
    import torch

    if tensor.dim() == 1 and "norm" in name:
        tensor.fill_(1.0)
        return
    std = _init_std(tensor, name)
    generator = torch.Generator().manual_seed(_tensor_seed(seed, name))
    flat = tensor.view(-1)
    chunk = 1 << 22  # bounded float32 scratch memory for the 136M-element embedding
    for start in range(0, flat.numel(), chunk):
        end = min(start + chunk, flat.numel())
        flat[start:end].copy_(torch.randn(end - start, generator=generator) * std)


def random_model(config: "LlamaConfig", dtype: str, seed: int) -> "PreTrainedModel":
    """A model with seeded `torch.randn` weights (embeddings std 0.1, linear weights std
    1/sqrt(fan_in), biases 0.02, norms 1), built on the meta device so no time goes into
    transformers' per-module init.

    Non-persistent buffers (rotary frequencies) are left uninitialised: the result is
    for `save_pretrained` only, not for running.
    """
    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = getattr(torch, dtype)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for name, param in model.named_parameters():
            _fill_(param, name, seed)
    model.tie_weights()
    return model


def _write_generation_config(path: Path, ids: dict[str, int]) -> None:
    from transformers import GenerationConfig

    GenerationConfig(
        bos_token_id=ids["bos_token_id"],
        eos_token_id=[ids["eos_token_id"], ids["end_of_text_id"]],
        pad_token_id=ids["pad_token_id"],
    ).save_pretrained(path)


def _build(
    path: str | os.PathLike, shape: dict[str, Any], tokenizer: "PreTrainedTokenizerFast", dtype: str, seed: int
) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    ids = _token_ids(tokenizer)
    model = random_model(_llama_config(shape, ids, dtype), dtype, seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    _write_generation_config(path, ids)
    return path


def build_tiny_model(
    path: str | os.PathLike,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int = 512,
    max_position_embeddings: int = 4096,
    tie_word_embeddings: bool = True,
    attention_bias: bool = False,
    dtype: str = "float32",
    seed: int = 0,
    reasoning: str | None = None,
) -> Path:
    """Write a tiny random LLaMA model with a trained tokenizer into `path`.

    Same arguments give byte-identical files. The tokenizer has exactly `vocab_size`
    tokens (at least 263; the built-in corpus gives at most 1,232). `reasoning`
    ("opens" or "model") makes it a reasoning model's (`build_tokenizer`).
    """
    shape = {
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "intermediate_size": intermediate_size,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": tie_word_embeddings,
        "attention_bias": attention_bias,
    }
    return _build(path, shape, build_tokenizer(vocab_size, max_position_embeddings, reasoning), dtype, seed)


def build_family_model(path: str | os.PathLike, model_type: str, *, dtype: str = "float32", seed: int = 0,
                       **config: Any) -> Path:
    """A tiny random model of another family than Llama (transformers' `model_type`:
    "gemma2", "mistral", ...), the tiny model's shape and tokenizer, `config` on top of
    the family's defaults (a sliding window, softcaps). For the tests of what the
    paged attention and the loaders must keep of each family's own forward."""
    from transformers import AutoConfig

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(512, 4096)
    ids = _token_ids(tokenizer)
    shape = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 4096}
    settings = {**shape, "bos_token_id": ids["bos_token_id"], "eos_token_id": ids["eos_token_id"],
                "pad_token_id": ids["pad_token_id"], **config}
    model = random_model(AutoConfig.for_model(model_type, **settings, dtype=dtype), dtype, seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    _write_generation_config(path, ids)
    return path


def build_bench_model(path: str | os.PathLike, *, dtype: str = "bfloat16", seed: int = 0) -> Path:
    """Write a random model with Qwen2.5-0.5B-Instruct's exact shape (494M parameters).

    The tokenizer has Qwen2.5's 151,643 regular tokens, synthetic (`build_bench_tokenizer`),
    and the tiny model's 7 special and tool tokens, so that memory figures count a
    vocabulary of the real size (the config's 151,936 rows pad it, as Qwen2.5's do);
    benchmarks feed token ids. LlamaConfig's `attention_bias` also puts a bias on
    o_proj, which Qwen2 lacks: 896 extra parameters per layer.
    """
    shape = dict(QWEN25_05B_SHAPE)
    return _build(path, shape, build_bench_tokenizer(shape["max_position_embeddings"]), dtype, seed)


def cached_tiny_model(root: str | os.PathLike, *, bench: bool = False, **kwargs: Any) -> Path:
    """Build a model once into `root/<hash of the arguments>` and reuse it afterwards.

    `bench=True` builds `build_bench_model(**kwargs)`, otherwise `build_tiny_model(**kwargs)`.
    The build goes to a temporary directory renamed into place, so a reader never sees a
    half-written model, and two processes racing on the same key both end with one copy.
    """
    root = Path(root)
    builder = build_bench_model if bench else build_tiny_model
    # Defaults filled in, so `seed=0` and no seed share one directory; typos fail here.
    arguments = inspect.signature(builder).bind(root, **kwargs)
    arguments.apply_defaults()
    options = {k: v for k, v in arguments.arguments.items() if k != "path"}
    key = json.dumps({"v": BUILDER_VERSION, "bench": bench, **options}, sort_keys=True)
    final = root / hashlib.sha256(key.encode()).hexdigest()[:16]
    if (final / "config.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".building-"))
    try:
        builder(tmp, **options)
        os.rename(tmp, final)
    except OSError:
        if not (final / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
