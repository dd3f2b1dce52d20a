"""Incremental detokenization (UTF-8 safe) and stop strings held back while partial."""

from ruvllm_cli.engine.detokenizer import IncrementalDetokenizer, StopMatcher


def test_stream_equals_full_decode_including_multibyte(loaded):
    tok = loaded.tokenizer
    text = "Hello wörld, 日本語 and emoji 🎉🚀 done."
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt_ids=tok.encode("Say:", add_special_tokens=False))
    pieces = [detok.add(i) for i in ids]
    assert "".join(pieces) == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces)


def test_kept_special_tokens_stay_and_the_other_special_tokens_go(loaded):
    """A tool-call format's markers reach its parser as text; <|im_start|> and the
    like still do not reach the reply."""
    tok = loaded.tokenizer
    special = {t.content: i for i, t in tok.added_tokens_decoder.items() if t.special}
    kept, dropped = "<|im_end|>", ("<|pad|>", "<|im_start|>")
    ids = [*tok.encode("Hi", add_special_tokens=False), special["<|pad|>"], special[kept],
           *tok.encode(" there", add_special_tokens=False), special["<|im_start|>"]]
    for skip, keep, shown, hidden in ((True, (kept,), (kept,), dropped), (True, (), (), (kept, *dropped)),
                                      (False, (kept,), (kept, *dropped), ())):
        detok = IncrementalDetokenizer(tok, prompt_ids=[], skip_special_tokens=skip, kept_special_tokens=keep)
        text = "".join(detok.add(i) for i in ids) + detok.flush()
        assert text.startswith("Hi") and "there" in text
        assert all(s in text for s in shown) and not any(s in text for s in hidden), (skip, keep, text)


def test_stop_matcher_holds_back_a_partial_stop():
    m = StopMatcher(["END"])
    assert m.feed("abc E") == ("abc ", False)
    assert m.feed("N") == ("", False)
    assert m.feed("D tail") == ("", True)
    assert m.text == "abc " and m.matched == "END"


def test_stop_matcher_releases_a_false_alarm_and_flushes():
    m = StopMatcher(["END"])
    assert m.feed("xE") == ("x", False)
    assert m.feed("Nx") == ("ENx", False)
    assert m.feed("EN") == ("", False)
    assert m.flush() == "EN"


def test_stop_split_over_many_deltas_and_earliest_wins():
    m = StopMatcher(["world", "lo w"])
    out = [m.feed(c) for c in "hello world"]
    assert "".join(o[0] for o in out) == "hel"
    assert any(hit for _, hit in out)
    assert m.matched == "lo w"


def test_the_matched_stop_string_is_the_earliest_then_the_first_listed():
    m = StopMatcher(["cd", "bc", "b"])
    assert m.feed("abcd") == ("a", True)
    assert m.matched == "bc"
    assert StopMatcher(["x"]).matched is None


def test_stop_strings_apply_before_the_fence_only():
    """A tool call's opening (the parser's `opening`) fences the stop strings off: what
    follows it is a call, which a stop string must not cut (OpenAI's never does)."""
    m = StopMatcher(["}", "\n"], fence="<tool_call>")
    assert m.feed("Let me check") == ("Let me check", False)
    assert m.feed("<tool_call>") == ("<tool_call>", False)
    assert m.feed('\n{"name": "f", "arguments": {}}\n</tool_call>') == \
        ('\n{"name": "f", "arguments": {}}\n</tool_call>', False)
    assert not m.stopped and m.flush() == ""
    before = StopMatcher(["\n"], fence="<tool_call>")   # before the call it still ends the reply
    assert before.feed("one\ntwo<tool_call>") == ("one", True) and before.matched == "\n"
    astride = StopMatcher(["x<tool"], fence="<tool_call>")   # a stop string must end before the fence
    assert astride.feed("ax<tool_call>{") == ("ax<tool_call>{", False)
    held = StopMatcher(["END"], fence="<tool_call>")   # a held partial stop is text once the call opens
    assert held.feed("a E") == ("a ", False)
    assert held.feed("<tool_call>END") == ("E<tool_call>END", False)
    start = StopMatcher(["}"], fence=r"\A\s*\{")   # llama3_json: a call only at the reply's start
    assert start.feed(' {"name": "f"}') == (' {"name": "f"}', False)
    later = StopMatcher(["}"], fence=r"\A\s*\{")
    assert later.feed('x {"a": 1}') == ('x {"a": 1', True)


def test_streamed_text_equals_one_decode_of_the_reply(make_engine, loaded):
    """Whatever the model emits, including a reply cut inside a multi-byte
    character, the stream's text is exactly the reply decoded in one go."""
    from ruvllm_cli.engine.sampling import SamplingParams

    engine = make_engine()
    for seed in range(6):
        out = engine.generate([[7 + seed, 200, 31, 5]], SamplingParams(
            max_tokens=5 + seed, temperature=1.0, seed=seed, ignore_eos=True))[0]
        assert out.text == loaded.tokenizer.decode(out.token_ids, skip_special_tokens=True)
