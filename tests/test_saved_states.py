"""Conversation states kept on disk: a chat reopened after a restart restores its llama.cpp
state (KV cells, and Kimi K3's KDA recurrent state) instead of evaluating its tokens, with the
same next tokens as a run that never stopped; a state file that is damaged, cut short, or made
for another model or context is refused in one line and the tokens are evaluated as before; and
an SSH drop (SIGHUP) mid-reply ends the reply into the history with its state saved."""

from __future__ import annotations

import json
import os
import pty
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kimitui.engine.generation import Sampling
from kimitui.engine.saved_states import MAGIC, SavedStates, StateRefused
from kimitui.engine.session import Engine
from kimitui.model import synth

from helpers import count_decodes, wait_for

GREEDY = Sampling(temperature=0.0, max_tokens=8)
FIRST = [{"role": "user", "content": "Name three colours of the rainbow."}]
KEY = "conversation-1"


@pytest.fixture(scope="module")
def k3_model(tmp_path_factory) -> Path:
    """A 4-layer Kimi K3 cut (3 KDA, 1 MLA): its state is mostly the recurrent matrices."""
    spec = synth.plan_like("kimi-k3", None, 0.02, "q4_1", synth.default_tokenizer(), synth.Cut(layers=4))
    out = tmp_path_factory.mktemp("k3") / "k3.gguf"
    return synth.write_model(spec, out, seed=3, progress=False).paths[0]


def engine_on(path: Path, states: Path | None, n_ctx: int = 512) -> Engine:
    engine = Engine(path, n_ctx=n_ctx, fast_load=False, states_dir=states, state_quota=1 << 30 if states else 0)
    engine.load()
    return engine


def turn(engine: Engine, messages: list[dict], keep: str | None = KEY):
    gen = engine.chat(messages, GREEDY, keep=keep)
    tokens = [event.token_id for event in gen if event.token_id >= 0]
    return tokens, gen.result


def two_turns(path: Path, states: Path | None) -> tuple[list[dict], list[int]]:
    """A first turn (its state saved where ``states``), and the messages of the second."""
    engine = engine_on(path, states)
    try:
        _, first = turn(engine, FIRST)
    finally:
        engine.close()
    return FIRST + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And one more?"}], first


@pytest.mark.parametrize("which", ["default", "k3"])
def test_a_restart_restores_the_conversation_instead_of_evaluating_it(which, model_path, k3_model, tmp_path):
    path = model_path if which == "default" else k3_model
    uninterrupted = engine_on(path, None)
    try:
        _, first = turn(uninterrupted, FIRST, keep=None)
        second = FIRST + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And one more?"}]
        expected, _ = turn(uninterrupted, second, keep=None)
    finally:
        uninterrupted.close()

    states = tmp_path / "states"
    messages, _ = two_turns(path, states)
    assert messages == second
    assert (states / f"{KEY}.state").stat().st_size > 0
    restarted = engine_on(path, states)
    try:
        assert restarted.resumes(KEY)
        evaluated = count_decodes(restarted)
        tokens, result = turn(restarted, messages)
        assert tokens == expected
        assert result.notices == []
        # Only what the conversation added since the state was saved is evaluated: the reply's
        # last token and the new message, not the first turn again.
        assert result.cached_tokens > len(restarted.chat_prompt(FIRST)[0])
        assert evaluated[0] == result.prompt_tokens - result.cached_tokens
    finally:
        restarted.close()


def damage(path: Path, how: str, other_model: Path) -> str:
    """Spoil the state file ``path`` as ``how`` says; returns what its refusal must say."""
    data = bytearray(path.read_bytes())
    if how == "flipped":
        data[-100] ^= 0xFF
        path.write_bytes(data)
        return "checksum mismatch"
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
        return "truncated"
    if how == "not ours":
        path.write_bytes(b"GGUF" + bytes(64))
        return "not a kimitui state file"
    if how == "header":
        path.write_bytes(MAGIC + b"{not json\n" + bytes(data[len(MAGIC) + 200 :]))
        return "header is damaged"
    head_end = data.index(b"\n", len(MAGIC)) + 1
    header = json.loads(data[len(MAGIC) : head_end])
    if how == "another model":
        header["model"], header["model_name"] = "0" * 32, other_model.name
        expected = f"another model ({other_model.name})"
    elif how == "a string count":
        header["n_tokens"] = str(header["n_tokens"])
        expected = "header is damaged"
    else:  # a size past the file's end (a flipped bit in the header)
        header["state_bytes"] = 1 << 40
        expected = "truncated"
    path.write_bytes(MAGIC + json.dumps(header).encode() + b"\n" + data[head_end:])
    return expected


