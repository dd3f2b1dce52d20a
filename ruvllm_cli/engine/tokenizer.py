"""The model's tokenizer without transformers' tokenizer classes, once it has been
checked against them (docs/design.md, section 9).

Building transformers' tokenizer costs a start about a second before any file is read:
`import transformers` builds its lazy import table from the source of every model it
ships (0.6 s here) and AutoTokenizer's modules take 0.35 s more, against llama.cpp's
whole start of 1.0-1.4 s. So the first load of a model builds transformers' tokenizer
as before, and ruvllm then writes down what that object resolved (the `tokenizers`
backend's whole JSON, special tokens, chat template, cleanup flag) beside the weight
cache, keeping it only if a `Tokenizer` read back from it answers a set of probes
(encodings, decodings, tokens, special tokens, chat renders with and without tools)
exactly as transformers' object does. Later loads read that file.

Chat templates still render through transformers' own `render_jinja_template` (its
sandbox is the part not to write twice), imported on first use; `warm_up()` imports it
ahead, in a thread, so a chat's first reply does not wait for it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any, Sequence

from ruvllm_cli import installed_version

log = logging.getLogger(__name__)

FORMAT = 1
ENV = "RUVLLM_OWN_TOKENIZER"   # "0": always transformers' tokenizer
SPECIAL = ("bos", "eos", "unk", "sep", "pad", "cls", "mask")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".msgpack", ".h5")
PROBE_TEXTS = (
    "Hello, world!",
    " leading space and  two  spaces\n\nand blank lines\t\ttabs ",
    "def f(x):\n    return x ** 2  # comment\n",
    "héllo wörld — ünïcödé, 中文, 日本語, emoji 😀🎉",
    "numbers 12345 3.14159 -0.5e10 and punctuation !?.,;:'\"()[]{}",
    "",
    " ",
    "<|im_start|>user\nhi<|im_end|><s></s><|endoftext|><|begin_of_text|>[INST] x [/INST]<unk>",
)
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CONVERSATIONS: tuple[tuple[list[dict[str, Any]], list[dict[str, Any]] | None], ...] = (
    ([{"role": "user", "content": "Hi there"}], None),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
      {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3? <|im_end|></s>"}], None),
    ([{"role": "user", "content": "Weather in Paris?"},
      {"role": "assistant", "content": "", "tool_calls": [
          {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
      {"role": "tool", "tool_call_id": "call_0", "name": "get_weather", "content": "{\"temp\": 21}"}], TOOLS),
    ([{"role": "user", "content": "What can you do?"}], TOOLS),
)


class Tokenizer:
    """The part of transformers' tokenizer API that ruvllm uses, over the `tokenizers`
    library's backend with the special tokens and chat template transformers resolved
    for this model. Built only from a file `save_checked` wrote."""

    def __init__(self, backend: Any, facts: dict[str, Any]) -> None:
        self._tokenizer = backend
        self.chat_template: str | dict[str, str] | None = facts["chat_template"]
        self.special_tokens_map: dict[str, str] = dict(facts["special_tokens_map"])
        self.all_special_tokens: list[str] = list(facts["all_special_tokens"])
        self.all_special_ids: list[int] = list(facts["all_special_ids"])
        self.clean_up_tokenization_spaces = False   # only such tokenizers are written down
        self.name_or_path: str = facts["name_or_path"]
        self.model_max_length: int = facts["model_max_length"]
        self.class_name: str = facts["class"]
        for name in SPECIAL:
            setattr(self, f"{name}_token", facts["special"].get(name))
            setattr(self, f"{name}_token_id", facts["special_ids"].get(name))

    def __repr__(self) -> str:
        return f"Tokenizer({self.class_name} of {self.name_or_path!r}, {len(self)} tokens; ruvllm's)"

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def __bool__(self) -> bool:
        return True

    @property
    def backend_tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=False)

    @property
    def added_tokens_decoder(self) -> dict[int, Any]:
        return self._tokenizer.get_added_tokens_decoder()

    def get_added_vocab(self) -> dict[str, int]:
        return {token.content: index for index, token in sorted(self.added_tokens_decoder.items())}

    def get_vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # The batch call lets go of the GIL while it works (`encode` keeps it: a 3.6 MB
        # prompt on a server's worker thread held every other request for 6 s), and
        # leaves out the offsets nothing here reads (half the time).
        return self._tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: int | Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else [int(i) for i in token_ids]
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: int | Sequence[int], skip_special_tokens: bool = False) -> Any:
        if isinstance(ids, int):
            return self._tokenizer.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._tokenizer.id_to_token(int(i)) for i in ids if int(i) not in skip]

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> Any:
        def one(token: str) -> int | None:
            index = self._tokenizer.token_to_id(token)
            return self.unk_token_id if index is None else index   # type: ignore[attr-defined]

        return one(tokens) if isinstance(tokens, str) else [one(t) for t in tokens]

    def apply_chat_template(self, conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                            add_generation_prompt: bool = False, tokenize: bool = True,
                            return_dict: bool = False, **kwargs: Any) -> str | list[int]:
        """As transformers' method for one conversation (what ruvllm asks of it): the
        template picked and rendered by transformers' own functions, the text encoded
        without special tokens added."""
        if return_dict and tokenize:
            raise NotImplementedError("ruvllm's tokenizer returns token ids, not a dict")
        if kwargs.get("sanitize_control_tokens") or kwargs.get("return_assistant_tokens_mask"):
            raise NotImplementedError("control-token sanitizing and assistant masks are transformers' own")
        if not conversation:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        render = _renderer()
        template = self._template(kwargs.pop("chat_template", None), tools)
        messages = [{k: v for k, v in message.items() if v is not None} for message in conversation]
        rendered, _ = render(conversations=[messages], tools=tools, documents=kwargs.pop("documents", None),
                             chat_template=template, add_generation_prompt=add_generation_prompt,
                             continue_final_message=kwargs.pop("continue_final_message", False),
                             **{**self.special_tokens_map, **kwargs})
        return self.encode(rendered[0], add_special_tokens=False) if tokenize else rendered[0]

    def _template(self, chosen: str | None, tools: list[dict[str, Any]] | None) -> str:
        """transformers' `get_chat_template` rule: a named template, or "tool_use" with
        tools, or "default"; a single template as it is."""
        templates = self.chat_template
        if isinstance(templates, dict):
            if chosen is not None:
                return templates.get(chosen, chosen)
            if tools is not None and "tool_use" in templates:
                return templates["tool_use"]
            if "default" in templates:
                return templates["default"]
            raise ValueError(f"This model has several chat templates and no default: {sorted(templates)}")
        if chosen is not None:
            return chosen
        if templates is None:
            raise ValueError("this model has no chat template")
        return templates


def _renderer() -> Any:
    from transformers.utils.chat_template_utils import render_jinja_template

    return render_jinja_template


def warm_up(tokenizer: Any) -> threading.Thread | None:
    """For ruvllm's tokenizer with a chat template: import the renderer in a thread,
    so a chat's first reply does not wait for transformers' import (0.6 s) that the
    load left out; returns the thread, started. transformers' tokenizer has it already."""
    if not isinstance(tokenizer, Tokenizer) or not tokenizer.chat_template:
        return None
    global _warming
    thread = threading.Thread(target=_renderer, name="ruvllm-template-import", daemon=False)
    thread.start()
    _warming = thread
    return thread


