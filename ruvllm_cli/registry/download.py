"""Fetching a model into the cache with the real huggingface_hub client.

The client does every transfer (and, within one run, resumes a dropped connection
with a Range request); this module only chooses the files, skips what is complete,
clears what a killed run left behind, records the manifest and turns the client's
exceptions into one-line errors.

Across runs nothing resumes: huggingface_hub (1.18 and later, 2.4 here) writes each
file to a process-unique `<etag>.<random>.incomplete`, deletes it when the transfer
fails, and offers no API to continue one (docs/design.md, section 10). So a file cut
short starts over, and the messages say so.
"""

from __future__ import annotations

import errno
import json
import re
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Sequence

from rich.filesize import decimal as format_size

from ruvllm_cli.errors import (CacheError, DownloadError, RepoUnavailableError, RevisionNotFoundError, RuvllmError,
                               UsageError)
from ruvllm_cli.quantization import Quantization, parse_quantization
from ruvllm_cli.registry.cache import (DEFAULT_REVISION, DownloadedModel, FileRecord, ModelCache, file_size,
                                      is_commit)
from ruvllm_cli.registry.progress import DownloadObserver

if TYPE_CHECKING:
    from ruvllm_cli.registry.registry import ModelRef

CONFIG_FILES = ("config.json", "generation_config.json")
ADAPTER_CONFIG, ADAPTER_SAFETENSORS = "adapter_config.json", "adapter_model.safetensors"
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
    "tokenizer.model", "added_tokens.json", "chat_template.jinja", "chat_template.json",
)
SAFETENSORS_INDEX = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth")
NO_RESUME = "huggingface_hub cannot continue a partial file from another run"
GGUF_PATTERNS: dict[Quantization, tuple[str, ...]] = {
    Quantization.Q4_K_M: ("q4_k_m",),
    Quantization.Q8_0: ("q8_0",),
    Quantization.F16: ("f16", "fp16"),
    Quantization.F32: ("f32", "fp32"),
}

SPLIT_GGUF_RE = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)   # llama.cpp's gguf-split names


# -- which files ---------------------------------------------------------------------------
def plan_files(repo_files: Iterable[str], quantization: Quantization | str | None,
               index_shards: Iterable[str] | None = None) -> list[str]:
    """The files a model needs, chosen from the repo's real file list (sorted).

    Config, generation config, tokenizer and chat-template files where present, and the
    weights: safetensors (with `model.safetensors.index.json`, exactly the shards it names
    in `index_shards`; without `index_shards` the shards are all root-level safetensors),
    else one GGUF file chosen by `quantization` (None: see `choose_gguf`). Never pickled weights.
    """
    files = set(repo_files)
    quantization = _parse_optional(quantization)
    if ADAPTER_CONFIG in files and ADAPTER_SAFETENSORS in files:
        # A PEFT LoRA adapter (ruvllm serve --lora NAME=HUB_ID): its config and weights.
        return sorted([ADAPTER_CONFIG, ADAPTER_SAFETENSORS])
    extras = [name for name in (*CONFIG_FILES, *TOKENIZER_FILES) if name in files]
    safetensors = sorted(name for name in files if _is_root(name) and name.endswith(".safetensors"))
    if safetensors:
        if "config.json" not in files:
            raise DownloadError("the repo has safetensors weights but no config.json",
                                "pass a transformers model repo, or a GGUF repo")
        return sorted({*extras, *_safetensors_weights(files, safetensors, index_shards)})
    ggufs = sorted(_gguf_names(files))
    if ggufs:
        return sorted({*extras, choose_gguf(ggufs, quantization)})
    if any(name.endswith(PICKLE_SUFFIXES) for name in files):
        raise DownloadError("the repo has only PyTorch pickle weights (.bin/.pt), which ruvllm does not load",
                            "pick a repo with safetensors or GGUF weights")
    raise DownloadError("the repo has no model weights (no .safetensors or .gguf files)",
                        "check the model id")


def _parse_optional(quantization: Quantization | str | None) -> Quantization | None:
    return parse_quantization(quantization) if quantization is not None else None


