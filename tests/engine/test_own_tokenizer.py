"""ruvllm's own tokenizer (engine/tokenizer.py): written down only when it answers as
transformers' does, read back by later loads without importing transformers, and
rebuilt from transformers' whenever the model's files, the record or the probes say so."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time

import pytest
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from ruvllm_cli.engine import tokenizer as own
from ruvllm_cli.engine import weight_cache
from ruvllm_cli.engine.chat_template import render_chat
from ruvllm_cli.engine.loader import load_model
from ruvllm_cli.quantization import Quantization as Q

LLAMA3_TEMPLATE = (
    "{{- bos_token }}{%- if not date_string is defined %}{%- set date_string = strftime_now('%d %b %Y') %}{%- endif %}"
    "{%- if tools is not none %}{{- '<|start_header_id|>system<|end_header_id|>\\n\\nTools: ' + tools | tojson(indent=2)"
    " + '\\nToday: ' + date_string + '<|eot_id|>' }}{%- endif %}"
    "{%- for m in messages %}{%- if m.tool_calls is defined %}{%- for c in m.tool_calls %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' + c.function | tojson + '<|eot_id|>' }}{%- endfor %}"
    "{%- else %}{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content | trim + '<|eot_id|>' }}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}")
STRICT_TEMPLATE = ("{%- for m in messages %}{%- if m.role not in ['user', 'assistant'] %}"
                   "{{- raise_exception('Only user and assistant roles are supported!') }}{%- endif %}"
                   "{{- '[INST] ' + m.content + ' [/INST]' if m.role == 'user' else m.content + eos_token }}"
                   "{%- endfor %}")


@pytest.fixture
def model_copy(make_tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv(weight_cache.ENV, "1")
    path = tmp_path / "model"
    shutil.copytree(make_tiny_model(), path)
    return path


def _records(path):
    return sorted(p.name for p in (path / weight_cache.CACHE_DIR).glob("vocab*.json"))


def test_a_second_load_reads_the_checked_tokenizer_and_answers_as_transformers(model_copy):
    first = load_model(model_copy, "cpu", Q.F32)
    assert not isinstance(first.tokenizer, own.Tokenizer)
    assert _records(model_copy) == [own.record(model_copy).name]
    second = load_model(model_copy, "cpu", Q.F32)
    ours, theirs = second.tokenizer, first.tokenizer
    assert isinstance(ours, own.Tokenizer)
    assert own.differs(theirs, ours) is None
    assert second.eos_token_ids == first.eos_token_ids
    # Beyond the probes: random text, ids and conversations.
    rng = random.Random(0)
    alphabet = "abcdefghij XYZ\n\t.,!?'\"éü中😀<|>/[]{}0123456789"
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 60)))
        assert ours.encode(text) == theirs.encode(text)
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)
        ids = [rng.randrange(len(theirs)) for _ in range(rng.randrange(1, 20))]
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
        assert ours.convert_ids_to_tokens(ids) == theirs.convert_ids_to_tokens(ids)
    special = "<|im_end|>"
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": f"x {special} y"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]},
                {"role": "tool", "content": "ok"}]
    for tools in (None, own.TOOLS):
        for prompt in (True, False):
            assert render_chat(ours, messages, tools, prompt) == render_chat(theirs, messages, tools, prompt)
    assert ours.get_added_vocab() == theirs.get_added_vocab() and "<tool_call>" in ours.get_added_vocab()
    assert ours.convert_tokens_to_ids(["<|im_end|>", "no-such-token"]) == \
        theirs.convert_tokens_to_ids(["<|im_end|>", "no-such-token"])


def test_a_long_prompt_is_encoded_without_holding_the_gil(model_copy):
    """A server encodes prompts on a worker thread: with tokenizers' `encode` (which
    keeps the GIL) a 3.6 MB prompt held every other request, /health included, for 6 s."""
    load_model(model_copy, "cpu", Q.F32)
    ours = load_model(model_copy, "cpu", Q.F32).tokenizer
    assert isinstance(ours, own.Tokenizer)
    text = "a b " * 150_000
    ticks, stop = [], threading.Event()

    def tick():
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.002)

    ticker = threading.Thread(target=tick)
    ticker.start()
    time.sleep(0.05)
    started = time.perf_counter()
    ids = ours.encode(text, add_special_tokens=False)
    ended = time.perf_counter()
    stop.set()
    ticker.join()
    assert len(ids) >= 150_000
    gaps = [b - a for a, b in zip(ticks, ticks[1:]) if b >= started and a <= ended]
    # Held, the other thread waits the whole encode; let go, it ticks on.
    assert max(gaps) < (ended - started) / 2, (max(gaps), ended - started)


def _tokenizer(tmp_path, template, name="tok"):
    """A Llama-2-style tokenizer (metaspace BPE with byte fallback, a BOS template)
    built from scratch, saved and read back by AutoTokenizer."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers

    backend = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"] +
                                  [f"<0x{i:02X}>" for i in range(256)], show_progress=False)
    backend.train_from_iterator(["Hello world, the quick brown fox jumps over the lazy dog. " * 4], trainer=trainer)
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B",
                                                           special_tokens=[("<s>", backend.token_to_id("<s>"))])
    wrapped = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    wrapped.chat_template = template
    wrapped.save_pretrained(tmp_path / name)
    return AutoTokenizer.from_pretrained(tmp_path / name), tmp_path / name


