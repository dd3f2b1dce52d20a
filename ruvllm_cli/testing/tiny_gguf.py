"""Write a tiny LLaMA-architecture model directory as a llama.cpp-style GGUF file.

Test fixture for GGUF input: 2-D weights in Q8_0 (a real quantized type) or the
types a `types` function picks per tensor (F16, BF16, Q8_0, Q5_0, Q4_K, Q6_K, ...),
norms and biases in F32, the byte-level BPE tokenizer as a "gpt2" GGUF tokenizer with
its merges, and the chat template. Types the gguf package cannot quantize are written
by `gguf_blocks` (Q4_K, Q6_K, IQ4_NL, IQ4_XS; the lattice i-quants as random codes).
As llama.cpp's converter does, a `llama` file has Q and K permuted (transformers
undoes it when it loads the file); a `qwen2` file has them as they are, and q/k/v
biases but no output-projection bias.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import gguf

LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, index, rest = hf_name.split(".", 3)       # model.layers.<i>.<rest>
    if rest.endswith(".bias"):
        return f"blk.{index}.{LAYER_NAMES[rest.removesuffix('.bias') + '.weight'].removesuffix('.weight')}.bias"
    return f"blk.{index}.{LAYER_NAMES[rest]}"


def permute_qk(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's rotary layout: interleave each head's two halves."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]) \
        .swapaxes(1, 2).reshape(weight.shape)


def write_gguf(model_dir: str | Path, out_file: str | Path, *, alignment: int | None = None,
               types: Callable[[str], str] | None = None, arch: str = "llama",
               file_type: str | None = None, extra: dict[str, np.ndarray] | None = None,
               metadata: dict[str, float | int | str] | None = None) -> Path:
    """The model in `model_dir` as a GGUF file; `alignment` writes `general.alignment`
    (the default 32 is implied when the key is absent); `types` names the ggml type of
    each 2-D weight by its GGUF name (Q8_0 for all when not given); `file_type` the
    `general.file_type` (LlamaFileType's name without MOSTLY_; from the types when
    all weights share one); `extra` adds F32 tensors (e.g. llama 3's rope_freqs);
    `metadata` more keys (a float as float32, an int as uint32, as llama.cpp writes
    `general.sampling.*`)."""
    import gguf
    from safetensors.numpy import load_file

    model_dir, out_file = Path(model_dir), Path(out_file)
    config = json.loads((model_dir / "config.json").read_text())
    writer = gguf.GGUFWriter(str(out_file), arch)
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    tensors = load_file(str(model_dir / "model.safetensors"))
    written = set()
    for name, array in sorted(tensors.items()):
        if (name == "lm_head.weight" and config.get("tie_word_embeddings")) or (
                arch == "qwen2" and name.endswith("o_proj.bias")):
            continue
        array = array.astype(np.float32)
        if arch == "llama" and ".q_proj." in name:
            array = permute_qk(array, config["num_attention_heads"])
        elif arch == "llama" and ".k_proj." in name:
            array = permute_qk(array, config["num_key_value_heads"])
        kind = (types or (lambda _: "Q8_0"))(gguf_name(name)) if array.ndim == 2 else "F32"
        written.add(kind if array.ndim == 2 else None)
        _add_tensor(writer, gguf_name(name), array, kind)
    for name, array in (extra or {}).items():
        writer.add_tensor(name, array.astype(np.float32))
    written.discard(None)
    _write_config(writer, config, file_type or (written.pop() if len(written) == 1 else "Q4_K_M"))
    _write_tokenizer(writer, model_dir)
    for key, value in (metadata or {}).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_file


def _add_tensor(writer: "gguf.GGUFWriter", name: str, array: np.ndarray, kind_name: str) -> None:
    """`array` stored as the ggml type `kind_name`; the writer takes quantized bytes with
    their own shape and derives the logical one."""
    import gguf

    from ruvllm_cli.testing.gguf_blocks import (grid_blocks, quantize_iq4_nl, quantize_iq4_xs, quantize_q4_k,
                                                quantize_q6_k)

    kind = gguf.GGMLQuantizationType[kind_name]
    if kind is gguf.GGMLQuantizationType.F32:
        writer.add_tensor(name, array)
    elif kind is gguf.GGMLQuantizationType.F16:
        writer.add_tensor(name, array.astype(np.float16))
    else:
        ours = {"Q4_K": quantize_q4_k, "Q6_K": quantize_q6_k, "IQ4_NL": quantize_iq4_nl,
                "IQ4_XS": quantize_iq4_xs}.get(kind_name)
        if ours is None and kind_name.startswith(("IQ1", "IQ2", "IQ3")):
            ours = partial(grid_blocks, kind=kind_name)
        data = ours(array) if ours else gguf.quants.quantize(array, kind)
        writer.add_tensor(name, data, raw_dtype=kind)


def _write_config(writer: "gguf.GGUFWriter", config: dict, file_type: str) -> None:
    import gguf

    heads = config["num_attention_heads"]
    writer.add_name("ruvllm tiny test model")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_dimension_count(config["hidden_size"] // heads)
    writer.add_rope_freq_base(float(config.get("rope_theta") or 10000.0))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_vocab_size(config["vocab_size"])
    named = {"F32": "ALL_F32", "Q4_K": "MOSTLY_Q4_K_M", "Q5_K": "MOSTLY_Q5_K_M"}
    writer.add_file_type(gguf.LlamaFileType[named.get(file_type, f"MOSTLY_{file_type}")])


def _write_tokenizer(writer: "gguf.GGUFWriter", model_dir: Path) -> None:
    import gguf

    spec = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    special = {t["content"] for t in spec.get("added_tokens", []) if t.get("special")}
    merges = [" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL
                            for t in tokens])
    writer.add_token_merges(merges)
    settings = json.loads((model_dir / "tokenizer_config.json").read_text())
    for key, add in (("bos_token", writer.add_bos_token_id), ("eos_token", writer.add_eos_token_id),
                     ("pad_token", writer.add_pad_token_id)):
        token = settings.get(key)
        if isinstance(token, dict):
            token = token.get("content")
        if token in vocab:
            add(vocab[token])
    template = model_dir / "chat_template.jinja"
    if template.is_file():
        writer.add_chat_template(template.read_text())