def _safetensors_weights(files: set[str], safetensors: list[str],
                         index_shards: Iterable[str] | None) -> list[str]:
    if SAFETENSORS_INDEX not in files:
        # A single-file model next to other exports (e.g. consolidated.safetensors) needs only its own.
        return ["model.safetensors"] if "model.safetensors" in files else safetensors
    shards = sorted(set(index_shards)) if index_shards is not None else safetensors
    missing = [name for name in shards if name not in files]
    if missing:
        raise DownloadError(f"{SAFETENSORS_INDEX} names shards the repo lacks: {', '.join(missing)}")
    return [SAFETENSORS_INDEX, *shards]


def choose_gguf(names: Sequence[str], quantization: Quantization | None) -> str:
    """The one GGUF file whose name carries the quantization (case-insensitive); with None
    (no -q), the Q4_K_M file, else the repo's only GGUF file whatever its type (Q5_K_M,
    IQ4_XS, a bare model.gguf), which no -q could name. A model split into several files
    (`-00001-of-00002.gguf`) is refused: the engine loads one file, and the first part
    alone had been fetched and recorded as the whole model."""
    wanted = quantization or Quantization.Q4_K_M
    candidates = [name for name in names if _named_for(name, wanted)]
    matches = [name for name in candidates if not SPLIT_GGUF_RE.search(name)]
    if matches:
        # Prefer a root-level, shortest name: variant files carry longer names.
        return min(matches, key=lambda name: (name.count("/"), len(name), name))
    if quantization is None and len(names) == 1 and not SPLIT_GGUF_RE.search(names[0]):
        return names[0]
    if candidates:
        raise _split_gguf_error(candidates, wanted)
    if quantization is None and _one_split_set(names):
        raise _split_gguf_error(names, None)
    raise _no_gguf_error(names, quantization)


def _one_split_set(names: Sequence[str]) -> bool:
    """Whether `names` are the parts of one split GGUF and nothing else."""
    return all(SPLIT_GGUF_RE.search(name) for name in names) and len({SPLIT_GGUF_RE.sub("", n) for n in names}) == 1


def named_for_a_quantization(name: str) -> bool:
    """Whether a GGUF file's name carries one of the -q quantizations (see `choose_gguf`)."""
    return any(_named_for(name, q) for q in Quantization)


def _named_for(name: str, quantization: Quantization) -> bool:
    return any(_has_token(Path(name).name, pattern) for pattern in GGUF_PATTERNS[quantization])


def _no_gguf_error(names: Sequence[str], quantization: Quantization | None) -> DownloadError:
    """Says which -q values the repo's files answer to, and plainly when none does."""
    available = ", ".join(Path(name).name for name in names)
    whole = [name for name in names if not SPLIT_GGUF_RE.search(name)]
    named = [q.value for q in Quantization if any(_named_for(name, q) for name in whole)]
    if quantization is not None:
        message = f"no {quantization.label} GGUF file in the repo (available: {available})"
    elif named:
        message = f"no Q4_K_M GGUF file, the default, in the repo (available: {available})"
    else:
        message = (f"ruvllm cannot choose among the repo's GGUF files: none is named for a -q quantization "
                   f"(q4k, q8, f16, none), and there is more than one (available: {available})")
    if named:
        return DownloadError(message, f"choose a --quantization the repo has: {', '.join(named)}")
    if len(whole) == 1:
        return DownloadError(message, f"leave out -q to take the repo's only GGUF file, {Path(whole[0]).name}")
    return DownloadError(message, "pick another repo, or download the GGUF file you want yourself and run it "
                                  "by its path (ruvllm chat ./FILE.gguf)")


def _split_gguf_error(parts: Sequence[str], quantization: Quantization | None) -> DownloadError:
    first = min(parts)
    count = int(SPLIT_GGUF_RE.search(first).group(2))   # type: ignore[union-attr]
    what = f"{quantization.label} GGUF" if quantization is not None else "GGUF"
    return DownloadError(f"the repo's {what} is split into {count} files ({first} and the "
                         "rest of its set), and ruvllm loads a model from one GGUF file",
                         f"merge them with llama.cpp: llama-gguf-split --merge {Path(first).name} "
                         "merged.gguf, and run merged.gguf; or choose another --quantization or repo")


def _gguf_names(names: Iterable[str]) -> list[str]:
    """The GGUF files among `names`."""
    return [name for name in names if name.lower().endswith(".gguf")]


