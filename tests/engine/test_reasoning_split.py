"""The reasoning splitter: a reply's reasoning and answer, the same whether it arrives
whole or cut anywhere, and never taking back what it gave."""

from __future__ import annotations

import random

import pytest

from ruvllm_cli.engine.reasoning import (FORMATS, Reasoning, ReasoningSplitter, detect_format, get_format,
                                         split_reasoning)
from ruvllm_cli.errors import UsageError

THINK = FORMATS["think"]

CASES = [
    # (reply, starts inside the block, reasoning, answer)
    ("\nWhat is 2+2? Four.\n\n</think>\n\nThe answer is 4.", True, "What is 2+2? Four.", "The answer is 4."),
    ("<think>\nhmm\n</think>\n\nok", False, "hmm", "ok"),
    ("  \n<think>a</think>b", False, "a", "b"),
    ("Hello <think>x</think>", False, "", "Hello <think>x</think>"),   # a block counts only at the start
    ("<thi", False, "", "<thi"),                                       # a start marker that never completed
    ("cut off while thinking  \n", True, "cut off while thinking", ""),
    ("<think>open forever", False, "open forever", ""),
    ("</think>answer</think>", True, "", "answer</think>"),
    ("a  </thinking> b</think>", True, "a  </thinking> b", ""),        # not the marker: still reasoning
    ("   ", False, "", "   "),
    ("", True, "", ""),
    ("\n<think>\nagain</think>ok", True, "again", "ok"),             # the prompt's marker written again
    ("<thin", True, "<thin", ""),
    ("x <think> y</think>", True, "x <think> y", ""),
]


@pytest.mark.parametrize("text, inside, reasoning, answer", CASES)
def test_a_reply_is_split_the_same_whole_or_in_any_pieces(text, inside, reasoning, answer):
    whole = split_reasoning(THINK, text, inside)
    assert (whole.reasoning, whole.content) == (reasoning, answer)
    rng = random.Random(text)
    for _ in range(100):
        splitter, got = ReasoningSplitter(THINK, inside), ["", ""]
        start = 0
        while start < len(text):
            end = start + rng.randint(1, 5)
            piece = splitter.feed(text[start:end])
            got = [got[0] + piece.reasoning, got[1] + piece.content]
            start = end
        piece = splitter.finish()
        assert [got[0] + piece.reasoning, got[1] + piece.content] == [reasoning, answer]


def test_nothing_is_given_out_that_a_marker_could_still_take_back():
    splitter = ReasoningSplitter(THINK, in_reasoning=True)
    assert splitter.feed("step one </thi").reasoning == "step one"
    assert splitter.in_reasoning
    piece = splitter.feed("nk> done")
    assert piece.reasoning == "" and piece.content == "done" and not splitter.in_reasoning


def test_formats_by_name_and_from_the_template():
    assert get_format("deepseek_r1") is get_format("qwen3") is THINK
    assert get_format("mistral").start == "[THINK]"
    with pytest.raises(UsageError):
        get_format("granite")
    assert detect_format("{{ '<think>' }} ... {{ '</think>' }}") is THINK
    # DeepSeek-R1's first template: only strips earlier turns' reasoning
    assert detect_format("{% set content = content.split('</think>')[-1] %}") is THINK
    assert detect_format("[THINK]{{ x }}[/THINK]") is FORMATS["mistral"]
    assert detect_format("<|im_start|>assistant") is None and detect_format(None) is None


def test_markers_and_reasoning_tokens_from_the_tokenizer(make_tiny_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(make_tiny_model(reasoning="opens"))
    reasoning = Reasoning.of(THINK, tokenizer)
    start, end = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    assert (reasoning.start_id, reasoning.end_id) == (start, end)
    opened = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False)
    closed = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False, enable_thinking=False)
    assert reasoning.prompt_ends_in(tokenizer, opened) == "open"
    assert reasoning.prompt_ends_in(tokenizer, closed) == "closed"
    assert reasoning.prompt_ends_in(tokenizer, opened[:-3]) is None
    assert reasoning.reasoning_tokens([7, 8, end, 9], had_reasoning=True) == 3
    assert reasoning.reasoning_tokens([7, 8, 9], had_reasoning=True) == 3
    assert reasoning.reasoning_tokens([7, end], had_reasoning=False) == 0
    plain = AutoTokenizer.from_pretrained(make_tiny_model())   # no such tokens: several pieces each
    assert Reasoning.of(THINK, plain).end_id is None
    assert Reasoning.of(THINK, plain).reasoning_tokens([1, 2], had_reasoning=True) is None


