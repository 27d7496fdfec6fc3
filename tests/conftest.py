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


@pytest.fixture(scope="session")
def dense(tmp_path_factory) -> Path:
    """A dense synthetic llama of 160 MiB (random weights, written once): what streams in the
    engine tests. Read-only; a test that cuts or edits a model copies it first."""
    from kimitui.model import synth

    out = tmp_path_factory.mktemp("dense") / "dense.gguf"
    spec = synth.plan_dense(160 * 2**20, "q4_1", synth.default_tokenizer())
    return synth.write_model(spec, out, seed=5, progress=False).paths[0]