@pytest.mark.parametrize("template", [LLAMA3_TEMPLATE, STRICT_TEMPLATE, None,
                                      {"default": STRICT_TEMPLATE, "tool_use": LLAMA3_TEMPLATE}],
                         ids=["llama3-like", "raises-on-system", "no-template", "named-templates"])
def test_other_tokenizer_kinds_and_templates_are_checked_and_match(tmp_path, template, monkeypatch):
    monkeypatch.setenv(weight_cache.ENV, "1")
    theirs, folder = _tokenizer(tmp_path, template)
    assert own.save_checked(theirs, folder)
    ours = own.load(folder)
    assert ours is not None and own.differs(theirs, ours) is None
    assert ours.encode("Hello") == theirs.encode("Hello") and ours.encode("Hello")[0] == theirs.bos_token_id
    conversations = [[{"role": "user", "content": "Hello  world"}],
                     [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]]
    renders = []
    for messages in conversations:
        for tools in (None, own.TOOLS):
            want = _rendered(theirs, messages, tools)
            assert _rendered(ours, messages, tools) == want
            renders.append(want)
    if template is not None:   # rendered token ids, not only errors that agree
        assert any(isinstance(r, list) and r for r in renders)
    if isinstance(template, dict):   # "tool_use" with tools: the llama3-like one, with its date line
        assert "Today" in ours.decode(render_chat(ours, conversations[0], own.TOOLS))
    if template is STRICT_TEMPLATE:   # the template's own error, from both
        assert _rendered(ours, conversations[1], None)[0] == "raised"


def _rendered(tokenizer, messages, tools):
    try:
        return render_chat(tokenizer, messages, tools)
    except Exception as error:  # noqa: BLE001 - compared between the two tokenizers
        return ("raised", type(error).__name__, str(error))


def test_a_tokenizer_that_answers_differently_is_not_written_down(model_copy, monkeypatch, caplog):
    real = own.Tokenizer.decode
    monkeypatch.setattr(own.Tokenizer, "decode", lambda self, ids, skip_special_tokens=False:
                        real(self, ids, skip_special_tokens).upper())
    with caplog.at_level("INFO", logger="ruvllm_cli.engine.tokenizer"):
        load_model(model_copy, "cpu", Q.F32)
    assert "they differ in decode" in caplog.text
    # What was found is written down instead of the tokenizer, so later loads skip the probes.
    assert json.loads(own.record(model_copy).read_text()) == {"format": own.FORMAT,
                                                             "differs": caplog.records[-1].args[1][:1000]}
    probes = []
    monkeypatch.setattr(own, "differs", lambda *args: probes.append(args))
    assert not isinstance(load_model(model_copy, "cpu", Q.F32).tokenizer, own.Tokenizer)
    assert probes == [] and own.load(model_copy) is None
    # Another version of the files (or of transformers) is checked again.
    os.utime(model_copy / "tokenizer_config.json", ns=(time.time_ns(), time.time_ns() + 10**9))
    load_model(model_copy, "cpu", Q.F32)
    assert len(probes) == 1 and isinstance(load_model(model_copy, "cpu", Q.F32).tokenizer, own.Tokenizer)


