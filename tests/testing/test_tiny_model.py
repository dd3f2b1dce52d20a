"""The tiny model builder: loadable, deterministic, with a working tokenizer and chat template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ruvllm_cli.testing.tiny_model import (
    QWEN25_05B_SHAPE,
    SPECIAL_TOKENS,
    TOOL_TOKENS,
    _llama_config,
    build_bench_model,
    build_bench_tokenizer,
    build_tiny_model,
    cached_tiny_model,
)
from ruvllm_cli.testing.synthetic_vocab import REGULAR_TOKENS

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

MODEL_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return transformers.AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


def test_directory_holds_a_complete_model(tiny_model_dir: Path) -> None:
    assert {p.name for p in tiny_model_dir.iterdir()} == MODEL_FILES
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (64, 2, 512)
    assert config["dtype"] == "float32"


def test_loads_with_auto_classes(model, tokenizer) -> None:
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.dtype == torch.float32
    assert len(tokenizer) == 512
    assert tokenizer.bos_token == "<|begin_of_text|>"
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|pad|>"
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_generation_config_stops_on_im_end_and_end_of_text(model, tokenizer) -> None:
    ids = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|end_of_text|>", "<|begin_of_text|>", "<|pad|>"])
    generation = model.generation_config
    assert generation.eos_token_id == ids[:2]
    assert (generation.bos_token_id, generation.pad_token_id) == (ids[2], ids[3])
    assert model.config.eos_token_id == ids[0]


@pytest.mark.parametrize(
    "text",
    ["Hello, world!", "naïve café — 50 €", "emoji 🎉🦀 mixed", "中文字符と日本語", "  tabs\tand\nnew lines\n\n", ""],
)
def test_tokenizer_round_trips_utf8(tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert max(ids, default=0) < 512
    assert tokenizer.decode(ids) == text


def test_special_tokens_are_single_ids_and_tool_markers_survive_skipping(tokenizer) -> None:
    text = "<|im_start|>assistant\n<tool_call>{}</tool_call><|im_end|>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    for token in ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"):
        assert tokenizer.convert_tokens_to_ids(token) in ids
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(ids, skip_special_tokens=True) == "assistant\n<tool_call>{}</tool_call>"


def test_encode_adds_no_bos(tokenizer) -> None:
    assert tokenizer("hi").input_ids == tokenizer.encode("hi", add_special_tokens=False)


def test_chat_template_without_tools(tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": [{"type": "text", "text": "Bye"}]},
    ]
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n"
    )
    assert tokenizer.apply_chat_template(messages, tokenize=False) == expected
    prompted = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompted == expected + "<|im_start|>assistant\n"
    no_system = tokenizer.apply_chat_template(messages[1:2], tokenize=False)
    assert no_system == "<|im_start|>user\nHi<|im_end|>\n"


def test_chat_template_with_tools(tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
            ],
        },
        {"role": "tool", "content": '{"temp": 21}'},
        {"role": "tool", "content": '{"temp": 25}'},
    ]
    text = tokenizer.apply_chat_template(messages, tools=[WEATHER_TOOL], tokenize=False, add_generation_prompt=True)
    system = (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + json.dumps(WEATHER_TOOL)
        + "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    )
    calls = (
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>\n'
    )
    responses = (
        "<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response>\n"
        "<tool_response>\n{\"temp\": 25}\n</tool_response><|im_end|>\n"
    )
    user = "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n"
    assert text == system + user + calls + responses + "<|im_start|>assistant\n"


def test_chat_template_tools_without_system_message(tokenizer) -> None:
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tools=[WEATHER_TOOL], tokenize=False)
    assert text.startswith("<|im_start|>system\n# Tools\n\n")
    assert text.endswith("</tool_call><|im_end|>\n<|im_start|>user\nHi<|im_end|>\n")


def test_greedy_generate_is_deterministic_and_not_degenerate(model, tokenizer) -> None:
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me a story."}], add_generation_prompt=True,
        return_tensors="pt", return_dict=True,
    )
    prompt_len = inputs["input_ids"].shape[1]
    with torch.no_grad():
        first = model.generate(**inputs, max_new_tokens=16, do_sample=False, eos_token_id=None)
        second = model.generate(**inputs, max_new_tokens=16, do_sample=False, eos_token_id=None)
    assert first.shape == (1, prompt_len + 16)
    assert torch.equal(first, second)
    # Real init scales make the model do more than echo its last input token.
    assert len(set(first[0, prompt_len:].tolist())) > 3


def test_same_arguments_give_identical_files(tmp_path: Path, tiny_model_dir: Path) -> None:
    again = build_tiny_model(tmp_path / "again")
    for name in MODEL_FILES:
        assert (again / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name
    other = build_tiny_model(tmp_path / "other", seed=1)
    assert (other / "model.safetensors").read_bytes() != (again / "model.safetensors").read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (again / "tokenizer.json").read_bytes()


def test_shape_arguments(make_tiny_model) -> None:
    from safetensors import safe_open

    path = make_tiny_model(
        num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, vocab_size=600,
        tie_word_embeddings=False, attention_bias=True, dtype="bfloat16", seed=3,
    )
    config = json.loads((path / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_key_value_heads"]) == (1, 32, 1)
    assert (config["vocab_size"], config["tie_word_embeddings"], config["dtype"]) == (600, False, "bfloat16")
    assert len(transformers.AutoTokenizer.from_pretrained(path)) == 600
    with safe_open(path / "model.safetensors", "pt") as weights:
        keys = set(weights.keys())
        assert weights.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
    assert {"lm_head.weight", "model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.o_proj.bias"} <= keys


def test_cached_tiny_model_builds_once(tmp_path: Path) -> None:
    first = cached_tiny_model(tmp_path, num_layers=1)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert cached_tiny_model(tmp_path, num_layers=1) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert cached_tiny_model(tmp_path, num_layers=1, seed=0) == first
    assert cached_tiny_model(tmp_path, num_layers=1, seed=1) != first
    with pytest.raises(TypeError):
        cached_tiny_model(tmp_path, num_layer=1)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_too_small_vocab_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="vocab_size must be at least 263"):
        build_tiny_model(tmp_path, vocab_size=100)


def test_bench_config_has_qwen25_05b_shape() -> None:
    ids = {"bos_token_id": 0, "eos_token_id": 3, "pad_token_id": 4}
    config = _llama_config(dict(QWEN25_05B_SHAPE), ids, "bfloat16")
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config)
    # Qwen2.5-0.5B has 494,032,768; LlamaConfig's attention_bias adds an o_proj bias per layer.
    assert sum(p.numel() for p in meta.parameters()) == 494_032_768 + 24 * 896
    assert config.rope_parameters["rope_theta"] == 1_000_000.0


@pytest.mark.slow
def test_bench_model_builds_in_bf16(tmp_path: Path) -> None:
    from safetensors import safe_open

    path = build_bench_model(tmp_path / "bench")
    with safe_open(path / "model.safetensors", "pt") as weights:
        total = sum(_numel(weights.get_slice(k).get_shape()) for k in weights.keys())
        assert weights.get_tensor("model.norm.weight").dtype == torch.bfloat16
    assert total == 494_032_768 + 24 * 896
    assert len(transformers.AutoTokenizer.from_pretrained(path)) == REGULAR_TOKENS + 7


def test_the_bench_tokenizer_has_qwen25s_size_and_the_tiny_models_special_tokens() -> None:
    tokenizer = build_bench_tokenizer()
    assert len(tokenizer) == REGULAR_TOKENS + len(SPECIAL_TOKENS) + len(TOOL_TOKENS)
    ids = tokenizer.convert_tokens_to_ids([*SPECIAL_TOKENS, *TOOL_TOKENS])
    assert ids == list(range(REGULAR_TOKENS, REGULAR_TOKENS + 7))
    text = "<|im_start|>assistant\nHello <tool_call>{\"name\": \"f\"}</tool_call> 12 wörld 中文<|im_end|>"
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(ids, skip_special_tokens=True) == text[len("<|im_start|>"):-len("<|im_end|>")]
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                             add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n")
