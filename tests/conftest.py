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
    monkeypatch.delenv("KIMITUI_API_KEY", raising=False)
    # Tests talk to servers on loopback; a proxy from the environment must not carry that.
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    return home


@pytest.fixture(scope="session")
def model_path() -> Path:
    return default_model_path()
