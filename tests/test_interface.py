"""What a user interface asks of an engine (engine/interface.py), checked against the three that
implement it: the in-process Engine, the HTTP RemoteEngine and the tests' FakeEngine. A method
the UI calls that one of them lacks, or takes under other parameter names, fails here rather
than in the app."""

from __future__ import annotations

import inspect
from dataclasses import fields

import pytest

from kimitui.engine.interface import ChatEngine, TuningValues
from kimitui.engine.metrics import EngineMetrics
from kimitui.engine.session import Engine
from kimitui.engine.state import Lifecycle
from kimitui.server.client import RemoteEngine

from fakes import FakeEngine

METHODS = sorted(name for name, value in vars(ChatEngine).items() if inspect.isfunction(value) and not name.startswith("_"))
ATTRIBUTES = {"metrics": EngineMetrics, "lifecycle": Lifecycle, "load_s": (float, type(None))}


def parameters(function) -> list[tuple[str, object]]:
    """(name, kind) of each parameter after ``self``, and which of them have defaults."""
    params = list(inspect.signature(function).parameters.values())[1:]
    return [(p.name, p.kind, p.default is inspect.Parameter.empty) for p in params]


@pytest.fixture(params=["Engine", "RemoteEngine", "FakeEngine"])
def engine(request, model_path):
    if request.param == "Engine":
        made = Engine(model_path)
    elif request.param == "RemoteEngine":
        made = RemoteEngine("http://127.0.0.1:9")  # never asked: nothing listens there
    else:
        made = FakeEngine()
    yield made
    close = getattr(made, "close", None)
    if close is not None:
        close()


def test_the_interface_names_what_the_app_calls():
    assert {"label", "load", "notices", "pin", "chat", "resumes", "forget_state", "abort_load", "tuning", "retune"} <= set(METHODS)


def test_each_engine_implements_the_interface(engine):
    tunables = {f.name for f in fields(TuningValues)}
    for name in METHODS:
        method = getattr(type(engine), name, None)
        assert callable(method), f"{type(engine).__name__} has no {name}"
        asked, given = parameters(getattr(ChatEngine, name)), parameters(method)
        if asked == [("changes", inspect.Parameter.VAR_KEYWORD, True)]:
            # retune(**changes): any TuningValues fields by keyword, each optional.
            assert all(
                kind is inspect.Parameter.VAR_KEYWORD or (kind is inspect.Parameter.KEYWORD_ONLY and not required and p in tunables)
                for p, kind, required in given
            ), f"{type(engine).__name__}.{name}: {given}"
        else:
            assert given == asked, f"{type(engine).__name__}.{name}"
    for name, kind in ATTRIBUTES.items():
        assert isinstance(getattr(engine, name), kind), f"{type(engine).__name__}.{name}"


def test_the_engine_implements_what_the_server_asks(model_path):
    """engine/interface.py's ServingEngine, checked against the in-process Engine: every method
    with the same parameters, and every attribute present (a property, or set when it is made)."""
    from kimitui.engine.interface import ServingEngine

    made = Engine(model_path)
    try:
        methods = [name for name, value in vars(ServingEngine).items() if inspect.isfunction(value) and not name.startswith("_")]
        assert {"complete", "tokenize", "detokenize", "chat_prompt", "slot_file"} <= set(methods)
        for name in methods:
            method = getattr(Engine, name, None)
            assert callable(method), f"Engine has no {name}"
            assert parameters(method) == parameters(getattr(ServingEngine, name)), f"Engine.{name}"
        for name in ServingEngine.__annotations__:
            assert hasattr(Engine, name) or name in vars(made), f"Engine has no {name}"
    finally:
        made.close()