@pytest.mark.parametrize("how", ["flipped", "truncated", "not ours", "header", "another model", "a string count", "a huge size"])
def test_a_bad_state_is_refused_in_one_line_and_the_tokens_are_evaluated(how, model_path, k3_model, tmp_path):
    states = tmp_path / "states"
    messages, _ = two_turns(model_path, states)
    fresh = engine_on(model_path, None)
    try:
        expected, _ = turn(fresh, messages, keep=None)
    finally:
        fresh.close()
    file = states / f"{KEY}.state"
    says = damage(file, how, k3_model)
    engine = engine_on(model_path, states)
    try:
        assert not engine.resumes(KEY) or how in ("flipped", "truncated")  # the header alone looks fine there
        tokens, result = turn(engine, messages)
        assert tokens == expected
        assert result.cached_tokens == 0
        assert len(result.notices) == 1 and "\n" not in result.notices[0]
        assert says in result.notices[0] and str(file) in result.notices[0]
        # The refused file is replaced by this reply's good one.
        assert engine.resumes(KEY)
    finally:
        engine.close()


def test_a_state_restores_into_another_context_that_holds_it(model_path, tmp_path):
    """The context the next start fits may differ (memory differs): a state whose tokens fit it
    is restored; one with more tokens than it holds is refused in one line."""
    states = tmp_path / "states"
    messages, _ = two_turns(model_path, states)
    fresh = engine_on(model_path, None, n_ctx=1024)
    try:
        expected, _ = turn(fresh, messages, keep=None)
    finally:
        fresh.close()
    engine = engine_on(model_path, states, n_ctx=1024)
    try:
        tokens, result = turn(engine, messages)
        assert tokens == expected and result.notices == [] and result.cached_tokens > 0
    finally:
        engine.close()


def test_old_states_go_within_the_quota(tmp_path):
    states = SavedStates(tmp_path, quota=3500, identity="m", n_ctx=256, model_name="m.gguf")
    for n, key in enumerate(["a", "b", "c"]):
        states.save(key, list(range(10)), bytes(900))
        os.utime(states.path(key), (1000 + n, 1000 + n))
    assert states.load("a") is not None  # used now: the least recently used is b
    states.save("d", list(range(10)), bytes(900))
    assert sorted(p.stem for p in tmp_path.glob("*.state")) == ["a", "c", "d"]
    with pytest.raises(OSError, match="larger than the state quota"):
        states.save("e", [], bytes(4000))
    assert not states.path("e").exists() and not list(tmp_path.glob(".*.tmp"))
    with pytest.raises(StateRefused, match="saved with another model"):
        SavedStates(tmp_path, 3500, "other", 256, "o.gguf").load("a")
    with pytest.raises(StateRefused, match=r"holds 10 tokens, more than this context's 4$"):
        SavedStates(tmp_path, 3500, "m", 4, "m.gguf").load("a")
    # A write killed half-way (jetsam, SIGKILL) leaves its temporary file: the next save sweeps it.
    stale = tmp_path / ".z.state.1.tmp"
    stale.write_bytes(bytes(100))
    os.utime(stale, (1000, 1000))
    states.save("a", list(range(10)), bytes(900))
    assert not stale.exists()


def test_a_state_made_with_the_other_kv_cache_is_refused_and_kept(tmp_path):
    """A context that may check drafts caches keys and values otherwise (kv_cache.py): a state
    of one cannot be put in the other, either way; a file from before the header named its cache
    is a plain context's."""
    from kimitui.engine.kv_cache import PLAIN, Q8_0

    plain = SavedStates(tmp_path, 10_000, "m", 256, "m.gguf")
    drafting = SavedStates(tmp_path, 10_000, "m", 256, "m.gguf", cache=Q8_0.name)
    drafting.save("q", [1, 2, 3], bytes(100))
    plain.save("f", [1, 2, 3], bytes(100))
    with pytest.raises(StateRefused, match=r"q.state: its KV cache is q8_0 with flash attention, this context's f16 \(engine.speculate\)$") as refused:
        plain.load("q")
    assert not refused.value.damaged and drafting.path("q").exists() and not plain.resumes("q")
    with pytest.raises(StateRefused, match=r"its KV cache is f16, this context's q8_0 with flash attention"):
        drafting.load("f")
    assert drafting.load("q").tokens == [1, 2, 3] and plain.load("f").tokens == [1, 2, 3]
    # The same file with its header as it was written before: no "cache".
    raw = plain.path("f").read_bytes()
    head, rest = raw[len(MAGIC):].split(b"\n", 1)
    header = json.loads(head)
    assert header.pop("cache") == PLAIN.name
    plain.path("old").write_bytes(MAGIC + json.dumps(header).encode() + b"\n" + rest)
    assert plain.load("old").tokens == [1, 2, 3]
    with pytest.raises(StateRefused, match="its KV cache is f16"):
        drafting.load("old")


