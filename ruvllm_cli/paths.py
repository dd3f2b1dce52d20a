"""Where ruvllm keeps its files: one resolver each for the cache, config and data directories.

The cache holds what can be fetched again (models, the chat history); the data dir
holds what cannot (saved chats), so clearing the cache never deletes them."""

from __future__ import annotations

import os
from pathlib import Path

APP_NAME = "ruvllm"
CACHE_ENV = "RUVLLM_CACHE_DIR"
CONFIG_ENV = "RUVLLM_CONFIG_DIR"
DATA_ENV = "RUVLLM_DATA_DIR"
# Inside a model's directory: ruvllm's quantized weights and checked tokenizer
# (engine/weight_cache.py), which `list -d` counts and `rm` removes with the model.
WEIGHT_CACHE_DIR = ".ruvllm-weights"


def resolve_cache_dir(option: str | os.PathLike | None = None) -> Path:
    """`--cache-dir` beats `RUVLLM_CACHE_DIR`, which beats the platform user cache dir."""
    if option:
        return Path(option).expanduser().resolve()
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser().resolve()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir(APP_NAME))


def resolve_config_dir() -> Path:
    """`RUVLLM_CONFIG_DIR`, else the platform user config dir (user aliases live here)."""
    env = os.environ.get(CONFIG_ENV)
    if env:
        return Path(env).expanduser().resolve()
    from platformdirs import user_config_dir

    return Path(user_config_dir(APP_NAME))


def resolve_data_dir() -> Path:
    """`RUVLLM_DATA_DIR`, else the platform user data dir (saved chats live here)."""
    env = os.environ.get(DATA_ENV)
    if env:
        return Path(env).expanduser().resolve()
    from platformdirs import user_data_dir

    return Path(user_data_dir(APP_NAME))


def chats_dir() -> Path:
    """Where `/save` without a file writes, and `/load` without one reads."""
    return resolve_data_dir() / "chats"
