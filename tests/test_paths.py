"""Where ruvllm keeps its files (ruvllm_cli/paths.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from platformdirs import user_cache_dir, user_data_dir

from ruvllm_cli.paths import chats_dir, resolve_cache_dir, resolve_data_dir


def test_saved_chats_live_in_the_data_dir_not_the_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Issue 23, item 8: /save wrote into the model cache, so clearing the cache deleted chats."""
    monkeypatch.delenv("RUVLLM_DATA_DIR")
    monkeypatch.delenv("RUVLLM_CACHE_DIR")
    assert chats_dir() == Path(user_data_dir("ruvllm")) / "chats"
    assert resolve_cache_dir() == Path(user_cache_dir("ruvllm"))
    assert not chats_dir().is_relative_to(resolve_cache_dir())
    monkeypatch.setenv("RUVLLM_DATA_DIR", str(tmp_path / "data"))
    assert resolve_data_dir() == tmp_path / "data" and chats_dir() == tmp_path / "data" / "chats"
