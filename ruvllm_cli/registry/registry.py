"""The model registry (built-in aliases plus the user's own) and model-name resolution.

Built-in entries are packaged data (`models.toml`); user aliases live in
`<config dir>/aliases.json` and may shadow a built-in alias. No torch here.
"""

from __future__ import annotations

import difflib
import json
import re
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from ruvllm_cli.fsutil import write_text_atomic
from ruvllm_cli.errors import CacheError, ModelNotFoundError, UsageError
from ruvllm_cli.paths import resolve_config_dir
from ruvllm_cli.quantization import Quantization, parse_quantization

ALIASES_FILE = "aliases.json"
ALIAS_RE = re.compile(r"^[a-z0-9][a-z0-9._-]*$")
# Hugging Face repo names: letters, digits, '-', '_', '.'; no '--' or '..'; 96 chars at most.
_REPO_PART_RE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?$")
_REVISION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]*$")
WHOLE_NUMBER_FIELDS = ("context_length", "params", "num_layers", "num_kv_heads", "head_dim", "hidden_size",
                       "vocab_size")
NUMBER_FIELDS = ("params_b",)
USER_FIELDS = {"architecture", "params", "params_b", "context_length", "use_case", "recommended_quantization",
               "notes", "sampling", "gguf_repo", "gguf_files"}


@dataclass(frozen=True)
class Sampling:
    """Recommended sampling settings; top_k 0 and repetition_penalty 1.0 mean "off"."""

    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0

    def to_dict(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                "repetition_penalty": self.repetition_penalty}


