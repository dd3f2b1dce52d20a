"""`ruvllm list`: the registry's models (with memory estimates), or the downloaded ones."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import click
from rich.filesize import decimal as format_size
from rich.markup import escape
from rich.table import Table

from ruvllm_cli.cli.context import app_context, global_options
from ruvllm_cli.cli.output import Output
from ruvllm_cli.errors import RuvllmError
from ruvllm_cli.registry.cache import DownloadedModel, ModelCache
from ruvllm_cli.registry.memory import DEFAULT_CONTEXT, estimate_memory, format_bytes
from ruvllm_cli.quantization import Quantization
from ruvllm_cli.registry.locate import downloaded_gguf, loads_gguf
from ruvllm_cli.registry.registry import ModelEntry, ModelRef, load_registry

MEMORY_CAPTION = ("Memory: weights as `ruvllm chat` would hold them on a CPU without -q (the downloaded GGUF "
                  "file, else the one `ruvllm download` fetches at the recommended quantization where the "
                  "registry names one, unless the safetensors are downloaded; safetensors as f16) + KV cache for "
                  f"{DEFAULT_CONTEXT:,} tokens + runtime overhead.")


def format_params(params_b: float | None) -> str:
    """`7.62B`, `494M`; under a million with one decimal (`0.1M`), where a tiny model had read `0M`."""
    if params_b is None:
        return "-"
    if params_b >= 1:
        return f"{params_b:.2f}B"
    return f"{params_b * 1000:.0f}M" if params_b >= 0.001 else f"{params_b * 1000:.1f}M"


def entry_memory(entry: ModelEntry, cache: ModelCache) -> dict[str, Any] | None:
    """Memory estimate of what `chat` would load without -q (registry.locate,
    engine_setup.default_quantization): a downloaded GGUF variant or GGUF path at its
    own type, else the GGUF file at the entry's recommended quantization where it
    would load one, safetensors as
    f16; None without a parameter count. (Safetensors had been estimated at the
    recommended quantization, q8 where chat holds f16.)"""
    from ruvllm_cli.cli.engine_setup import DEFAULT_QUANTIZATION, files_quantization

    if entry.params is None:
        return None
    if entry.path is not None:
        gguf = entry.path.suffix == ".gguf"
        quantization = files_quantization(entry.path) if entry.path.exists() else DEFAULT_QUANTIZATION
    else:
        gguf, quantization = _registry_load(entry, cache)
    return estimate_memory(entry.params, quantization, entry.kv_shape, gguf=gguf)


def _registry_load(entry: ModelEntry, cache: ModelCache) -> tuple[bool, Quantization]:
    """(a GGUF file?, its quantization) of what `chat ALIAS` loads without -q, as
    registry.locate picks it: the safetensors when downloaded, else a downloaded GGUF
    variant at its own type (only q4k downloaded: q4k, where list had said the
    recommended q8), else what `download` would fetch."""
    from ruvllm_cli.cli.engine_setup import DEFAULT_QUANTIZATION, files_quantization

    ref = ModelRef("registry", entry.repo_id, entry=entry)
    if cache.find(entry.repo_id) is None:
        downloaded = downloaded_gguf(ref, cache, None)
        if downloaded is not None:
            return True, files_quantization(downloaded)
    if loads_gguf(ref, entry.recommended_quantization, cache):
        return True, entry.recommended_quantization
    return False, DEFAULT_QUANTIZATION


def downloads_of(entry: ModelEntry, downloaded: list[DownloadedModel]) -> list[DownloadedModel]:
    """Complete downloads of the entry's safetensors repo or of its GGUF repo."""
    repos = {entry.repo_id.lower()} | ({entry.gguf_repo.lower()} if entry.gguf_repo else set())
    return [model for model in downloaded if model.repo_id.lower() in repos]


def with_config_facts(entry: ModelEntry, mine: list[DownloadedModel]) -> ModelEntry:
    """An entry that does not give its size (a user alias) with what its files say: its
    local directory's config.json, else its download's. A user alias of a downloaded
    repo showed "-" for params and memory, which `info` read fine."""
    from ruvllm_cli.errors import ModelLoadError
    from ruvllm_cli.registry.model_config import count_parameters, read_model_config

    directory = entry.path if entry.path is not None else (mine[0].path if mine else None)
    if entry.params is not None or directory is None or not Path(directory).is_dir():
        return entry
    try:
        shape = read_model_config(Path(directory))
    except ModelLoadError:
        return entry
    count = count_parameters(shape)
    return dataclasses.replace(entry, exact_params=count, params_b=_billions(count),
                               num_layers=shape.num_layers, num_kv_heads=shape.num_kv_heads,
                               head_dim=shape.head_dim, architecture=entry.architecture or shape.architecture,
                               context_length=entry.context_length or shape.context_length)


