"""The reply loop sees the engine only as a generation.ReplyHost: the Engine offers each of its
members, and generation.py imports nothing of session.py, not even lazily."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from kimitui.engine import generation
from kimitui.engine.generation import ReplyHost
from kimitui.engine.session import Engine


def test_the_engine_offers_what_a_reply_asks(model_path):
    engine = Engine(model_path)
    try:
        asked = {name for name in vars(ReplyHost) if not name.startswith("_")} | set(ReplyHost.__annotations__)
        missing = []
        for name in sorted(asked):
            try:
                inspect.getattr_static(engine, name)
            except AttributeError:
                missing.append(name)
        assert not missing, missing
    finally:
        engine.close()


def test_the_reply_loop_does_not_import_the_engine():
    tree = ast.parse(Path(generation.__file__).read_text())
    imported = [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    imported += [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    assert not [name for name in imported if name and name.endswith("session")], imported