@dataclass(frozen=True)
class ModelEntry:
    """One registry alias and what is known about the model behind it."""

    alias: str
    repo_id: str
    name: str
    architecture: str | None = None
    params_b: float | None = None
    context_length: int | None = None
    use_case: str = ""
    recommended_quantization: Quantization = Quantization.Q4_K_M
    notes: str = ""
    sampling: Sampling = field(default_factory=Sampling)
    gguf_repo: str | None = None
    gguf_files: dict[Quantization, str] = field(default_factory=dict)
    num_layers: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    hidden_size: int | None = None
    vocab_size: int | None = None
    tie_word_embeddings: bool | None = None
    exact_params: int | None = None
    user: bool = False
    path: Path | None = None  # a user alias of a local model (directory or .gguf file) instead of a repo
    # The entry recommends `sampling` (every built-in one, read off its card; a user alias
    # where its record sets it): chat then samples with it, else with the model's
    # generation_config.json. A user alias had counted Sampling()'s placeholders as one.
    sampling_given: bool = True

    @property
    def target(self) -> str:
        """What the alias names: its repo id, or its local path."""
        return str(self.path) if self.path is not None else self.repo_id

    @property
    def params(self) -> int | None:
        """The exact parameter count where the registry has it, else params_b x 1e9."""
        if self.exact_params is not None:
            return self.exact_params
        return round(self.params_b * 1e9) if self.params_b is not None else None

    @property
    def kv_shape(self) -> ModelEntry | None:
        """Itself when it knows layers, KV heads and head size (enough to size a KV cache)."""
        known = None not in (self.num_layers, self.num_kv_heads, self.head_dim)
        return self if known else None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data (quantizations by their CLI names)."""
        return {
            "alias": self.alias, "repo_id": self.repo_id, "name": self.name,
            "architecture": self.architecture, "params_b": self.params_b,
            "params": self.params, "context_length": self.context_length, "use_case": self.use_case,
            # None where it means nothing: a local path is not downloaded, and loads as its files are
            "recommended_quantization": self.recommended_quantization.value if self.path is None else None,
            "notes": self.notes, "sampling": self.sampling.to_dict() if self.sampling_given else None,
            "gguf_repo": self.gguf_repo,
            "gguf_files": {q.value: name for q, name in self.gguf_files.items()},
            "user": self.user, "path": str(self.path) if self.path is not None else None,
        }


@dataclass(frozen=True)
class ModelRef:
    """What a model argument resolved to: a local path, a registry alias or a hub id."""

    kind: str  # "local" | "registry" | "hub"
    repo_id: str | None
    revision: str | None = None
    entry: ModelEntry | None = None
    local_path: Path | None = None

    @property
    def display_name(self) -> str:
        if self.kind == "local":
            return str(self.local_path)
        base = self.entry.alias if self.kind == "registry" and self.entry else self.repo_id
        return f"{base}@{self.revision}" if self.revision else str(base)

    @property
    def is_gguf(self) -> bool:
        return self.local_path is not None and self.local_path.suffix.lower() == ".gguf"


# ---------------------------------------------------------------- loading

def _entry_from_data(data: dict[str, Any], *, user: bool, where: str) -> ModelEntry:
    _check_numbers(data, where)
    try:
        sampling = Sampling(**data.get("sampling", {}))
        quant = parse_quantization(data.get("recommended_quantization", "q4k"))
        gguf = {parse_quantization(q): str(f) for q, f in (data.get("gguf_files") or {}).items()}
        path = Path(data["path"]) if data.get("path") else None
        repo_id = str(data["repo_id"]) if path is None else ""
        return ModelEntry(
            alias=str(data["alias"]), repo_id=repo_id, path=path,
            name=str(data.get("name") or (path.name if path is not None else repo_id.split("/")[-1])),
            architecture=data.get("architecture"), params_b=data.get("params_b"),
            context_length=data.get("context_length"), use_case=data.get("use_case", ""),
            recommended_quantization=quant, notes=data.get("notes", ""), sampling=sampling,
            gguf_repo=data.get("gguf_repo"), gguf_files=gguf, num_layers=data.get("num_layers"),
            num_kv_heads=data.get("num_kv_heads"), head_dim=data.get("head_dim"),
            hidden_size=data.get("hidden_size"), vocab_size=data.get("vocab_size"),
            tie_word_embeddings=data.get("tie_word_embeddings"), exact_params=data.get("params"), user=user,
            sampling_given=not user or "sampling" in data,
        )
    except (KeyError, TypeError, AttributeError, UsageError) as error:
        raise CacheError(f"invalid model entry in {where}: {error}",
                         "fix or delete that entry") from None


def _check_numbers(data: dict[str, Any], where: str) -> None:
    """A hand-edited `"params_b": "big"` had passed here and failed later as a TypeError."""
    sampling = data.get("sampling")
    numbers = [*((name, data.get(name), int) for name in WHOLE_NUMBER_FIELDS),
               *((name, data.get(name), float) for name in NUMBER_FIELDS),
               *((f"sampling.{name}", value, float) for name, value in
                 (sampling.items() if isinstance(sampling, dict) else ()))]
    for name, value, kind in numbers:
        allowed = (int,) if kind is int else (int, float)
        if value is not None and (isinstance(value, bool) or not isinstance(value, allowed)):
            wanted = "a whole number" if kind is int else "a number"
            raise CacheError(f"invalid model entry in {where}: {data.get('alias')}'s {name} is {value!r}, "
                             f"not {wanted}", "fix or delete that entry")


def _builtin_data() -> list[dict[str, Any]]:
    text = resources.files("ruvllm_cli.registry").joinpath("models.toml").read_text("utf-8")
    return list(tomllib.loads(text).get("model", []))


def builtin_entries() -> dict[str, ModelEntry]:
    """The packaged aliases, in file order."""
    entries = (_entry_from_data(m, user=False, where="models.toml") for m in _builtin_data())
    return {entry.alias: entry for entry in entries}


def aliases_path(config_dir: Path | None = None) -> Path:
    return (config_dir or resolve_config_dir()) / ALIASES_FILE


def _read_user_file(path: Path) -> dict[str, dict[str, Any]]:
    """{alias: fields}; an absent file is empty, an unreadable one is an error naming it."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CacheError(f"cannot read user aliases file {path}: {error}",
                         f"fix the file or delete it (`rm {path}`)") from None
    aliases = data.get("aliases") if isinstance(data, dict) else None
    if not isinstance(aliases, dict) or not all(isinstance(v, dict) for v in aliases.values()):
        raise CacheError(f"user aliases file {path} is not in the expected format",
                         f"fix the file or delete it (`rm {path}`)")
    return aliases


def user_entries(config_dir: Path | None = None) -> dict[str, ModelEntry]:
    """The user's aliases; one naming a built-in model's repo inherits that model's facts."""
    path = aliases_path(config_dir)
    known = {m["repo_id"].lower(): m for m in _builtin_data()}
    entries = {}
    for alias, fields in _read_user_file(path).items():
        base = known.get(str(fields.get("repo_id", "")).lower(), {})
        data = {**base, **fields, "alias": alias}
        entries[alias] = _entry_from_data(data, user=True, where=str(path))
    return entries


def load_registry(config_dir: Path | None = None) -> dict[str, ModelEntry]:
    """Built-in aliases merged with the user's; a user alias replaces a built-in one of that name."""
    registry = builtin_entries()
    registry.update(user_entries(config_dir))
    return registry


# ---------------------------------------------------------------- user aliases

