"""`ruvllm info`: what is known about a model, where it is cached, and what it needs in memory.

Needs no network: it reads the registry, the cache and the model's own files.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import click
from rich.filesize import decimal as format_size
from rich.markup import escape

from ruvllm_cli.cli.completion import complete_model
from ruvllm_cli.cli.context import app_context, global_options
from ruvllm_cli.cli.output import Output
from ruvllm_cli.engine.sampling import describe_defaults, model_sampling_defaults
from ruvllm_cli.errors import ModelLoadError
from ruvllm_cli.quantization import Quantization
from ruvllm_cli.registry.cache import DownloadedModel, ModelCache
from ruvllm_cli.registry.memory import DEFAULT_CONTEXT, KVShape, estimate_memory, format_bytes
from ruvllm_cli.registry.model_config import (ModelShape, count_parameters, count_parameters_from_safetensors,
                                              read_model_config)
from ruvllm_cli.registry.locate import loads_gguf
from ruvllm_cli.registry.registry import ModelRef, resolve_model

if TYPE_CHECKING:
    from ruvllm_cli.engine.gguf_check import GGUFLayout

WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth")
KIND_LABELS = {"local": "local path", "registry": "registry alias", "hub": "Hugging Face id"}
WEIGHTS_FROM = {"gguf": "GGUF file", "safetensors": "safetensors"}


# ---------------------------------------------------------------- gathering

def _file_records(directory: Path) -> list[dict[str, Any]]:
    files = sorted(p for p in directory.rglob("*") if p.is_file() and not p.name.startswith("."))
    return [{"name": str(p.relative_to(directory)), "size": p.stat().st_size} for p in files]


def _storage(path: Path, files: list[dict[str, Any]]) -> dict[str, Any]:
    weights = [f["name"] for f in files if f["name"].lower().endswith(WEIGHT_SUFFIXES)]
    return {"path": str(path), "files": files, "size_bytes": sum(f["size"] for f in files),
            "weights": weights}


def local_storage(path: Path) -> dict[str, Any]:
    if path.is_file():
        return {**_storage(path.parent, [{"name": path.name, "size": path.stat().st_size}]),
                "path": str(path), "format": "gguf"}
    storage = _storage(path, _file_records(path))
    suffixes = {Path(name).suffix.lower() for name in storage["weights"]}
    fmt = next((f for f in (".safetensors", ".gguf", ".bin", ".pt", ".pth") if f in suffixes), None)
    return {**storage, "format": fmt.lstrip(".") if fmt else "no weights"}


def download_record(model: DownloadedModel) -> dict[str, Any]:
    files = [{"name": f.name, "size": f.size} for f in model.files]
    return {**_storage(model.path, files), "repo_id": model.repo_id, "revision": model.revision,
            "commit": model.commit, "stored_as": model.stored_as,
            "downloaded_at": model.downloaded_at}


def find_downloads(ref: ModelRef, cache: ModelCache) -> list[DownloadedModel]:
    """Complete downloads of the model's repo (at its revision, if one was asked) or of its GGUF repo."""
    gguf_repo = ref.entry.gguf_repo if ref.entry else None
    found = []
    for model in cache.downloaded():
        repo = model.repo_id.lower()
        if ref.repo_id and repo == ref.repo_id.lower():
            if ref.revision is None or ref.revision in (model.revision, model.commit) \
                    or model.commit.startswith(ref.revision):
                found.append(model)
        elif gguf_repo and repo == gguf_repo.lower():
            found.append(model)
    return found


def _config_dir(ref: ModelRef, downloads: list[DownloadedModel]) -> Path | None:
    """Where a config.json can be read: the local dir, else the first download that has one."""
    candidates = [ref.local_path] if ref.local_path and ref.local_path.is_dir() else []
    candidates += [d.path for d in downloads]
    return next((c for c in candidates if (c / "config.json").is_file()), None)