def test_the_engines_chat_call_gives_the_reasoning_apart(make_tiny_model):
    from ruvllm_cli.engine.chat_template import render_chat
    from ruvllm_cli.engine.config import EngineConfig
    from ruvllm_cli.engine.engine import LLMEngine
    from ruvllm_cli.engine.loader import load_model
    from ruvllm_cli.engine.sampling import SamplingParams
    from ruvllm_cli.quantization import Quantization

    engine = LLMEngine(load_model(make_tiny_model(reasoning="opens"), "cpu", Quantization.F32),
                       EngineConfig(device="cpu"))
    end = engine.tokenizer.convert_tokens_to_ids("</think>")
    messages = [{"role": "user", "content": "hi"}]
    both = 0
    for seed in range(6):
        params = SamplingParams(max_tokens=24, temperature=1.0, seed=seed, logit_bias={end: 3.5})
        reply = engine.chat(messages, params)
        [raw] = engine.generate([render_chat(engine.tokenizer, messages)], params)
        expected = split_reasoning(THINK, raw.text, in_reasoning=True)
        assert (reply.reasoning, reply.content) == (expected.reasoning, expected.content)
        both += bool(reply.reasoning and reply.content)
    assert both


def test_constraints_that_wait_batch_with_others_as_they_run_alone(make_tiny_model):
    """One step's mask stage over rows that wait for </think>, rows whose first token may
    open a block, plainly constrained rows and free rows: each request's tokens are those
    it gets alone (the masks are per row; a waiting row is left unmasked)."""
    from ruvllm_cli.engine.chat_template import render_chat
    from ruvllm_cli.engine.config import EngineConfig
    from ruvllm_cli.engine.engine import LLMEngine
    from ruvllm_cli.engine.grammar import GrammarSpec
    from ruvllm_cli.engine.loader import load_model
    from ruvllm_cli.engine.sampling import ReasoningBlock, SamplingParams
    from ruvllm_cli.quantization import Quantization

    engine = LLMEngine(load_model(make_tiny_model(reasoning="model"), "cpu", Quantization.F32),
                       EngineConfig(device="cpu"))
    start, end = engine.tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    prompt = render_chat(engine.tokenizer, [{"role": "user", "content": "hi"}])
    schema = GrammarSpec.json_schema({"type": "object", "required": ["a"], "properties": {"a": {"type": "integer"}}})
    bias = {start: 6.0, end: 5.0}
    kinds = [SamplingParams(max_tokens=40, temperature=1.0, seed=1, logit_bias=bias),
             SamplingParams(max_tokens=40, temperature=1.0, seed=2, logit_bias=bias, structured=schema),
             SamplingParams(max_tokens=40, temperature=1.0, seed=3, logit_bias=bias, structured=schema,
                            reasoning_block=ReasoningBlock(end, inside=True)),
             SamplingParams(max_tokens=40, temperature=1.0, seed=4, logit_bias=bias, structured=schema,
                            reasoning_block=ReasoningBlock(end, start))]
    alone = [engine.generate([prompt], params)[0].token_ids for params in kinds]
    together = [c.token_ids for c in engine.generate([prompt] * len(kinds), kinds)]
    assert together == alone
    waited, opened = alone[2], alone[3]
    assert end in waited   # the waiting row wrote freely until </think>, then JSON
    assert opened[0] == start   # the first mask let the block open


def test_a_thinking_budget_closes_the_block_at_its_count(make_tiny_model):
    """Anthropic's budget_tokens: at most that many reasoning tokens, then </think>; the
    answer after it is sampled as before (the same seed gives the same tokens up to the cut)."""
    from ruvllm_cli.engine.chat_template import render_chat
    from ruvllm_cli.engine.config import EngineConfig
    from ruvllm_cli.engine.engine import LLMEngine
    from ruvllm_cli.engine.loader import load_model
    from ruvllm_cli.engine.sampling import ReasoningBlock, SamplingParams
    from ruvllm_cli.quantization import Quantization

    for mode in ("opens", "model"):
        engine = LLMEngine(load_model(make_tiny_model(reasoning=mode), "cpu", Quantization.F32),
                           EngineConfig(device="cpu"))
        start, end = engine.tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
        prompt = render_chat(engine.tokenizer, [{"role": "user", "content": "hi"}])
        bias = {start: 30.0} if mode == "model" else {}   # the model opens its block at once
        block = ReasoningBlock(end, start, inside=mode == "opens")
        free = engine.generate([prompt], SamplingParams(max_tokens=30, temperature=1.0, seed=7, logit_bias=bias,
                                                        ignore_eos=True))[0].token_ids
        cut = engine.generate([prompt], SamplingParams(max_tokens=30, temperature=1.0, seed=7, logit_bias=bias,
                                                       ignore_eos=True, reasoning_block=block,
                                                       thinking_budget=5))[0].token_ids
        opened = 1 if mode == "model" else 0
        assert mode == "opens" or cut[0] == start
        assert end not in free[:opened + 5]   # unbudgeted, it would have gone on reasoning
        assert cut[:opened + 5] == free[:opened + 5] and cut[opened + 5] == end