def validate_alias(alias: str) -> str:
    if not ALIAS_RE.match(alias or ""):
        raise UsageError(f"invalid alias name '{alias}'",
                         "use lowercase letters, digits, '.', '_' and '-', starting with a letter or digit")
    if alias.endswith(".gguf"):   # resolve_model reads such a name as a path: the alias was never reached
        stem = alias[:-len(".gguf")].rstrip(".")
        raise UsageError(f"invalid alias name '{alias}': a name ending in .gguf is read as a GGUF file's path",
                         f"choose a name without the .gguf ending{f', e.g. {stem}' if stem else ''}")
    return alias


def is_repo_id(text: str) -> bool:
    """True for the `org/name` shape of a Hugging Face model id."""
    parts = text.split("/")
    return (len(parts) == 2 and all(_REPO_PART_RE.match(p) for p in parts)
            and not any("--" in p or ".." in p for p in parts))


def validate_repo_id(repo_id: str) -> str:
    if not is_repo_id(repo_id or ""):
        raise UsageError(f"invalid Hugging Face model id '{repo_id}'",
                         "expected org/name, for example Qwen/Qwen2.5-0.5B-Instruct")
    return repo_id


@contextmanager
def _user_file_locked(path: Path) -> Iterator[None]:
    """Holds `path`'s lock across a read-modify-write: two `alias set` runs at once had each
    written back the file they read, and the later one dropped the other's alias."""
    from filelock import FileLock

    lock = FileLock(str(path.parent / f".{path.name}.lock"))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock.acquire()
    except OSError as error:
        raise _unwritable(path, error) from None
    try:
        yield
    finally:
        lock.release()


def _write_user_file(path: Path, aliases: dict[str, dict[str, Any]]) -> None:
    try:
        write_text_atomic(path, json.dumps({"version": 1, "aliases": aliases}, indent=2, sort_keys=True) + "\n")
    except OSError as error:
        raise _unwritable(path, error) from None


def _unwritable(path: Path, error: OSError) -> CacheError:
    """The aliases file by name: the OSError names a temp or lock file beside it."""
    return CacheError(f"cannot write the user aliases file {path} ({error.strerror or error})",
                      f"make {path.parent} writable, or point RUVLLM_CONFIG_DIR at a directory that is")


def add_user_alias(alias: str, target: str, *, name: str | None = None,
                   config_dir: Path | None = None, **fields: Any) -> ModelEntry:
    """Adds or replaces a user alias of `target`, a Hugging Face id or a local model
    (a directory with config.json, or a .gguf file; stored as an absolute path);
    returns the stored entry."""
    validate_alias(alias)
    local = _local_ref(target)
    if local is None and Path(target).expanduser().exists():
        raise _not_a_model(target, Path(target).expanduser())
    if local is None and not is_repo_id(target):
        named = load_registry(config_dir).get(target)
        if named is not None:   # it was "invalid Hugging Face model id 'my'"
            raise UsageError(f"'{target}' is an alias itself; an alias names a Hugging Face id (org/name) or a "
                             "local model, not another alias",
                             f"ruvllm alias set {alias} {named.target}")
    if local is None:
        validate_repo_id(target)
    unknown = sorted(set(fields) - USER_FIELDS)
    if unknown:
        raise UsageError(f"unknown alias field(s): {', '.join(unknown)}",
                         f"known fields: {', '.join(sorted(USER_FIELDS))}")
    if local is not None and fields.get("recommended_quantization") is not None:
        raise UsageError("a recommended quantization names the GGUF file `ruvllm download` fetches for a repo; "
                         "a local model loads as its files are",
                         "give -q to chat, serve or benchmark when you run it")
    named = {"path": str(local.local_path)} if local is not None else {"repo_id": target}
    record: dict[str, Any] = {**named, **{k: v for k, v in fields.items() if v is not None}}
    if name:
        record["name"] = name
    if isinstance(record.get("recommended_quantization"), Quantization):
        record["recommended_quantization"] = record["recommended_quantization"].value
    path = aliases_path(config_dir)
    entry = _entry_from_data({**record, "alias": alias}, user=True, where="the new alias")
    with _user_file_locked(path):
        aliases = _read_user_file(path)
        aliases[alias] = record
        _write_user_file(path, aliases)
    return entry


def remove_user_alias(alias: str, config_dir: Path | None = None) -> ModelEntry:
    """Removes a user alias; returns what was removed."""
    path = aliases_path(config_dir)
    if alias not in _read_user_file(path):
        _no_user_alias(alias)
    with _user_file_locked(path):
        aliases = _read_user_file(path)
        if alias not in aliases:   # another run removed it meanwhile
            _no_user_alias(alias)
        removed = _entry_from_data({**aliases.pop(alias), "alias": alias}, user=True, where=str(path))
        _write_user_file(path, aliases)
    return removed


