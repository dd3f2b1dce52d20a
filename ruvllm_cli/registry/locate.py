"""From a MODEL argument to the local weights the engine loads (no network, no torch)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ruvllm_cli.errors import NotDownloadedError
from ruvllm_cli.quantization import Quantization
from ruvllm_cli.registry.cache import DownloadedModel, ModelCache
from ruvllm_cli.registry.registry import ModelRef, resolve_model


@dataclass(frozen=True)
class LocatedModel:
    ref: ModelRef
    path: Path          # a directory with config.json, or a .gguf file
    served_name: str    # what /v1/models and banners call it


def check_readable(located: LocatedModel) -> None:
    """What a load would find wrong first, found without torch or reading weights: the
    directory's config.json is a JSON object, the GGUF file's header is sound. `serve`
    checks each MODEL so before it listens, rather than announcing a server that dies."""
    from ruvllm_cli.registry.model_config import read_model_dir_config

    path = located.path
    if path.suffix == ".gguf" and path.is_file():
        from ruvllm_cli.engine.gguf_check import check_gguf

        check_gguf(path)
    elif path.is_dir():
        read_model_dir_config(path)


def gguf_variant(ref: ModelRef, quantization: Quantization) -> tuple[ModelRef, str] | None:
    """The registry's pre-quantized GGUF file for `quantization`, where it names one:
    (a reference to the GGUF repo at the alias's revision, the exact file name)."""
    entry = ref.entry
    if ref.kind != "registry" or entry is None or not entry.gguf_repo:
        return None
    name = entry.gguf_files.get(quantization)
    if not name:
        return None
    return ModelRef(kind="hub", repo_id=entry.gguf_repo, revision=ref.revision, entry=entry), name


def download_repos(ref: ModelRef) -> list[str]:
    """The repos `download` may have fetched for `ref`: an alias's GGUF repo (its default)
    and its safetensors repo (--safetensors); a hub id's own repo only."""
    entry = ref.entry
    gguf = [entry.gguf_repo] if ref.kind == "registry" and entry is not None and entry.gguf_repo else []
    return [*gguf, ref.repo_id] if ref.repo_id else gguf


def loads_gguf(ref: ModelRef, quantization: Quantization, cache: ModelCache) -> bool:
    """Whether `locate_model` gives, or once downloaded would give, the registry's GGUF
    file for `quantization` (what `download` fetches) rather than safetensors: the
    registry names one and the safetensors are not in the cache."""
    return (gguf_variant(ref, quantization) is not None
            and cache.find(ref.repo_id, ref.revision) is None)   # type: ignore[arg-type]


def locate_model(name: str, cache_dir: Path, quantization: Quantization | None = None) -> LocatedModel:
    """Resolve `name` (path, alias or HF id) and find its files: a local path as is;
    else the downloaded safetensors, or for an alias its downloaded GGUF variant (of
    `quantization` when given); else a NotDownloadedError that says how to fetch it."""
    ref = resolve_model(name)
    if ref.kind == "local":
        assert ref.local_path is not None
        # A user alias of a local model is served under the alias.
        return LocatedModel(ref, ref.local_path, ref.entry.alias if ref.entry else ref.local_path.name)
    assert ref.repo_id is not None
    cache = ModelCache(cache_dir)
    served = ref.entry.alias if ref.kind == "registry" and ref.entry else ref.repo_id
    found = cache.find(ref.repo_id, ref.revision)
    if found is not None:
        return LocatedModel(ref, _model_path(ref, found, quantization), served)
    gguf = downloaded_gguf(ref, cache, quantization)
    if gguf is not None:
        return LocatedModel(ref, gguf, served)
    target = name.split("@")[0] if ref.kind == "registry" else ref.repo_id
    revision = f" --revision {ref.revision}" if ref.revision else ""
    quant = f" -q {quantization.value}" if quantization else ""
    partly = " (only partly: the download did not finish, or its files changed since)" \
        if cache.partly_downloaded(ref.repo_id, ref.revision) else ""
    raise NotDownloadedError(f"{ref.display_name} is not downloaded{partly}",
                             f"run: ruvllm download {target}{quant}{revision}")


def _model_path(ref: ModelRef, found: DownloadedModel, quantization: Quantization | None) -> Path:
    """A download's snapshot directory; for a repo of GGUF files (no config.json), the
    file `quantization` names, else the first of q4k, q8, f16, f32 there, as `download`
    picks them. It was the directory, which no loader takes ("not a model directory")."""
    ggufs = [f.name for f in found.files if f.name.lower().endswith(".gguf")]
    if not ggufs or (found.path / "config.json").is_file():
        return found.path
    from ruvllm_cli.errors import DownloadError
    from ruvllm_cli.registry.download import choose_gguf, named_for_a_quantization

    for quant in [quantization] if quantization else list(Quantization):
        try:
            return found.path / choose_gguf(ggufs, quant)
        except DownloadError:
            continue
    if quantization is not None:
        # A file named for no -q is the repo's only GGUF file (choose_gguf): `download -q`
        # fails there with "leave out -q", so that is the hint that works.
        hint = (f"leave out -q to load {', '.join(sorted(ggufs))} as the type it is"
                if not any(named_for_a_quantization(name) for name in ggufs)
                else f"run: ruvllm download {ref.repo_id} -q {quantization.value}")
        raise NotDownloadedError(f"{ref.display_name} has no {quantization.label} GGUF file downloaded "
                                 f"(it has {', '.join(sorted(ggufs))})", hint)
    return found.path / sorted(ggufs)[0]


def downloaded_gguf(ref: ModelRef, cache: ModelCache, quantization: Quantization | None) -> Path | None:
    """The alias's downloaded GGUF variant `locate_model` loads when its safetensors are
    not in the cache: of `quantization`, else the recommended one, else any other."""
    recommended = ref.entry.recommended_quantization if ref.entry is not None else Quantization.Q4_K_M
    # Without -q: the registry's recommendation (what `download` fetches by default) first.
    wanted = [quantization] if quantization else [recommended, *(q for q in Quantization if q is not recommended)]
    for quant in wanted:
        variant = gguf_variant(ref, quant)
        if variant is None:
            continue
        gguf_ref, file_name = variant
        found = cache.find(gguf_ref.repo_id, gguf_ref.revision)  # type: ignore[arg-type]
        if found is not None and any(f.name == file_name for f in found.files):
            return found.path / file_name
    return None
