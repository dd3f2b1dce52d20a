"""`ruvllm download`: fetch a model into the cache."""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator

import click

from ruvllm_cli.cli.completion import complete_model
from ruvllm_cli.cli.context import app_context, global_options
from ruvllm_cli.cli.options import quantization_option
from ruvllm_cli.errors import RepoUnavailableError, RevisionNotFoundError, UsageError
from ruvllm_cli.quantization import Quantization

if TYPE_CHECKING:
    from ruvllm_cli.registry.registry import ModelRef


@click.command("download")
@click.argument("model", shell_complete=complete_model)
@quantization_option("Which GGUF file to fetch from a GGUF repo (or an alias's); safetensors are fetched "
                     "as they are, and -q on chat, serve and benchmark quantizes them when they load",
                     "the alias's recommended one (ruvllm list), else q4k, else a GGUF repo's only file")
@click.option("-f", "--force", is_flag=True,
              help="Fetch every file of the revision again from the hub, even if complete (to repair "
                   "damaged files). Not needed for a branch that moved: a plain download fetches its new "
                   "commit's changed files.")
@click.option("--revision", metavar="REV",
              help="Branch, tag or commit (also MODEL@REV) of the repo fetched: an alias's GGUF repo, "
                   "unless --safetensors.")
@click.option("--safetensors", is_flag=True,
              help="Fetch the full-precision safetensors even where the registry names a GGUF file.")
@global_options
def command(model: str, quantization: Quantization | None, force: bool, revision: str | None,
            safetensors: bool) -> None:
    """Download MODEL (an alias, or a Hugging Face id org/name) into the cache.

    Fetches only the files the model needs, shows progress on stderr, skips a model
    that is already complete, and keeps revisions apart. For a branch or tag it first
    asks the hub which commit that is now: a branch that moved gets its new commit,
    linking the files that did not change (the old commit stays until ruvllm rm
    ID@COMMIT); offline (HF_HUB_OFFLINE) or without network, the complete download
    is used, with a note. For an alias whose registry
    entry names a GGUF file of the chosen quantization (by default the one `ruvllm
    list` recommends), that one file is fetched; --safetensors fetches the
    full-precision weights instead. A revision (--revision, MODEL@REV) is one of the
    repo fetched, the GGUF repo included. The label printed says what the files are
    ("GGUF Q8_0", "safetensors bf16"). Private and gated repos need HF_TOKEN;
    HF_ENDPOINT points at another hub.

    Stopped and run again, a download keeps every complete file, but the file it was
    fetching starts over: huggingface_hub cannot continue a partial file from another
    run (docs/design.md, section 10).

    \b
    Examples:
      ruvllm download qwen-0.5b
      ruvllm download qwen-0.5b -q q4k
      ruvllm download Qwen/Qwen2.5-0.5B-Instruct --revision main
      ruvllm dl qwen-0.5b@main --force
    """
    from ruvllm_cli.registry.cache import ModelCache
    from ruvllm_cli.registry.download import download_model
    from ruvllm_cli.registry.locate import gguf_variant
    from ruvllm_cli.registry.progress import DownloadProgress
    from ruvllm_cli.registry.registry import resolve_model

    app = app_context()
    out = app.output()
    ref = resolve_model(model)
    if ref.kind == "local":
        out.info(f"{ref.local_path} is already local: nothing to download.")
        return
    chosen, quantization = quantization, quantization or download_default(ref)
    revision = _merge_revision(ref.revision, revision)
    _quiet_hub_logs(app.verbose)
    progress = DownloadProgress(out.err, verbose=app.verbose)
    variant = None if safetensors or quantization is None else gguf_variant(ref, quantization)
    cache = ModelCache(app.cache_dir)
    if variant is not None:
        gguf_ref, file_name = variant
        try:
            with _interrupt_note(out):
                download_model(gguf_ref, quantization, cache, force=force, revision=revision, progress=progress,
                               file_name=file_name)
        except RepoUnavailableError as error:
            if isinstance(error, RevisionNotFoundError):   # missing there too, likely: keep its own hint
                raise
            # The alias's own safetensors repo is another way to get the model.
            raise RepoUnavailableError(error.message, f"fetch the safetensors from {ref.repo_id} instead: "
                                       f"ruvllm download {model} --safetensors") from error
        return
    with _interrupt_note(out):
        downloaded = download_model(ref, quantization, cache, force=force, revision=revision, progress=progress)
    if chosen is not None and downloaded.stored_as.startswith("safetensors"):
        out.info(f"-q {chosen.value} applies when the model loads: ruvllm chat {model} -q {chosen.value}")


@contextmanager
def _interrupt_note(out: Any) -> Iterator[None]:
    """On Ctrl-C, say what the next run keeps and what it fetches again."""
    try:
        yield
    except KeyboardInterrupt:
        from ruvllm_cli.registry.download import NO_RESUME

        out.warn(f"interrupted: complete files stay in the cache, but {NO_RESUME}: the file in progress "
                 "starts over next time")
        raise


def download_default(ref: ModelRef) -> Quantization | None:
    """The registry's recommended quantization for the model; None for another repo, whose
    GGUF file is then its Q4_K_M one, else its only one (registry/download.choose_gguf)."""
    return ref.entry.recommended_quantization if ref.entry is not None else None


def _quiet_hub_logs(verbose: bool) -> None:
    """The client logs retries ("Trying to resume download...") as warnings: shown with -v only."""
    if not verbose:
        from huggingface_hub.utils import logging as hub_logging

        hub_logging.set_verbosity_error()


def _merge_revision(in_name: str | None, option: str | None) -> str | None:
    if in_name and option and in_name != option:
        raise UsageError(f"two revisions given: '{in_name}' (in the name) and '{option}' (--revision)",
                         "give only one")
    return option or in_name