def _has_token(name: str, token: str) -> bool:
    return re.search(rf"(?<![a-z0-9]){re.escape(token)}(?![a-z0-9])", name.lower()) is not None


def _is_root(name: str) -> bool:
    return "/" not in name


# -- the download --------------------------------------------------------------------------
def download_model(ref: ModelRef, quantization: Quantization | str | None, cache: ModelCache, *,
                   force: bool = False, revision: str | None = None, token: str | None = None,
                   progress: DownloadObserver | None = None, file_name: str | None = None) -> DownloadedModel:
    """Downloads `ref` (a registry.ModelRef of kind "registry" or "hub") into `cache`;
    `quantization` picks a GGUF repo's file (None: no -q, see `choose_gguf`).

    A branch or tag complete in the cache is checked against the hub first (one
    metadata request): skipped when it still names a complete commit, else its new
    commit is fetched, linking the blobs that did not change. Offline
    (HF_HUB_OFFLINE) or with the hub out of reach, the complete download is used
    with a note; a full commit hash never asks. `force` fetches every file again.
    `file_name` fetches exactly that one file (a GGUF variant the registry names)
    instead of planning from the repo's file list. Raises DownloadError (one line
    plus a hint) on failure; Ctrl-C propagates as KeyboardInterrupt and leaves the
    cache consistent.
    """
    if ref.kind == "local" or ref.repo_id is None:
        raise UsageError(f"{ref.local_path} is a local model; there is nothing to download")
    quantization = _parse_optional(quantization)
    repo_id, revision = ref.repo_id, revision or ref.revision
    progress = progress or DownloadObserver()
    existing = cache.find(repo_id, revision)
    commit = None
    if existing is not None and not force and _holds(existing, quantization, file_name):
        commit = _hub_commit(repo_id, revision, existing, token, cache, progress)
        current = existing if commit is None else cache.find(repo_id, commit)
        if current is not None and _holds(current, quantization, file_name):
            if current.commit != existing.commit:   # fetched before by its hash, say
                cache.write_ref(repo_id, revision or DEFAULT_REVISION, current.commit)
            progress.already_downloaded(current)
            return current
    _make_cache_dir(cache)
    from ruvllm_cli.registry.in_use import register

    unregister = register([cache.repo_dir(repo_id)], "", cache.root, command="download")   # `rm` waits
    try:
        return _download(repo_id, revision, quantization, cache, force=force, token=token, progress=progress,
                         file_name=file_name, commit=commit)
    finally:
        unregister()


def _download(repo_id: str, revision: str | None, quantization: Quantization | None, cache: ModelCache, *,
              force: bool, token: str | None, progress: DownloadObserver, file_name: str | None,
              commit: str | None) -> DownloadedModel:
    lost = sum(file_size(path) for path in cache.orphaned_incomplete_files(repo_id))
    progress.removed_orphans(cache.remove_orphaned_incomplete_files(repo_id), lost)
    with hub_errors(repo_id, revision, cache):
        return _fetch(repo_id, revision, quantization, cache, force=force, token=token, progress=progress,
                      file_name=file_name, commit=commit)


def _holds(model: DownloadedModel, quantization: Quantization | None, file_name: str | None) -> bool:
    """Whether a complete download has what this one asks for."""
    return _has_quantization(model, quantization) and (
        file_name is None or any(f.name == file_name for f in model.files))


def _hub_commit(repo_id: str, revision: str | None, existing: DownloadedModel, token: str | None,
                cache: ModelCache, progress: DownloadObserver) -> str | None:
    """The commit the hub names `revision` now (a full hash: itself, without asking), or
    None, with a note, when it cannot be asked: the complete download is used then, as
    `huggingface-cli download` does offline."""
    if revision is not None and is_commit(revision):
        return revision
    from huggingface_hub import HfApi, constants

    if constants.HF_HUB_OFFLINE:
        progress.not_checked(existing, "offline mode is on (HF_HUB_OFFLINE)")
        return None
    try:
        with hub_errors(repo_id, revision, cache):
            info = HfApi(token=token).repo_info(repo_id, revision=revision, repo_type="model",
                                                timeout=constants.HF_HUB_ETAG_TIMEOUT)
    except RuvllmError as error:   # the hub's answer or its absence, mapped
        progress.not_checked(existing, error.message)
        return None
    return info.sha or None


