"""Config file, flags and the one-line errors a user sees."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from kimitui.cli import build_parser, resolve_settings
from kimitui.config import SCHEMA, load_settings
from kimitui.errors import UserError
from kimitui.units import parse_size

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "text,expected",
    [("512MiB", 512 * 2**20), ("8GiB", 8 * 2**30), ("1.5GB", 1_500_000_000), ("4096", 4096), ("64 mib", 64 * 2**20), (123, 123)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "12XB", "-1GiB", "1.2.3GB"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        parse_size(text)


def test_example_documents_every_key_with_its_default():
    example = (ROOT / "config.example.toml").read_text()
    settings = load_settings(ROOT / "config.example.toml", explicit=True)
    for section, keys in SCHEMA.items():
        assert f"[{section}]" in example
        for key, spec in keys.items():
            match = re.search(rf"^# (.+)\n{key} = ", example, flags=re.M)
            assert match, f"{section}.{key} lacks a one-line explanation in config.example.toml"
            assert settings[f"{section}.{key}"] == spec.default, f"{section}.{key} example differs from default"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(text)
    return path


def error_of(path: Path) -> str:
    with pytest.raises(UserError) as info:
        load_settings(path, explicit=True)
    return str(info.value)


def test_unknown_key_names_key_and_line(tmp_path):
    path = write(tmp_path, "[model]\nn_ctx = 2048\n\n[sampling]\ntemprature = 0.5\n")
    message = error_of(path)
    assert "line 5" in message and "sampling.temprature" in message and "unknown key" in message


def test_unknown_section(tmp_path):
    assert "unknown section [sampler]" in error_of(write(tmp_path, "[sampler]\nx = 1\n"))


def test_wrong_type(tmp_path):
    message = error_of(write(tmp_path, '[sampling]\ntemperature = "hot"\n'))
    assert "line 2" in message and "sampling.temperature" in message and "expected a number" in message


def test_out_of_range(tmp_path):
    assert "below the minimum" in error_of(write(tmp_path, "[sampling]\ntop_p = -0.5\n"))


def test_nan_is_not_a_number_in_range(tmp_path):
    message = error_of(write(tmp_path, "[metrics]\ninterval = nan\n"))
    assert "line 2" in message and "metrics.interval" in message and "finite" in message


def test_unparsable_size(tmp_path):
    message = error_of(write(tmp_path, '[engine]\nbudget = "lots"\n'))
    assert "engine.budget" in message and "line 2" in message and "size" in message


def test_invalid_toml(tmp_path):
    assert "not valid TOML" in error_of(write(tmp_path, "[model\n"))


def test_values_and_flag_override(tmp_path, monkeypatch):
    path = write(tmp_path, '[engine]\nbudget = "6GiB"\n[model]\nn_ctx = 1024\n')
    monkeypatch.setenv("KIMITUI_CONFIG", str(path))
    settings = resolve_settings(build_parser().parse_args(["--budget", "512MiB"]))
    assert settings["engine.budget"] == 512 * 2**20
    assert settings["model.n_ctx"] == 1024
    assert settings.origin("engine.budget") == "--budget"


def run_cli(*args: str, env_config: Path | None = None) -> subprocess.CompletedProcess:
    import os

    env = dict(os.environ)
    if env_config is not None:
        env["KIMITUI_CONFIG"] = str(env_config)
    return subprocess.run([sys.executable, "-m", "kimitui", *args], capture_output=True, text=True, env=env, timeout=120)


def assert_one_line_exit_2(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


def test_cli_bad_config_is_one_line_exit_2(tmp_path):
    line = assert_one_line_exit_2(run_cli(env_config=write(tmp_path, "[ui]\ncolour = 1\n")))
    assert "ui.colour" in line and "line 2" in line


def test_cli_missing_model_is_one_line_exit_2(tmp_path):
    line = assert_one_line_exit_2(run_cli("--model", str(tmp_path / "absent.gguf")))
    assert "model file not found" in line and "absent.gguf" in line


def test_cli_missing_model_from_config_names_the_line(tmp_path):
    path = write(tmp_path, f'[model]\npath = "{tmp_path / "gone.gguf"}"\n')
    line = assert_one_line_exit_2(run_cli(env_config=path))
    assert "gone.gguf" in line and "line 2" in line


def test_cli_not_a_gguf(tmp_path):
    bogus = tmp_path / "notes.gguf"
    bogus.write_text("hello")
    line = assert_one_line_exit_2(run_cli("--model", str(bogus)))
    assert "not a GGUF file" in line


def test_cli_truncated_gguf(tmp_path, model_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(model_path.read_bytes()[: 20 * 2**20])
    line = assert_one_line_exit_2(run_cli("--model", str(cut)))
    assert "cut.gguf" in line


def test_cli_unknown_theme():
    line = assert_one_line_exit_2(run_cli("--theme", "neon"))
    assert "unknown theme 'neon'" in line


def test_cli_bad_flag_value():
    line = assert_one_line_exit_2(run_cli("--budget", "huge"))
    assert line.startswith("kimitui: --budget:")


def test_missing_explicit_config(tmp_path):
    line = assert_one_line_exit_2(run_cli("--config", str(tmp_path / "nope.toml")))
    assert "config file not found" in line
