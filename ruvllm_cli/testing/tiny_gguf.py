"""Write a tiny LLaMA-architecture model directory as a llama.cpp-style GGUF file.

Test fixture for GGUF input: 2-D weights in Q8_0 (a real quantized type), norms in
F32, the byte-level BPE tokenizer as a "gpt2" GGUF tokenizer with its merges, and the
chat template. Q and K are permuted the way llama.cpp's converter does (transformers
undoes it when it loads the file).
"""

from __future__ import annotations

import json
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
    return f"blk.{index}.{LAYER_NAMES[rest]}"


def permute_qk(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's rotary layout: interleave each head's two halves."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]) \
        .swapaxes(1, 2).reshape(weight.shape)


def write_gguf(model_dir: str | Path, out_file: str | Path, *, alignment: int | None = None) -> Path:
    """The model in `model_dir` as a GGUF file; `alignment` writes `general.alignment`
    (the default 32 is implied when the key is absent)."""
    import gguf
    from safetensors.numpy import load_file

    model_dir, out_file = Path(model_dir), Path(out_file)
    config = json.loads((model_dir / "config.json").read_text())
    writer = gguf.GGUFWriter(str(out_file), "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    _write_config(writer, config)
    _write_tokenizer(writer, model_dir)
    tensors = load_file(str(model_dir / "model.safetensors"))
    for name, array in sorted(tensors.items()):
        if name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        array = array.astype(np.float32)
        if name.endswith("q_proj.weight"):
            array = permute_qk(array, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            array = permute_qk(array, config["num_key_value_heads"])
        if array.ndim == 2:
            kind = gguf.GGMLQuantizationType.Q8_0
            # The writer takes the quantized bytes' own shape and derives the logical one.
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(array, kind), raw_dtype=kind)
        else:
            writer.add_tensor(gguf_name(name), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_file


def _write_config(writer: "gguf.GGUFWriter", config: dict) -> None:
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
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)


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
