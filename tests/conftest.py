"""Shared fixtures: every test gets its own config and data dirs; the real default model."""

from __future__ import annotations

from pathlib import Path

import pytest

from kimitui.model import default_model_path


@pytest.fixture(autouse=True)
def isolated_dirs(tmp_path_factory, monkeypatch):
    home = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home / "config"))
    monkeypatch.setenv("XDG_DATA_HOME", str(home / "data"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(home / "cache"))
    monkeypatch.setenv("XDG_STATE_HOME", str(home / "state"))
    monkeypatch.delenv("KIMITUI_CONFIG", raising=False)
    return home


@pytest.fixture(scope="session")
def model_path() -> Path:
    return default_model_path()
