"""The front door's view of a model whose engines run elsewhere (no Ray, no weights).

A replica reports `ModelFacts` once it has loaded; the front door builds a
`ModelView` from them, which answers what preparing a request asks of an engine
(tokenizer, context, vocabulary, grammar checks, adapters' names) exactly as the
replicas' own engines would: the tokenizer is the replica's own, sent over."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Sequence

from ruvllm_cli.engine.engine import check_prompt_ids
from ruvllm_cli.engine.lora import AdapterNotFoundError


@dataclass(frozen=True)
class ModelFacts:
    """What the front door needs of a loaded model; the same on every replica."""

    tokenizer: Any               # transformers' tokenizer, pickled from the replica
    model_config: Any            # transformers' PretrainedConfig (architectures, for the tool parser)
    max_model_len: int
    vocab_size: int
    max_num_seqs: int            # one engine's batch
    block_size: int              # KV block size: the router hashes prefixes in these blocks
    eos_token_ids: tuple[int, ...]
    adapters: tuple[str, ...]    # --lora names
    described: str               # OpenedEngine.describe()
    kv_summary: str              # OpenedEngine.kv_summary()
    sampling_defaults: dict[str, float | int]   # the model's recommended sampling (LLMEngine's)
    # What the routes read of an engine's config and memory besides (a priority under
    # fcfs is a 400; Ollama's quantization_level and /api/ps size): one replica's.
    scheduling_policy: str = "fcfs"
    quantization: Any = None     # ruvllm_cli.quantization.Quantization
    weight_bytes: int | None = None
    kv_cache_bytes: int | None = None
    device: Any = None           # torch.device of the replica's engine

    @classmethod
    def of(cls, opened: Any) -> "ModelFacts":
        """From an OpenedEngine (cli.engine_setup), in the replica."""
        engine = opened.engine
        return cls(engine.tokenizer, engine.loaded.model.config, engine.max_model_len, engine.vocab_size,
                   engine.config.max_num_seqs, engine.config.block_size, tuple(engine.loaded.eos_token_ids),
                   tuple(engine.lora.names()), opened.describe(), opened.kv_summary(), engine.sampling_defaults,
                   engine.config.scheduling_policy, engine.config.quantization, engine.loaded.weight_bytes,
                   engine.kv_cache_bytes, engine.loaded.device)


class StaticAdapters:
    """The LoRA adapters every replica loaded at start (run-time loading is off)."""

    def __init__(self, names: Sequence[str]) -> None:
        self._names = list(names)

    def names(self) -> list[str]:
        return list(self._names)


class ModelView:
    """Stands in for LLMEngine where the server prepares requests (see EngineClient.engine)."""

    def __init__(self, facts: ModelFacts, max_replicas: int) -> None:
        self.facts = facts
        self.tokenizer = facts.tokenizer
        self.max_model_len = facts.max_model_len
        self.vocab_size = facts.vocab_size
        self.sampling_defaults = dict(facts.sampling_defaults)
        # Admission holds sequences for every replica the deployment may grow to.
        self.config = SimpleNamespace(max_num_seqs=facts.max_num_seqs * max_replicas, block_size=facts.block_size,
                                      scheduling_policy=facts.scheduling_policy, quantization=facts.quantization)
        self.loaded = SimpleNamespace(model=SimpleNamespace(config=facts.model_config),
                                      eos_token_ids=list(facts.eos_token_ids), weight_bytes=facts.weight_bytes,
                                      device=facts.device)
        self.kv_cache_bytes = facts.kv_cache_bytes
        self.lora = StaticAdapters(facts.adapters)
        self._grammar_lock = threading.Lock()
        self._grammar_compiler: Any = None

    @property
    def grammar_compiler(self) -> Any:
        """Checks grammars before a request leaves (each replica compiles its own)."""
        from ruvllm_cli.engine.grammar import GrammarCompiler

        with self._grammar_lock:
            if self._grammar_compiler is None:
                self._grammar_compiler = GrammarCompiler(self.tokenizer, self.vocab_size,
                                                         eos_token_ids=self.facts.eos_token_ids)
            return self._grammar_compiler

    def prepare_prompt(self, prompt_ids: Sequence[int]) -> list[int]:
        ids = list(prompt_ids)
        check_prompt_ids(ids, self.max_model_len, self.vocab_size)
        return ids

    def adapter(self, name: str) -> str:
        if name not in self.facts.adapters:
            loaded = ", ".join(self.facts.adapters) or "none"
            raise AdapterNotFoundError(f"no LoRA adapter named {name} is loaded (loaded: {loaded})")
        return name
