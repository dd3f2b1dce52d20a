"""ruvllm: download, chat with, serve and benchmark local LLMs."""

from __future__ import annotations

__version__ = "0.1.0"


def installed_version(distribution: str) -> str | None:
    """An installed package's version from its metadata (no import of the package:
    transformers' costs 0.6 s), or None where it is not installed."""
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None
