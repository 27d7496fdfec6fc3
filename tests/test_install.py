"""Installed as a user installs it (a wheel, not the checkout): every file the package reads at
run time is in it, and the app starts from it."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Built from a copy of the project's own files (tracked, or new and not ignored): a build
    in the checkout would reuse its build/ folder, which may hold what the package data misses."""
    import shutil

    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("wheel")
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True, check=True)
    for name in filter(None, listed.stdout.decode().split("\0")):
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out), str(source)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (built,) = out.glob("kimitui-*.whl")
    return built


def test_the_wheel_holds_every_stylesheet_and_theme_of_the_tree(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    needed = {f"kimitui/{p.relative_to(ROOT / 'kimitui').as_posix()}" for p in (ROOT / "kimitui").rglob("*.tcss")}
    needed |= {f"kimitui/themes/{p.name}" for p in (ROOT / "themes").glob("*.toml")}
    assert "kimitui/tui/screens/main.tcss" in needed
    assert needed <= names, f"missing from the wheel: {sorted(needed - names)}"


START_FROM_WHEEL = r"""
import asyncio, sys
import kimitui
assert kimitui.__file__.startswith(sys.argv[1]), kimitui.__file__  # the wheel's copy, not the checkout
from kimitui.cli import build_parser, make_app, resolve_model, resolve_settings
from kimitui.tui.widgets.chat import PromptInput

async def main():
    settings = resolve_settings(build_parser().parse_args([]))
    app = make_app(settings, resolve_model(settings))
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause(0.2)
        assert app.query_one(PromptInput) is not None
    print("started")

asyncio.run(main())
"""


def test_the_app_starts_headless_from_the_installed_wheel(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    # The wheel's files first on the path; its dependencies from this environment.
    proc = subprocess.run(
        [sys.executable, "-c", START_FROM_WHEEL, str(site)], capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(site)}, cwd=tmp_path,
    )
    assert proc.returncode == 0 and "started" in proc.stdout, proc.stdout + proc.stderr