def counted_parameters(directory: Path | None) -> tuple[int | None, str | None]:
    """The safetensors headers' parameter count, or why they cannot be read (a load would
    fail on them the same way: `info` says so, where it had shown the config's figure alone)."""
    if directory is None:
        return None, None
    try:
        return count_parameters_from_safetensors(directory), None
    except ModelLoadError as error:
        return None, error.message


def parameter_count(ref: ModelRef, shape: ModelShape | None, counted: int | None) -> tuple[int | None, str | None]:
    """Safetensors headers beat the config's shape, which beats the registry's figure."""
    if counted:
        return counted, "safetensors headers"
    if shape is not None:
        return count_parameters(shape), "config.json shape"
    if ref.entry and ref.entry.params is not None:
        return ref.entry.params, "registry"
    return None, None


def memory_table(params: int | None, kv_shape: KVShape | None,
                 from_gguf: frozenset[Quantization] = frozenset()) -> dict[str, Any] | None:
    """Estimates per quantization; those in `from_gguf` load from a GGUF file of theirs."""
    if params is None:
        return None
    return {q.value: estimate_memory(params, q, kv_shape, DEFAULT_CONTEXT, gguf=q in from_gguf)
            for q in Quantization}


def read_gguf(path: Path) -> GGUFLayout | ModelLoadError:
    """A GGUF file's checked header, or what is wrong with it."""
    from ruvllm_cli.engine.gguf_check import check_gguf

    try:
        return check_gguf(path)
    except ModelLoadError as error:
        return error


def gguf_memory(layout: GGUFLayout) -> tuple[int, dict[str, Any]]:
    """A GGUF file's parameter count and memory table, from its header alone: each weight
    in the layout it loads into under each quantization (gguf_plan, the figure the
    loader's memory check takes; a tied head's packed copy under none), the KV cache
    from its attention metadata."""
    from ruvllm_cli.engine import gguf_plan

    params = sum(math.prod(tensor.dims) for tensor in layout.tensors)
    metadata = layout.metadata
    arch = metadata.get("general.architecture")
    layers, kv_heads = metadata.get(f"{arch}.block_count"), metadata.get(f"{arch}.attention.head_count_kv")
    head_dim = metadata.get(f"{arch}.attention.key_length")
    if head_dim is None and metadata.get(f"{arch}.attention.head_count"):
        head_dim = metadata.get(f"{arch}.embedding_length", 0) // metadata[f"{arch}.attention.head_count"]
    shape = SimpleNamespace(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim) \
        if layers and kv_heads and head_dim else None
    table = {}
    for quantization in Quantization:
        weights = gguf_plan.loaded_bytes(layout, quantization, 4,
                                         lambda rows, columns, q=quantization: q is Quantization.F32,
                                         int8_row_bytes=4)
        table[quantization.value] = estimate_memory(params, quantization, shape, DEFAULT_CONTEXT,
                                                    weight_bytes=weights)
    return params, table


def gguf_record(path: Path, layout: GGUFLayout | ModelLoadError) -> dict[str, Any]:
    """A GGUF file's type, what it loads as without -q, and what each weight becomes
    under every quantization (engine/gguf_plan.py: read from its header alone; `f16`
    as this machine's kernels would take it, float16 or bf16)."""
    from ruvllm_cli.engine import gguf_plan
    from ruvllm_cli.engine.kernels import half_weights_expected

    if isinstance(layout, ModelLoadError):
        return {"path": str(path), "error": layout.message}
    arch = layout.metadata.get("general.architecture")
    if arch not in gguf_plan.STREAMED_ARCHS:
        from transformers.integrations.ggml import GGUF_CONFIG_MAPPING   # 1 s, no torch: only here

        if arch not in GGUF_CONFIG_MAPPING:   # info had said it loads through transformers, which refuses it
            return {"path": str(path), "error": f"{path}: ruvllm and transformers read no GGUF file of "
                                                f"architecture {arch}"}
    half = half_weights_expected()
    return {"path": str(path), "file_type": gguf_plan.label(layout),
            "default_quantization": gguf_plan.file_quantization(layout).value,
            "through_transformers": gguf_plan.unstreamable(layout),
            "tensors": {q.value: gguf_plan.summary(layout, q, half=half) for q in Quantization},
            # its general.sampling.* keys: what requests to it sample with unless they say
            "sampling_defaults": model_sampling_defaults(path, layout.metadata)}