def _has_quantization(model: DownloadedModel, quantization: Quantization | None) -> bool:
    """A GGUF download holds one quantization; safetensors are quantized at load time.
    None (no -q) is the Q4_K_M file, or a repo's only file, named for no -q."""
    ggufs = _gguf_names(f.name for f in model.files)
    if quantization is None and len(ggufs) == 1 and not any(_named_for(ggufs[0], q) for q in Quantization):
        return True
    return not ggufs or any(_named_for(name, quantization or Quantization.Q4_K_M) for name in ggufs)


def _fetch(repo_id: str, revision: str | None, quantization: Quantization | None, cache: ModelCache, *,
           force: bool, token: str | None, progress: DownloadObserver,
           file_name: str | None = None, commit: str | None = None) -> DownloadedModel:
    """Fetches `commit` (None: the one the hub names `revision` now) and records it."""
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

    api = HfApi(token=token)
    commit = commit or api.repo_info(repo_id, revision=revision, repo_type="model").sha
    if not commit:
        raise DownloadError(f"the hub did not say which commit {repo_id}@{revision or DEFAULT_REVISION} is")
    tree = api.list_repo_tree(repo_id, revision=commit, recursive=True, repo_type="model")
    sizes = {entry.path: int(entry.size) for entry in tree if isinstance(entry, RepoFile)}
    shards, done, ahead = None, set(), False
    if SAFETENSORS_INDEX in sizes and any(_is_root(n) and n.endswith(".safetensors") for n in sizes):
        # The index says which shards belong to the model, so it comes first.
        ahead = force or not (cache.snapshot_dir(repo_id, commit) / SAFETENSORS_INDEX).is_file()
        index = _hf_download(repo_id, SAFETENSORS_INDEX, commit, cache, force=force, token=token,
                             tqdm_class=DownloadObserver().tqdm_class)
        shards, done = _index_shards(Path(index)), {SAFETENSORS_INDEX}
    if file_name is not None and file_name not in sizes:
        raise RepoUnavailableError(f"{repo_id} has no file {file_name}", "try --safetensors")
    names = [file_name] if file_name else plan_files(sizes, quantization, shards)
    records = [FileRecord(name, sizes[name]) for name in names]
    _fetch_files(repo_id, commit, records, cache, force=force, token=token, progress=progress, done=done)
    if ahead:   # fetched before the others: not "already in the cache" in the summary
        progress.fetched_ahead(FileRecord(SAFETENSORS_INDEX, sizes[SAFETENSORS_INDEX]))
    earlier = cache.find(repo_id, commit)
    if earlier is not None and _gguf_names(f.name for f in earlier.files) and _gguf_names(names):
        # Another quantization of the same GGUF repo commit: one manifest lists both.
        records = _merge_gguf_downloads(earlier, records)
    # The ref first: a download counts as complete once its manifest is written, so a
    # failure between the two (disk full) leaves one that the next run finishes.
    cache.write_ref(repo_id, revision or DEFAULT_REVISION, commit)
    model = cache.write_manifest(repo_id=repo_id, revision=revision, commit=commit, files=records)
    progress.finished(model)
    return model


def _merge_gguf_downloads(earlier: DownloadedModel, records: list[FileRecord]) -> list[FileRecord]:
    """The files of an earlier complete GGUF download of this commit plus the new ones."""
    names = {r.name for r in records}
    return sorted([*(f for f in earlier.files if f.name not in names), *records], key=lambda r: r.name)