_warming: threading.Thread | None = None


def imports_settled() -> None:
    """Wait for warm_up's import of transformers. Another thread importing a library
    that imports transformers meanwhile (peft, for a LoRA adapter loaded right after
    the server starts) could see it half-initialised: "cannot import name 'AutoModel'"."""
    if _warming is not None:
        _warming.join()


def enabled(use_cache: bool) -> bool:
    """Whether loads read and write the record: the switches of the caches beside a model
    (`--no-weight-cache`, RUVLLM_WEIGHT_CACHE=0) and RUVLLM_OWN_TOKENIZER=0 turn it off."""
    from ruvllm_cli.engine.weight_cache import ENV as CACHE_ENV

    return use_cache and os.environ.get(ENV, "1") != "0" and os.environ.get(CACHE_ENV, "1") != "0"


def record(model_path: Path) -> Path:
    """Where the checked tokenizer of a model directory or GGUF file is written: in the
    weight cache's directory, keyed by the files a tokenizer is built from (every file
    but the weights, or the GGUF file itself) and the versions of transformers and
    tokenizers that resolved it."""
    from ruvllm_cli.engine.weight_cache import CACHE_DIR

    versions = "\0".join(installed_version(package) or "-" for package in ("transformers", "tokenizers"))
    digest = hashlib.sha256(f"{FORMAT}\0{versions}\0".encode())
    if model_path.suffix == ".gguf":
        files, folder = [model_path], model_path.parent
        prefix = "vocab.gguf" + hashlib.sha256(model_path.name.encode()).hexdigest()[:8]
    else:
        files = sorted(f for f in model_path.iterdir() if f.is_file() and not f.name.startswith(".")
                       and not f.name.endswith(WEIGHT_SUFFIXES))
        folder, prefix = model_path, "vocab"
    for file in files:
        stat = file.stat()
        digest.update(f"{file.name}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
    return folder / CACHE_DIR / f"{prefix}-{digest.hexdigest()[:16]}.json"


def _found_different(path: Path) -> bool:
    """Whether `path` records that these files' tokenizer answered a probe differently."""
    try:
        return path.stat().st_size < 4096 and "differs" in json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False


def load(model_path: Path) -> Tokenizer | None:
    """The tokenizer written down for this model, or None (none yet, stale, damaged,
    or found to answer differently: transformers' is used)."""
    path = record(model_path)
    if not path.is_file():
        return None
    try:
        from tokenizers import Tokenizer as Backend

        facts = json.loads(path.read_text(encoding="utf-8"))
        if facts.get("format") != FORMAT or "differs" in facts:
            return None
        return Tokenizer(Backend.from_str(facts.pop("backend")), facts)
    except Exception as error:  # noqa: BLE001 - a damaged file: transformers builds the tokenizer again
        log.info("the tokenizer record %s was not read: %s", path, error)
        return None


def save_checked(tokenizer: Any, model_path: Path) -> bool:
    """Write down transformers' `tokenizer` for `model_path` if a `Tokenizer` built from
    the record answers every probe as it does; True when written (fsutil's atomic
    write); a failure only costs the next start time."""
    from ruvllm_cli.fsutil import write_text_atomic

    path = record(model_path)
    facts = _facts(tokenizer)
    if facts is None or _found_different(path):
        return False
    try:
        from tokenizers import Tokenizer as Backend

        ours = Tokenizer(Backend.from_str(facts["backend"]), {k: v for k, v in facts.items() if k != "backend"})
        difference = differs(tokenizer, ours)
        if difference is not None:
            log.info("ruvllm's tokenizer is not used for %s: %s", model_path, difference)
            # Written down too, so that later loads (the same files and versions) skip the
            # probes; short, as _found_different reads only a small file.
            facts = {"format": FORMAT, "differs": difference[:1000]}
        for stale in path.parent.glob(f"{path.name.split('-')[0]}-*.json"):
            stale.unlink(missing_ok=True)
        write_text_atomic(path, json.dumps(facts))
        return difference is None
    except Exception as error:  # noqa: BLE001 - a read-only directory, a file where it goes, an unreadable tokenizer
        log.info("the tokenizer of %s was not written down: %s", model_path, error)
        return False


def _facts(tokenizer: Any) -> dict[str, Any] | None:
    """What a `Tokenizer` needs from transformers' object; None where ruvllm's would not
    behave the same by construction (no `tokenizers` backend, word-piece cleanup)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(tokenizer, "special_tokens_map"):
        return None
    cleans_up = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
    if cleans_up and (type(backend.model).__name__ != "BPE" or getattr(
            tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)):
        return None   # transformers rewrites the decoded text ("do n't" -> "don't")
    if getattr(tokenizer, "split_special_tokens", False):
        return None
    template = tokenizer.chat_template
    if not (template is None or isinstance(template, str)
            or (isinstance(template, dict) and all(isinstance(v, str) for v in template.values()))):
        return None
    max_length = getattr(tokenizer, "model_max_length", 0)
    return {"format": FORMAT, "class": type(tokenizer).__name__, "backend": backend.to_str(),
            "chat_template": template,
            "special_tokens_map": {k: str(v) for k, v in tokenizer.special_tokens_map.items()},
            "all_special_tokens": [str(t) for t in tokenizer.all_special_tokens],
            "all_special_ids": [int(i) for i in tokenizer.all_special_ids],
            "special": {n: _plain(getattr(tokenizer, f"{n}_token", None)) for n in SPECIAL},
            "special_ids": {n: getattr(tokenizer, f"{n}_token_id", None) for n in SPECIAL},
            "name_or_path": str(getattr(tokenizer, "name_or_path", "")),
            "model_max_length": int(max_length) if isinstance(max_length, int) and max_length < 2**62 else 0}


def _plain(token: Any) -> str | None:
    return None if token is None else str(token)


def differs(theirs: Any, ours: Any) -> str | None:
    """The first probe on which two tokenizers answer differently, or None: transformers'
    and ruvllm's here, transformers' and its saved copy for a GGUF file (weight_cache)."""
    checks: list[tuple[str, Any]] = [
        ("length", lambda t: len(t)), ("special tokens", lambda t: t.all_special_tokens),
        ("special ids", lambda t: t.all_special_ids), ("added vocabulary", lambda t: t.get_added_vocab()),
        ("special token ids", lambda t: [getattr(t, f"{n}_token_id") for n in SPECIAL]),
        ("special token strings", lambda t: [_plain(getattr(t, f"{n}_token")) for n in SPECIAL]),
    ]
    ids: list[int] = []
    for text in PROBE_TEXTS:
        for special in (True, False):
            checks.append((f"encode({text!r}, {special})",
                           lambda t, text=text, special=special: t.encode(text, add_special_tokens=special)))
        ids += theirs.encode(text)
    size = len(theirs)
    spread = list(range(0, size, max(1, size // 997))) + sorted(theirs.all_special_ids) + [size - 1]
    for name, sample in (("probe ids", ids), ("ids across the vocabulary", spread)):
        for skip in (False, True):
            checks.append((f"decode({name}, {skip})",
                           lambda t, sample=sample, skip=skip: t.decode(sample, skip_special_tokens=skip)))
        checks.append((f"tokens of {name}", lambda t, sample=sample: t.convert_ids_to_tokens(sample)))
        checks.append((f"one-id decodes of {name}", lambda t, sample=sample: [t.decode([i]) for i in sample[:400]]))
    if theirs.chat_template:
        for turn, (messages, tools) in enumerate(CONVERSATIONS):
            for prompt in (True, False):
                checks.append((f"chat render {turn} (tools: {tools is not None}, generation prompt: {prompt})",
                               lambda t, messages=messages, tools=tools, prompt=prompt: t.apply_chat_template(
                                   messages, tools=tools, add_generation_prompt=prompt, tokenize=True,
                                   return_dict=False)))
    for what, check in checks:
        if _answer(check, theirs) != _answer(check, ours):
            return f"they differ in {what}"
    return None


def _answer(check: Any, tokenizer: Any) -> Any:
    try:
        value = check(tokenizer)
        return list(value) if isinstance(value, tuple) else value
    except Exception as error:  # noqa: BLE001 - both must fail alike (a template that rejects a probe)
        return ("raised", type(error).__name__)