def _billions(count: int) -> float:
    """Six decimals: three had made a 106,816-parameter model 0.0 billion."""
    return round(count / 1e9, 6)


def with_gguf_facts(entry: ModelEntry, cache: ModelCache) -> tuple[ModelEntry, dict[str, Any] | None]:
    """An entry that does not give its size and loads a GGUF file (its path, or its
    download's file) with the count and memory estimate `info` reads from that file's
    header, at the quantization chat loads it with; where there is none, as it was."""
    from ruvllm_cli.cli.engine_setup import files_quantization
    from ruvllm_cli.cli.info import gguf_memory, read_gguf

    path = _loaded_gguf(entry, cache)
    layout = read_gguf(path) if path is not None else None
    if layout is None or isinstance(layout, RuvllmError):
        return entry, None
    count, table = gguf_memory(layout)
    facts = dataclasses.replace(entry, exact_params=count, params_b=_billions(count))
    return facts, table[files_quantization(path).value]


def _loaded_gguf(entry: ModelEntry, cache: ModelCache) -> Path | None:
    """The GGUF file `chat ALIAS` loads, or None (not one, or not there)."""
    from ruvllm_cli.registry.locate import locate_model

    try:
        path = locate_model(entry.alias, cache.root).path
    except RuvllmError:
        return None
    return path if path.suffix.lower() == ".gguf" and path.is_file() else None


def registry_record(entry: ModelEntry, downloaded: list[DownloadedModel], cache: ModelCache) -> dict[str, Any]:
    mine = downloads_of(entry, downloaded)
    entry = with_config_facts(entry, mine)
    memory = entry_memory(entry, cache)
    if entry.params is None:   # no config.json: a GGUF file's header may say
        entry, memory = with_gguf_facts(entry, cache)
    return {
        **entry.to_dict(),
        "memory_estimate": memory,
        "downloaded": bool(mine),
        "downloads": [{"repo_id": m.repo_id, "revision": m.revision, "commit": m.commit,
                       "stored_as": m.stored_as, "path": str(m.path)} for m in mine],
    }


def downloaded_record(model: DownloadedModel, aliases: dict[str, list[str]], cache: ModelCache) -> dict[str, Any]:
    """A download as `list -d` shows it; `current` is false for an older commit of a
    branch that moved on (chat loads the newer one; `rm ID@COMMIT` frees this)."""
    return {**model.to_json(), "aliases": aliases.get(model.repo_id.lower(), []),
            "current": cache.is_current(model)}


def _aliases_by_repo(registry: dict[str, ModelEntry]) -> dict[str, list[str]]:
    index: dict[str, list[str]] = {}
    for entry in registry.values():
        for repo in filter(None, (entry.repo_id, entry.gguf_repo)):
            index.setdefault(repo.lower(), []).append(entry.alias)
    return index


# ---------------------------------------------------------------- rendering

def _memory_cell(record: dict[str, Any]) -> str:
    memory = record["memory_estimate"]
    if memory is None:
        return "-"
    return f"{format_bytes(memory['total_bytes'])} ({memory['quantization']})"


def _alias_cell(record: dict[str, Any]) -> str:
    return f"{record['alias']} (user)" if record["user"] else record["alias"]


def _status_cell(record: dict[str, Any]) -> str:
    """`local`, or `missing` for an alias whose path is gone (info fails on it), `downloaded`, `-`."""
    if record["path"]:
        return "local" if Path(record["path"]).exists() else "missing"
    return "downloaded" if record["downloaded"] else "-"


def render_registry(out: Output, records: list[dict[str, Any]]) -> None:
    rows = [(escape(_alias_cell(r)), escape(r["name"]), format_params(r["params_b"]), _memory_cell(r),
             _status_cell(r)) for r in records]
    out.table(["Alias", "Name", "Params", "Memory", "Status"], rows, title="Models",
              caption=MEMORY_CAPTION)


def _long_rows(record: dict[str, Any]) -> list[tuple[str, str]]:
    sampling = ", ".join(f"{k}={v}" for k, v in (record["sampling"] or {}).items()) \
        or "the model's (generation_config.json)"
    gguf = "\n".join(f"{q}: {name}" for q, name in record["gguf_files"].items()) or "-"
    context = record["context_length"]
    return [
        ("Alias", _alias_cell(record)), ("Name", record["name"]),
        ("Path" if record["path"] else "Repo", record["path"] or record["repo_id"]),
        ("Architecture", record["architecture"] or "-"),
        ("Parameters", f"{record['params']:,}" if record["params"] else "-"),
        ("Context length", f"{context:,}" if context else "-"),
        ("Use case", record["use_case"] or "-"),
        ("Recommended quantization", record["recommended_quantization"] or "-"),
        ("Memory estimate", _memory_cell(record)), ("Sampling", sampling),
        ("GGUF repo", record["gguf_repo"] or "-"), ("GGUF files", gguf),
        ("Notes", record["notes"] or "-"), ("Source", "user alias" if record["user"] else "built-in"),
        ("Status", _status_cell(record) if record["path"] else "downloaded" if record["downloaded"]
         else "not downloaded"),
    ]