def _fetch_files(repo_id: str, commit: str, records: list[FileRecord], cache: ModelCache, *,
                 force: bool, token: str | None, progress: DownloadObserver, done: set[str]) -> None:
    """Fetches the records missing from the snapshot (all of them with `force`, but not `done`)."""
    snapshot = cache.snapshot_dir(repo_id, commit)
    present = {r.name for r in records if _present(snapshot / r.name, r.size)}
    pending = [r for r in records if r.name not in present or (force and r.name not in done)]
    _check_disk_space(cache, sum(r.size for r in pending))
    progress.started(repo_id, commit, records, pending)
    with progress:
        for finished, record in enumerate(pending):
            # A wrong-sized file in the snapshot (a damaged blob) is fetched again.
            refetch = force or (snapshot / record.name).exists()
            progress.file_started(record)
            try:
                path = _hf_download(repo_id, record.name, commit, cache, force=refetch, token=token,
                                    tqdm_class=progress.tqdm_class)
            except _network_errors() as error:
                # The hub answered the listing, so this is no "cannot reach the hub" (as it was
                # said): the transfer failed after the client's own retries.
                raise DownloadError(f"the connection to the hub failed while fetching {record.name} "
                                    f"({finished} of {len(pending)} files done)",
                                    f"run the same command again: complete files stay, but {NO_RESUME}, so "
                                    "this one starts over") from error
            actual = Path(path).stat().st_size
            if actual != record.size:
                raise DownloadError(f"{record.name} arrived with {actual} bytes, expected {record.size}",
                                    "run the download again")
            progress.file_finished(record)


def _hf_download(repo_id: str, filename: str, commit: str, cache: ModelCache, *, force: bool,
                 token: str | None, tqdm_class: type) -> str:
    from huggingface_hub import hf_hub_download

    # By commit, so every file comes from the same revision even if the branch moves meanwhile.
    return hf_hub_download(repo_id, filename, revision=commit, cache_dir=cache.hub_dir, force_download=force,
                           token=token, tqdm_class=tqdm_class)


def _index_shards(index_path: Path) -> list[str]:
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
        return sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise DownloadError(f"{SAFETENSORS_INDEX} in the repo is not a valid safetensors index") from None


def _present(path: Path, size: int) -> bool:
    try:
        return path.stat().st_size == size
    except OSError:
        return False


def _make_cache_dir(cache: ModelCache) -> None:
    """Before any transfer: a cache dir that cannot be made (a file in its path, under /proc)
    is the cache dir's fault, whatever the errno (ENOTDIR, ENOENT)."""
    try:
        cache.hub_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise _cache_write_error(error, cache) from None


def _check_disk_space(cache: ModelCache, needed: int) -> None:
    cache.hub_dir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(cache.hub_dir).free
    if needed > free:
        raise DownloadError(f"not enough disk space: {format_size(needed)} needed, {format_size(free)} free "
                            f"in {cache.root}", "free some space or choose another --cache-dir")


# -- errors --------------------------------------------------------------------------------
@contextmanager
def hub_errors(repo_id: str, revision: str | None, cache: ModelCache) -> Iterator[None]:
    """Turns the hub client's exceptions into one-line DownloadErrors with hints."""
    try:
        yield
    except (RuvllmError, KeyboardInterrupt):
        raise
    except Exception as error:  # noqa: BLE001 - mapped below, re-raised when unknown
        mapped = map_hub_error(error, repo_id, revision, cache)
        if mapped is None:
            raise
        raise mapped from error


def map_hub_error(error: BaseException, repo_id: str, revision: str | None,
                  cache: ModelCache) -> RuvllmError | None:
    """The one-line error for a hub client exception, or None for one we do not know."""
    from huggingface_hub import errors as hf

    rev = revision or DEFAULT_REVISION
    if isinstance(error, hf.HFValidationError):
        return DownloadError(f"'{repo_id}' is not a valid Hugging Face model id", "use the form org/name")
    if isinstance(error, ValueError) and error.__cause__ is not None:
        # hf_hub_download(force_download=True) wraps a failed metadata request in a ValueError.
        return map_hub_error(error.__cause__, repo_id, revision, cache)
    if isinstance(error, hf.GatedRepoError):
        status = error.response.status_code if error.response is not None else None
        refused = "the hub refused this token" if status == 403 else "it needs a token"
        return RepoUnavailableError(f"{repo_id} is a gated repo and {refused} (HTTP {status})",
                                    "accept its terms on the hub and set HF_TOKEN to a token of that account")
    if isinstance(error, hf.RevisionNotFoundError):
        return RevisionNotFoundError(f"revision '{rev}' not found in {repo_id}",
                                     "check the branch, tag or commit name")
    if isinstance(error, hf.HfHubHTTPError):
        return _http_error(error, repo_id, rev)
    if isinstance(error, hf.LocalEntryNotFoundError) and isinstance(error.__cause__, hf.HfHubHTTPError):
        # The client's "not in the local cache" after the hub answered an error (a 502, a 429):
        # the hub's answer says what went wrong, not "cannot reach the hub".
        return map_hub_error(error.__cause__, repo_id, revision, cache)
    if isinstance(error, hf.OfflineModeIsEnabled):
        return DownloadError("the hub cannot be reached: offline mode is on (HF_HUB_OFFLINE)",
                             "unset HF_HUB_OFFLINE to download")
    if isinstance(error, (hf.LocalEntryNotFoundError, *_network_errors())):
        return DownloadError(f"cannot reach the Hugging Face hub ({_endpoint()})",
                             "check your network connection (and HF_ENDPOINT)")
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return DownloadError(f"disk full while downloading {repo_id} into {cache.root}",
                             "free some space or choose another --cache-dir")
    if isinstance(error, OSError) and error.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR):
        return _cache_write_error(error, cache)
    if isinstance(error, OSError) and error.errno == errno.EFBIG:   # FAT32's 4 GiB, `ulimit -f`: again fails too
        return CacheError(f"the cache dir {cache.root} cannot hold a file this large ({error.strerror})",
                          "choose another --cache-dir (or RUVLLM_CACHE_DIR) on a filesystem that can")
    if isinstance(error, OSError):
        return DownloadError(f"download of {repo_id} failed: {error}", "run the download again")
    return None