def test_a_full_disk_keeps_the_old_state_and_says_so(model_path, tmp_path, monkeypatch):
    states = tmp_path / "states"
    messages, _ = two_turns(model_path, states)
    before = (states / f"{KEY}.state").read_bytes()
    engine = engine_on(model_path, states)
    try:
        real_fsync = os.fsync

        def full(fd):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(os, "fsync", full)
        _, result = turn(engine, messages)
        monkeypatch.setattr(os, "fsync", real_fsync)
        assert result.notices == [f"could not save the conversation's state in {states}: No space left on device"]
        assert (states / f"{KEY}.state").read_bytes() == before
        assert not list(states.glob(".*.tmp"))
    finally:
        engine.close()


# -- an SSH drop -----------------------------------------------------------------------

APP = r"""
import sys
from kimitui.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_closed_terminal_mid_reply_keeps_the_reply_and_its_state(model_path, tmp_path, isolated_dirs):
    """The app in a pseudo-terminal, a reply streaming, then the terminal goes (its master
    closed and SIGHUP, as sshd does): the process exits, the reply is in the history, its
    conversation's state is on disk, and the next start reopens that chat."""
    config = tmp_path / "config.toml"
    config.write_text("[sampling]\ntemperature = 0.0\nmax_tokens = 400\n")
    env = dict(os.environ, KIMITUI_CONFIG=str(config), TERM="xterm-256color", COLUMNS="100", LINES="30")
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-c", APP], stdin=slave, stdout=slave, stderr=slave, env=env,
                            start_new_session=True, close_fds=True)
    os.close(slave)
    data = isolated_dirs / "data" / "kimitui"
    history = data / "history.sqlite3"
    seen = bytearray()

    def drain():
        import select

        while select.select([master], [], [], 0)[0]:
            try:
                chunk = os.read(master, 65536)
            except OSError:
                return
            if not chunk:
                return
            seen.extend(chunk)

    def replying() -> bool:
        drain()
        if not history.exists():
            return False
        with sqlite3.connect(history) as db:
            row = db.execute("SELECT content FROM messages WHERE role = 'assistant'").fetchone()
        return row is not None and len(row[0]) > 20

    try:
        wait_for(lambda: (drain(), b"loaded in" in seen)[1], "the app to load the model", 120)
        time.sleep(2)  # the pinned set (none, the model fits) is settled: the app takes messages
        os.write(master, b"Write a long story about a lighthouse keeper.")
        time.sleep(1)
        os.write(master, b"\r")
        wait_for(replying, "the reply to stream into the history", 120)
        os.close(master)
        master = -1
        os.killpg(proc.pid, signal.SIGHUP)
        rc = proc.wait(60)
    finally:
        if master >= 0:
            os.close(master)
        if proc.poll() is None:
            proc.kill()
    assert rc == 0, seen[-2000:].decode(errors="replace")
    with sqlite3.connect(history) as db:
        (conversation,) = db.execute("SELECT id FROM conversations").fetchone()
        content, stats = db.execute("SELECT content, stats FROM messages WHERE role = 'assistant'").fetchone()
        (asked,) = db.execute("SELECT content FROM messages WHERE role = 'user'").fetchone()
        dropped = db.execute("SELECT value FROM settings WHERE key = 'dropped_conversation'").fetchone()
    assert len(content) > 20 and json.loads(stats)["finish_reason"] == "cancelled"
    assert dropped == (str(conversation),)
    state = data / "states" / f"conversation-{conversation}.state"
    assert state.stat().st_size > 0

    # The next start: the same conversation goes on from its state, its tokens not evaluated.
    engine = Engine(model_path, n_ctx=4096, fast_load=False, states_dir=data / "states", state_quota=1 << 30)
    engine.load()
    try:
        messages = [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": asked},
            {"role": "assistant", "content": content},
            {"role": "user", "content": "Go on."},
        ]
        gen = engine.chat(messages, Sampling(temperature=0.0, max_tokens=4), keep=f"conversation-{conversation}")
        list(gen)
        assert gen.result.notices == []
        assert gen.result.cached_tokens > gen.result.prompt_tokens // 2
    finally:
        engine.close()