def test_word_piece_cleanup_is_left_to_transformers(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    backend = Tokenizer(models.WordPiece({"[UNK]": 0, "do": 1, "n't": 2, ".": 3, "it": 4}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    wrapped = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", clean_up_tokenization_spaces=True)
    assert not own.save_checked(wrapped, tmp_path)
    assert not (tmp_path / weight_cache.CACHE_DIR).exists()


def test_changed_files_a_damaged_record_and_the_switches_fall_back_to_transformers(model_copy, monkeypatch):
    load_model(model_copy, "cpu", Q.F32)
    first = own.record(model_copy)
    # A changed tokenizer file is another key: transformers' again, and the old record replaced.
    config = model_copy / "tokenizer_config.json"
    os.utime(config, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert own.record(model_copy) != first
    assert not isinstance(load_model(model_copy, "cpu", Q.F32).tokenizer, own.Tokenizer)
    assert _records(model_copy) == [own.record(model_copy).name]
    own.record(model_copy).write_text("{not json")
    assert not isinstance(load_model(model_copy, "cpu", Q.F32).tokenizer, own.Tokenizer)
    assert isinstance(load_model(model_copy, "cpu", Q.F32).tokenizer, own.Tokenizer)   # written again
    assert not isinstance(load_model(model_copy, "cpu", Q.F32, use_cache=False).tokenizer, own.Tokenizer)
    monkeypatch.setenv(own.ENV, "0")
    assert not isinstance(load_model(model_copy, "cpu", Q.F32).tokenizer, own.Tokenizer)


def test_structured_output_runs_on_ruvllms_tokenizer(model_copy):
    from ruvllm_cli.engine.grammar import GrammarCompiler, GrammarSpec

    theirs = load_model(model_copy, "cpu", Q.F32).tokenizer
    ours = load_model(model_copy, "cpu", Q.F32).tokenizer
    assert isinstance(ours, own.Tokenizer)
    spec = GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}}))
    reply = theirs.encode('{"a":12}', add_special_tokens=False)
    masks = []
    for tokenizer in (theirs, ours):
        compiler = GrammarCompiler(tokenizer, len(tokenizer) + 8, eos_token_ids=[tokenizer.eos_token_id])
        matcher = compiler.compile(spec).matcher()
        seen = []
        for token in [None, *reply]:
            if token is not None:
                assert matcher.accept(token)
            bitmask = torch.zeros(1, compiler.layout.words, dtype=torch.int32)
            matcher.fill_bitmask(bitmask, 0)
            seen.append(bitmask.clone())
        compiler.close()
        masks.append(torch.cat(seen))
    assert compiler.layout.words > 0 and torch.equal(masks[0], masks[1]) and bool(masks[0].any())


@pytest.mark.parametrize("kind", ["directory", "gguf"])
def test_a_fresh_process_loads_and_replies_without_importing_transformers(model_copy, tmp_path, kind):
    """The second start of a model on a CPU: a directory at none (no weight cache), a
    GGUF file at q8 (its weight cache keeps the config fields transformers' key table
    gave). On CUDA the model loads through transformers' classes (and a GGUF at q8 is
    refused), so the process names the CPU, as the load that wrote the caches did."""
    path, quantization = model_copy, "F32"
    if kind == "gguf":
        from ruvllm_cli.testing.tiny_gguf import write_gguf

        path, quantization = write_gguf(model_copy, tmp_path / "tiny.gguf"), "Q8_0"
    load_model(path, "cpu", Q[quantization])   # writes the caches down
    script = f"""
import sys
from ruvllm_cli.engine.engine import LLMEngine
from ruvllm_cli.engine.config import EngineConfig
from ruvllm_cli.engine.sampling import SamplingParams
from ruvllm_cli.engine.tokenizer import Tokenizer, warm_up
from ruvllm_cli.quantization import Quantization
engine = LLMEngine.from_path({str(path)!r}, EngineConfig(device="cpu", quantization=Quantization.{quantization},
                                                        max_model_len=256))
assert isinstance(engine.tokenizer, Tokenizer)
out = engine.generate(["Hello there"], SamplingParams(max_tokens=4, temperature=0.0))
assert len(out[0].token_ids) == 4
print("cached weights", engine.loaded.from_weight_cache)
print("before the template", "transformers" in sys.modules)
warm_up(engine.tokenizer).join()
from ruvllm_cli.engine.chat_template import render_chat
print("rendered", len(render_chat(engine.tokenizer, [{{"role": "user", "content": "hi"}}])) > 0)
"""
    env = dict(os.environ, **{weight_cache.ENV: "1"})
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "before the template False" in done.stdout and "rendered True" in done.stdout
    assert f"cached weights {kind == 'gguf'}" in done.stdout
