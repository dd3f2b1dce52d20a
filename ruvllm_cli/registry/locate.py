"""From a MODEL argument to the local directory the engine loads (no network, no torch)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ruvllm_cli.errors import NotDownloadedError
from ruvllm_cli.registry.cache import ModelCache
from ruvllm_cli.registry.registry import ModelRef, resolve_model


@dataclass(frozen=True)
class LocatedModel:
    ref: ModelRef
    path: Path          # a directory with config.json, or a .gguf file
    served_name: str    # what /v1/models and banners call it


def locate_model(name: str, cache_dir: Path) -> LocatedModel:
    """Resolve `name` (path, alias or HF id) and find its files: a local path as is,
    anything else in the cache, or a NotDownloadedError that says how to fetch it."""
    ref = resolve_model(name)
    if ref.kind == "local":
        assert ref.local_path is not None
        return LocatedModel(ref, ref.local_path, ref.local_path.name)
    assert ref.repo_id is not None
    found = ModelCache(cache_dir).find(ref.repo_id, ref.revision)
    if found is None:
        target = name.split("@")[0] if ref.kind == "registry" else ref.repo_id
        revision = f" --revision {ref.revision}" if ref.revision else ""
        raise NotDownloadedError(f"{ref.display_name} is not downloaded",
                                 f"run: ruvllm download {target}{revision}")
    served = ref.entry.alias if ref.kind == "registry" and ref.entry else ref.repo_id
    return LocatedModel(ref, found.path, served)
