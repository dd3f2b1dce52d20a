"""From a `--lora NAME=PATH` value to a local PEFT adapter directory (no torch).

PATH is a directory, or a hub id fetched once through the registry's download path
into the same cache as models (so `ruvllm list` shows it and `ruvllm rm` removes it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

from ruvllm_cli.errors import UsageError
from ruvllm_cli.quantization import Quantization
from ruvllm_cli.registry.cache import ModelCache
from ruvllm_cli.registry.download import ADAPTER_CONFIG, download_model
from ruvllm_cli.registry.progress import DownloadObserver
from ruvllm_cli.registry.registry import resolve_model


def locate_adapter(spec: str, cache_dir: Path, observer: DownloadObserver | None = None,
                   on_fetch: Callable[[], None] | None = None) -> Path:
    """The adapter directory `spec` names; a hub id not downloaded yet is fetched
    (`on_fetch` called first: a cached one is no fetch, and said none)."""
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / ADAPTER_CONFIG).is_file():
            raise UsageError(f"{spec} is not a PEFT adapter directory (no {ADAPTER_CONFIG})",
                             "pass the directory peft's save_pretrained() wrote")
        return path
    if not names_hub_adapter(spec):
        raise UsageError(f"no adapter directory {spec}", "pass a PEFT adapter directory or a hub id (owner/name)")
    ref = resolve_model(spec)
    if ref.kind != "hub" or ref.repo_id is None:
        raise UsageError(f"{spec} names a model, not a LoRA adapter")
    cache = ModelCache(cache_dir)
    found = cache.find(ref.repo_id, ref.revision)
    if found is None:
        if on_fetch is not None:
            on_fetch()
        found = download_model(ref, Quantization.F16, cache, progress=observer)
    if not (found.path / ADAPTER_CONFIG).is_file():
        raise UsageError(f"{spec} is not a LoRA adapter repo (no {ADAPTER_CONFIG})")
    return found.path


def names_hub_adapter(spec: str) -> bool:
    """Whether `spec` names an adapter on the hub (owner/name, nothing by that path here,
    and not written as a path), which `locate_adapter` finds in the cache or fetches."""
    return not Path(spec).expanduser().exists() and not spec.startswith((".", "/", "~")) and spec.count("/") == 1


# Ollama's default tag: a served name with it is the name without it (server/models.py),
# so an adapter so named would take over a model's (or another adapter's) `:latest` name.
LATEST = ":latest"
LATEST_RULE = ("an adapter's name may not end in ':latest' (Ollama's default tag: 'NAME:latest' is NAME, "
               "a served model or adapter)")


def parse_lora_specs(specs: Sequence[str]) -> list[tuple[str, str]]:
    """`NAME=PATH` options (PATH a directory or a hub id) -> [(name, path)]; a bare
    PATH is named after its last component."""
    pairs: list[tuple[str, str]] = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep:
            name, path = Path(spec.rstrip("/")).name, spec
        name, path = name.strip(), path.strip()
        if not name or not path:
            raise UsageError(f"--lora {spec!r}: expected NAME=PATH (a PEFT adapter directory or hub id)")
        if name.endswith(LATEST):
            raise UsageError(f"--lora {spec!r}: {LATEST_RULE}")
        if any(n == name for n, _ in pairs):
            raise UsageError(f"--lora: the name {name} is given twice")
        pairs.append((name, path))
    return pairs