def render_registry_long(out: Output, records: list[dict[str, Any]]) -> None:
    for record in records:
        table = Table(title=escape(record["alias"]), show_header=False, title_justify="left")
        table.add_column("Field", style="bold")
        table.add_column("Value", overflow="fold")
        for field, value in _long_rows(record):
            table.add_row(field, escape(str(value)))
        out.print(table)
    out.print(MEMORY_CAPTION)


def _total_line(records: list[dict[str, Any]]) -> str:
    total = sum(r["total_bytes"] + r["weight_cache_bytes"] for r in records)
    noun = "model" if len(records) == 1 else "models"
    cached = sum(r["weight_cache_bytes"] for r in records)
    note = f" (of which {format_size(cached)} ruvllm's quantized-weight cache)" if cached else ""
    return f"Total: {len(records)} {noun}, {format_size(total)}{note}"


def _size_cell(record: dict[str, Any]) -> str:
    cached = record["weight_cache_bytes"]
    size = format_size(record["total_bytes"] + cached)
    return f"{size}\n(cache {format_size(cached)})" if cached else size


def render_unfinished(out: Output, unfinished: list[tuple[str, int]]) -> None:
    """What `downloaded` leaves out still takes disk: say so, and how to finish or free it."""
    if not unfinished:
        return
    noun = "download" if len(unfinished) == 1 else "downloads"
    names = ", ".join(f"{repo} ({format_size(size)})" for repo, size in unfinished)
    out.info(escape(f"Not listed: {len(unfinished)} incomplete or damaged {noun}: {names}. Finish one with "
                    f"ruvllm download ID (ID@REV for the revision that stopped), or free the space with "
                    f"ruvllm rm ID, which removes every revision of ID."))


def render_downloaded(out: Output, records: list[dict[str, Any]], long: bool) -> None:
    if not records:
        out.info("No models downloaded yet. Download one with: ruvllm download qwen-0.5b")
        return
    rows = []
    for r in records:
        name = r["repo_id"] + (f" ({', '.join(r['aliases'])})" if r["aliases"] else "")
        revision = _revision_cell(r)
        path = r["path"] + ("\n" + "\n".join(f["name"] for f in r["files"]) if long else "")
        rows.append((escape(name), escape(revision), escape(r["stored_as"]),
                     _size_cell(r), escape(path)))
    out.table(["Model", "Revision", "Stored as", "Size", "Path"], rows, title="Downloaded models",
              caption=_total_line(records))
    if not all(r["current"] for r in records):
        out.info("A commit marked \"was REV\" is an older one of a branch or tag that moved on: chat and serve "
                 "load the newer one. Free it with ruvllm rm ID@COMMIT.")


def _revision_cell(record: dict[str, Any]) -> str:
    revision, commit = record["revision"], record["commit"]
    if revision == commit:
        return revision
    return f"{revision} ({commit[:7]})" if record["current"] else f"{commit[:7]} (was {revision})"


@click.command("list")
@click.option("-d", "--downloaded", is_flag=True, help="List the models in the cache instead of the registry.")
@click.option("-l", "--long", "long_", is_flag=True, help="Show every field.")
@click.option("--json", "as_json", is_flag=True, help="Print the same data as JSON on stdout.")
@global_options
def command(downloaded: bool, long_: bool, as_json: bool) -> None:
    """List the registry's models with memory estimates, or the downloaded models.

    \b
    Examples:
      ruvllm list
      ruvllm ls --long
      ruvllm list --downloaded
      ruvllm list --json
    """
    app = app_context()
    out = app.output()
    registry = load_registry()
    cache = ModelCache(app.cache_dir)
    cached = cache.downloaded()
    if downloaded:
        index = _aliases_by_repo(registry)
        records = [downloaded_record(model, index, cache) for model in cached]
        unfinished = cache.unfinished(cached)
        if as_json:
            out.json({"models": records, "count": len(records),
                      "total_bytes": sum(r["total_bytes"] for r in records),
                      "unfinished": [{"repo_id": repo, "bytes": size} for repo, size in unfinished]})
        else:
            render_downloaded(out, records, long_)
            render_unfinished(out, unfinished)
        return
    records = [registry_record(entry, cached, cache) for entry in registry.values()]
    if as_json:
        out.json({"models": records, "context": DEFAULT_CONTEXT})
    elif long_:
        render_registry_long(out, records)
    else:
        render_registry(out, records)