def _no_user_alias(alias: str) -> None:
    if alias in builtin_entries():
        raise UsageError(f"'{alias}' is a built-in alias and cannot be removed",
                         "`ruvllm alias set` can shadow it with your own repo instead")
    raise ModelNotFoundError(f"no user alias '{alias}'", "see `ruvllm alias list`")


# ---------------------------------------------------------------- resolution

def _looks_like_path(name: str) -> bool:
    """Names the user clearly meant as a path rather than an alias or a hub id."""
    return name.startswith(("/", "./", "../", "~", ".\\")) or "\\" in name or name.lower().endswith(".gguf")


def _not_a_model(name: str, path: Path) -> ModelNotFoundError:
    if path.is_dir():
        return ModelNotFoundError(f"'{name}' is not a model directory (it has no config.json)",
                                  "point at the directory that holds config.json and the weights")
    if path.exists():
        return ModelNotFoundError(f"'{name}' is not a model: expected a directory with config.json "
                                  "or a .gguf file")
    return ModelNotFoundError(f"no such file or directory: '{name}'")


def _local_ref(name: str) -> ModelRef | None:
    """A local model, or None when `name` names no model on disk (so it may be an alias or id)."""
    path = Path(name).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return ModelRef(kind="local", repo_id=None, local_path=path.resolve())
    if path.is_file() and path.suffix.lower() == ".gguf":
        # Absolute, links kept: the cache's files (and an Ollama blob linked as x.gguf) are
        # links to blobs without the suffix, which then no longer read as GGUF.
        return ModelRef(kind="local", repo_id=None, local_path=path.absolute())
    if _looks_like_path(name):
        raise _not_a_model(name, path)
    return None


def nearest_alias(name: str, aliases: list[str]) -> str | None:
    """The closest alias by difflib ratio, where one is close enough to be a likely typo."""
    close = difflib.get_close_matches(name.lower(), aliases, n=1, cutoff=0.6)
    return close[0] if close else None


def _unknown(name: str, registry: dict[str, ModelEntry]) -> ModelNotFoundError:
    aliases = sorted(registry)
    guess = nearest_alias(name, aliases)
    if guess:
        hint = (f"did you mean '{guess}'? Aliases: {', '.join(aliases)}; or give a Hugging Face id (org/name) "
                "or a local path")
    else:
        own = name.lower() if ALIAS_RE.match(name.lower()) else "NAME"
        hint = (f"aliases: {', '.join(aliases)}; or give a Hugging Face id (org/name) or a local path; "
                f"to name your own model: ruvllm alias set {own} ORG/NAME (or a local directory)")
    return ModelNotFoundError(f"unknown model '{name}'", hint)


def _aliased_path(entry: ModelEntry, revision: str | None) -> ModelRef:
    """A user alias of a local model: that model, while it is still there."""
    if revision:
        raise UsageError(f"'{entry.alias}' is a local model ({entry.path}): it has no revisions")
    try:
        local = _local_ref(str(entry.path))
    except ModelNotFoundError:  # moved, deleted, or no model any more
        local = None
    if local is None:
        raise ModelNotFoundError(f"alias '{entry.alias}' points at {entry.path}, which is not a model now",
                                 f"point it elsewhere (ruvllm alias set {entry.alias} PATH) or remove it "
                                 f"(ruvllm alias rm {entry.alias})")
    return ModelRef(kind="local", repo_id=None, entry=entry, local_path=local.local_path)


def _split_revision(name: str) -> tuple[str, str | None]:
    base, sep, revision = name.partition("@")
    if not sep:
        return name, None
    if not base or not _REVISION_RE.match(revision):
        raise UsageError(f"invalid model reference '{name}'",
                         "use NAME@REVISION with a branch, tag or commit, e.g. qwen@main")
    return base, revision


def resolve_model(name: str, config_dir: Path | None = None) -> ModelRef:
    """Local path (dir with config.json, or .gguf) > registry alias > `org/name[@revision]`."""
    name = (name or "").strip()
    if not name:
        raise UsageError("empty model name", "give an alias, a Hugging Face id or a local path")
    local = _local_ref(name)
    if local:
        return local
    registry = load_registry(config_dir)
    base, revision = _split_revision(name)
    entry = registry.get(base.lower())
    if entry and entry.path is not None:
        return _aliased_path(entry, revision)
    if entry:
        return ModelRef(kind="registry", repo_id=entry.repo_id, revision=revision, entry=entry)
    if is_repo_id(base):
        match = next((e for e in registry.values() if e.repo_id.lower() == base.lower()), None)
        return ModelRef(kind="hub", repo_id=base, revision=revision, entry=match)
    if Path(name).expanduser().exists():
        raise _not_a_model(name, Path(name).expanduser())
    if "/" in base:
        validate_repo_id(base)
    raise _unknown(base, registry)