def _gguf_files(ref: ModelRef, downloads: list[DownloadedModel]) -> list[Path]:
    if ref.local_path is not None and ref.local_path.suffix.lower() == ".gguf" and ref.local_path.is_file():
        return [ref.local_path]
    return [d.path / f.name for d in downloads for f in d.files
            if f.name.lower().endswith(".gguf") and (d.path / f.name).is_file()]


def chat_template_of(directory: Path | None, layouts: list[Any]) -> str | None:
    """The model's chat template: chat_template.jinja, tokenizer_config.json's (the
    default of a named list), or a GGUF header's; None where it has none."""
    import json

    if directory is not None:
        jinja = directory / "chat_template.jinja"
        if jinja.is_file():
            return jinja.read_text(errors="replace")
        try:
            template = json.loads((directory / "tokenizer_config.json").read_text()).get("chat_template")
        except (OSError, ValueError, AttributeError):
            template = None
        if isinstance(template, list):   # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        if isinstance(template, str):
            return template
    for layout in layouts:
        template = layout.metadata.get("tokenizer.chat_template")
        if isinstance(template, str):
            return template
    return None


def capabilities(template: str | None, architecture: str | None) -> dict[str, Any]:
    """What a model's own files say it can do beyond completing text (Ollama's `show`
    lists the like): chat, the tool-call format serve would parse, the reasoning markers."""
    from ruvllm_cli.engine.reasoning import detect_format
    from ruvllm_cli.engine.tool_parsers import detect_parser

    thinking = detect_format(template) if template else None
    return {"chat": template is not None,
            "tools": detect_parser(template, architecture) if template and "tools" in template else None,
            "reasoning": f"{thinking.start}...{thinking.end}" if thinking else None}


def describe(name: str, ref: ModelRef, cache: ModelCache) -> dict[str, Any]:
    """Everything `info` shows, as JSON-ready data."""
    downloads = [] if ref.kind == "local" else find_downloads(ref, cache)
    directory = _config_dir(ref, downloads)
    shape, config_error = None, None
    if directory:
        try:
            shape = read_model_config(directory)
        except ModelLoadError as error:  # show what else is known rather than nothing
            config_error = error.message
    counted, weights_error = counted_parameters(directory)
    params, source = parameter_count(ref, shape, counted)
    kv_shape = shape or (ref.entry.kv_shape if ref.entry else None)
    ggufs = {path: read_gguf(path) for path in _gguf_files(ref, downloads)}
    from_gguf = frozenset(q for q in Quantization if loads_gguf(ref, q, cache))
    memory = memory_table(params, kv_shape, from_gguf)
    readable = [layout for layout in ggufs.values() if not isinstance(layout, ModelLoadError)]
    if params is None and readable:
        # A GGUF file given by path (the only one then), or a downloaded GGUF repo's first
        # readable file: no config.json, but its header holds what the table needs.
        (params, memory), source = gguf_memory(readable[0]), "GGUF header"
    files_read = bool(directory) or bool(readable)
    gguf_records = [gguf_record(path, layout) for path, layout in ggufs.items()]
    template = chat_template_of(directory, readable) if files_read else None
    return {
        "model": name,
        "kind": ref.kind,
        "repo_id": ref.repo_id,
        "revision": ref.revision,
        "registry": ref.entry.to_dict() if ref.entry else None,
        "config": shape.to_dict() if shape else None,
        "config_path": str(directory / "config.json") if directory else None,
        "config_error": config_error,
        "weights_error": weights_error,   # a safetensors header that cannot be read
        # what serve's requests (and chat, for a model not in the registry) sample with unless they say
        "sampling_defaults": (model_sampling_defaults(directory) if directory
                              else next((r["sampling_defaults"] for r in gguf_records if "error" not in r), {})),
        "local": local_storage(ref.local_path) if ref.local_path else None,
        "downloaded": bool(downloads),
        "downloads": [download_record(d) for d in downloads],
        "parameters": params,
        "parameter_source": source,
        "memory": memory,
        "memory_context": DEFAULT_CONTEXT,
        "gguf": gguf_records,
        # None where no file of it is at hand (an alias not downloaded)
        "capabilities": capabilities(template, shape.architecture if shape else None) if files_read else None,
    }