def _cache_write_error(error: OSError, cache: ModelCache) -> CacheError:
    """A cache dir that cannot be written: another run would not help, another dir would."""
    return CacheError(f"cannot write to the cache dir {cache.root} ({error.strerror}: {error.filename})",
                      "choose another --cache-dir (or RUVLLM_CACHE_DIR)")


def _http_error(error: Any, repo_id: str, rev: str) -> DownloadError:
    from huggingface_hub import errors as hf

    response = getattr(error, "response", None)
    status = response.status_code if response is not None else None
    if status == 401 and "Invalid credentials" in (response.headers.get("X-Error-Message") or ""):
        return _rejected_token_error()
    if status == 401:
        # The hub answers a misspelt id so too: the spelling first, for a newcomer
        return RepoUnavailableError(f"{repo_id} needs authentication (HTTP 401): it is private or gated, or does "
                                    "not exist", "check the id's spelling (org/name); if it is private or gated, "
                                    "set HF_TOKEN to a token that can read it")
    if status == 403:
        return RepoUnavailableError(f"access to {repo_id} is forbidden with this token (HTTP 403)",
                                    "set HF_TOKEN to a token with read access to the repo")
    if isinstance(error, hf.RepositoryNotFoundError) or status == 404:
        return RepoUnavailableError(f"model repo {repo_id} not found on the hub",
                                    "check the id (org/name); private repos need HF_TOKEN")
    return DownloadError(f"the hub answered HTTP {status} for {repo_id}@{rev}", "try again later")


def _rejected_token_error() -> DownloadError:
    """Names where the rejected token came from, as huggingface_hub looks: HF_TOKEN (or
    the older HUGGING_FACE_HUB_TOKEN) first, then the file `hf auth login` writes; the
    message had always blamed HF_TOKEN, whose unsetting does not help a saved token."""
    import os

    from huggingface_hub import constants

    what = "HTTP 401: invalid credentials"
    for variable in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        if (os.environ.get(variable) or "").strip():
            return DownloadError(f"the hub rejected the token in {variable} ({what})",
                                 f"set {variable} to a valid token, or unset it for public repos")
    path = constants.HF_TOKEN_PATH
    if Path(path).is_file():
        return DownloadError(f"the hub rejected the token saved in {path} by `hf auth login` ({what})",
                             f"log in again with a valid token (hf auth login), or for public repos log out "
                             f"(hf auth logout, or delete {path})")
    return DownloadError(f"the hub rejected the token ({what})", "use a valid token, or none for public repos")


def _network_errors() -> tuple[type[BaseException], ...]:
    """Transport errors of the HTTP clients huggingface_hub may use (httpx2 in 2.x)."""
    types: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for module in ("httpx2", "httpx"):
        try:
            types.append(__import__(module).TransportError)
        except (ImportError, AttributeError):
            continue
    return tuple(types)


def _endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT
