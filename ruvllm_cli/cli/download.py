"""`ruvllm download`: fetch a model into the cache."""

from __future__ import annotations

import click

from ruvllm_cli.cli.context import app_context, global_options
from ruvllm_cli.cli.options import quantization_option
from ruvllm_cli.errors import UsageError
from ruvllm_cli.quantization import Quantization


@click.command("download")
@click.argument("model")
@quantization_option(default="q4k", help_extra=" Picks the GGUF file of a GGUF repo; "
                     "safetensors are quantized at load time.")
@click.option("-f", "--force", is_flag=True, help="Fetch every file again, even if complete.")
@click.option("--revision", metavar="REV", help="Branch, tag or commit (also MODEL@REV).")
@click.option("--safetensors", is_flag=True,
              help="Fetch the full-precision safetensors even where the registry names a GGUF file.")
@global_options
def command(model: str, quantization: Quantization, force: bool, revision: str | None,
            safetensors: bool) -> None:
    """Download MODEL (an alias, or a Hugging Face id org/name) into the cache.

    Fetches only the files the model needs, shows progress on stderr, skips a model
    that is already complete, and keeps revisions apart. For an alias whose registry
    entry names a GGUF file of the chosen quantization, that one file is fetched
    (smaller; quantized again at load); --safetensors fetches the full-precision
    weights instead. Private and gated repos need HF_TOKEN; HF_ENDPOINT points at
    another hub.

    \b
    Examples:
      ruvllm download qwen-0.5b
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
    revision = _merge_revision(ref.revision, revision)
    _quiet_hub_logs(app.verbose)
    progress = DownloadProgress(out.err, verbose=app.verbose)
    variant = None if safetensors or revision else gguf_variant(ref, quantization)
    if variant is not None:
        ref, file_name = variant
        download_model(ref, quantization, ModelCache(app.cache_dir), force=force, progress=progress,
                       file_name=file_name)
        return
    download_model(ref, quantization, ModelCache(app.cache_dir), force=force, revision=revision,
                   progress=progress)


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