# ---------------------------------------------------------------- rendering

def _kv(out: Output, title: str, rows: list[tuple[str, Any]]) -> None:
    shown = [(field, escape(str(value))) for field, value in rows if value not in (None, "")]
    out.table(["Field", "Value"], shown, title=title)


def _number(value: int | None) -> str | None:
    return f"{value:,}" if value is not None else None


def _render_model(out: Output, data: dict[str, Any]) -> None:
    entry = data["registry"] or {}
    sampling = entry.get("sampling")
    source = ("user alias" if entry.get("user") else "built-in") if entry else None
    rows = [
        ("Model", data["model"]), ("Resolved as", KIND_LABELS[data["kind"]]),
        ("Repo", data["repo_id"]), ("Revision", data["revision"]), ("Name", entry.get("name")),
        ("Architecture", entry.get("architecture")), ("Parameters (registry)", _number(entry.get("params"))),
        ("Context length", _number(entry.get("context_length"))), ("Use case", entry.get("use_case")),
        ("Recommended quantization", entry.get("recommended_quantization")),
        ("Sampling", ", ".join(f"{k}={v}" for k, v in sampling.items()) if sampling else None),
        ("GGUF repo", entry.get("gguf_repo")),
        ("GGUF files", ", ".join(f"{q}: {f}" for q, f in entry.get("gguf_files", {}).items()) or None),
        ("Notes", entry.get("notes")), ("Source", source),
    ]
    _kv(out, "Model", rows)


def _render_config(out: Output, data: dict[str, Any]) -> None:
    config = data["config"]
    if not config:
        return
    rows = [("Architecture", config["architecture"]), ("Model type", config["model_type"]),
            ("Hidden size", _number(config["hidden_size"])), ("Layers", config["num_layers"]),
            ("Attention heads", config["num_heads"]), ("KV heads", config["num_kv_heads"]),
            ("Head dim", config["head_dim"]), ("Intermediate size", _number(config["intermediate_size"])),
            ("Vocabulary", _number(config["vocab_size"])), ("Context length", _number(config["context_length"])),
            ("Tied embeddings", "yes" if config["tie_word_embeddings"] else "no"),
            ("Dtype", config["torch_dtype"]),
            ("Sampling defaults", describe_defaults(data["sampling_defaults"]) or None)]
    _kv(out, f"Config ({data['config_path']})", rows)


def _render_capabilities(out: Output, data: dict[str, Any]) -> None:
    can = data["capabilities"]
    if can is None:
        return
    listed = ["completion", *(["chat"] if can["chat"] else [])]
    if can["tools"]:
        listed.append(f"tools ({can['tools']})")
    if can["reasoning"]:
        listed.append(f"reasoning ({can['reasoning']})")
    out.print(f"Capabilities: {escape(', '.join(listed))}")


def _render_storage(out: Output, title: str, storage: dict[str, Any], extra: list[tuple[str, Any]]) -> None:
    weights = ", ".join(storage["weights"]) or "none found"
    rows = [*extra, ("Path", storage["path"]), ("Files", len(storage["files"])),
            ("Size", format_size(storage["size_bytes"])), ("Weights", weights)]
    _kv(out, title, rows)


def _render_cache(out: Output, data: dict[str, Any]) -> None:
    if data["local"]:
        _render_storage(out, "Local files", data["local"], [("Format", data["local"]["format"])])
        return
    for download in data["downloads"]:
        extra = [("Repo", download["repo_id"]), ("Revision", download["revision"]),
                 ("Commit", download["commit"]), ("Stored as", download["stored_as"]),
                 ("Downloaded", download["downloaded_at"])]
        _render_storage(out, "Cache", download, extra)
    if not data["downloads"]:
        target = data["model"]
        out.print(f"Not downloaded. Get it with: ruvllm download {escape(target)}")


def _render_memory(out: Output, data: dict[str, Any]) -> None:
    memory = data["memory"]
    if memory is None:
        out.print("Memory estimates: unknown until the model's config.json is available "
                  "(download it, or use a registry alias).")
        return
    rows = [(m["label"] + f" ({q})", WEIGHTS_FROM[m["weights_from"]], format_bytes(m["weights_bytes"]),
             format_bytes(m["kv_cache_bytes"]), format_bytes(m["overhead_bytes"]), format_bytes(m["total_bytes"]))
            for q, m in memory.items()]
    caption = (f"{data['parameters']:,} parameters, from the {data['parameter_source']}; weights as ruvllm "
               f"holds them on a CPU; KV cache for {data['memory_context']:,} tokens")
    out.table(["Quantization", "From", "Weights", "KV cache", "Overhead", "Total"], rows,
              title="Memory estimates", caption=escape(caption))


def _render_gguf(out: Output, record: dict[str, Any], unreadable: str | None) -> None:
    if "error" in record:
        if record["error"] != unreadable:  # that one is the command's error, said last
            out.warn(record["error"])
        return
    default = record["default_quantization"]
    way = (f"through transformers ({record['through_transformers']}), dequantized whole"
           if record["through_transformers"] else "tensor by tensor, straight into the layouts below")
    rows = [("Path", record["path"]), ("Type", record["file_type"]), ("Loads as", f"{default} (without -q)"),
            ("Loading", way), *((f"Tensors, -q {q}", text) for q, text in record["tensors"].items()),
            ("Sampling defaults", describe_defaults(record["sampling_defaults"]) or None)]
    _kv(out, "GGUF file", rows)


def unreadable(data: dict[str, Any]) -> str | None:
    """Why the model itself cannot be read, where it cannot: its config.json, its safetensors
    headers, or its only GGUF files.

    `info` still shows what else it knows (path, files, sizes), then says this as its error and exits 1,
    as serve and chat would fail to load it: a script checking a model with `info` learns it is broken.
    """
    if data["config_error"]:
        return f"config.json could not be read: {data['config_error']}"
    if data["weights_error"]:
        return f"the weights could not be read: {data['weights_error']}"
    errors = [record["error"] for record in data["gguf"] if "error" in record]
    if data["config"] is None and errors and len(errors) == len(data["gguf"]):
        return errors[0]
    return None


def render(out: Output, data: dict[str, Any], error: str | None = None) -> None:
    """The tables; `error`: unreadable(data), said by the command last (not as a warning here)."""
    _render_model(out, data)
    _render_config(out, data)
    _render_capabilities(out, data)
    _render_cache(out, data)
    for record in data["gguf"]:
        _render_gguf(out, record, error)
    _render_memory(out, data)


@click.command("info")
@click.argument("model", shell_complete=complete_model)
@click.option("--json", "as_json", is_flag=True, help="Print the same data as JSON on stdout.")
@global_options
def command(model: str, as_json: bool) -> None:
    """Show MODEL's details, where it is cached, and memory estimates per quantization.

    MODEL is a registry alias, a Hugging Face id (org/name[@revision]) or a local path.

    \b
    Examples:
      ruvllm info qwen
      ruvllm info Qwen/Qwen2.5-0.5B-Instruct --json
      ruvllm info ./my-model
    """
    app = app_context()
    out = app.output()
    ref = resolve_model(model)
    data = describe(model, ref, ModelCache(app.cache_dir))
    error = unreadable(data)
    if as_json:
        out.json(data)
    else:
        render(out, data, error)
    if error:
        raise ModelLoadError(error, hint=None if as_json else "the fields above are what could be read without it")
