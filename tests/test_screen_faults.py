"""What a user does on the main screen while things fail: the history database refusing a write,
a conversation opened while a reply streams, a reply that failed before its first token, and a
fuzz of key sequences while streaming and tuning. On the fake engine (fakes.py): the screen's
own logic, the same on every run; test_tui.py drives the real engine."""

from __future__ import annotations

import sqlite3

from fakes import FakeEngine, fake_app
from helpers import until
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kimitui.config import data_dir
from kimitui.history import HistoryStore
from kimitui.tui.widgets.chat import MessageView, PromptInput


async def typed(pilot, app, text: str) -> None:
    await until(pilot, lambda: app.main.ready)
    app.query_one(PromptInput).focus()
    await pilot.press(*text)
    await pilot.press("enter")


def notices(app) -> list[str]:
    return [n.message for n in app._notifications]


async def test_a_message_the_history_cannot_save_stays_in_the_box_and_the_app_goes_on(monkeypatch):
    app = fake_app()
    real_add = HistoryStore.add_message
    full = [True]

    def add_message(self, *args, **kwargs):
        if full[0]:
            raise sqlite3.OperationalError("database or disk is full")
        return real_add(self, *args, **kwargs)

    monkeypatch.setattr(HistoryStore, "add_message", add_message)
    async with app.run_test(size=(120, 40)) as pilot:
        await typed(pilot, app, "keep me")
        await until(pilot, lambda: any("disk is full" in n for n in notices(app)))
        assert app.query_one(PromptInput).text == "keep me"  # not lost
        assert not app.query(MessageView) and app.main.reply is None
        line = next(n for n in notices(app) if "disk is full" in n)
        assert line.startswith("history: could not save your message") and "\n" not in line
        full[0] = False  # space freed: the same message goes through
        app.query_one(PromptInput).focus()
        await pilot.press("enter")
        await until(pilot, lambda: app.main.reply is None and len(app.query(MessageView)) == 2 and app.query(MessageView).last().border_subtitle)
        assert app.query(MessageView).last().text.startswith("Hello!")
        assert app.query_one(PromptInput).text == ""  # sent: it left the box
        conv = app.main.conversation_id
    assert [m.content for m in HistoryStore(data_dir() / "history.sqlite3").messages(conv)][0] == "keep me"


async def test_a_conversation_deleted_by_another_instance_is_said_and_nothing_typed_is_lost():
    app = fake_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await typed(pilot, app, "first")
        await until(pilot, lambda: app.main.reply is None and app.query(MessageView).last().border_subtitle)
        HistoryStore(data_dir() / "history.sqlite3").delete_conversation(app.main.conversation_id)  # the other kimitui
        await typed(pilot, app, "second")
        await until(pilot, lambda: any("deleted meanwhile" in n for n in notices(app)))
        assert app.query_one(PromptInput).text == "second"
        await pilot.press("ctrl+n")
        await pilot.pause()
        app.query_one(PromptInput).focus()
        await pilot.press("enter")
        await until(pilot, lambda: app.main.reply is None and len(app.query(MessageView)) == 2 and app.query(MessageView).last().border_subtitle)
        assert app.query(MessageView).first().text == "second"


async def test_opening_a_conversation_while_a_reply_streams_keeps_that_reply_in_its_history():
    import threading

    engine = FakeEngine(reply="one two three four five six seven eight")
    engine.gate = threading.Event()
    app = fake_app(engine)
    store = HistoryStore(data_dir() / "history.sqlite3")
    other = store.create_conversation("another chat", "k3-cut.gguf")
    store.add_message(other, "user", "from before")
    async with app.run_test(size=(120, 40)) as pilot:
        await typed(pilot, app, "count")
        await until(pilot, lambda: app.main.reply is not None and app.main.reply.text)  # held mid-reply
        first = app.main.conversation_id
        await app.main._open_conversation(other)
        engine.gate.set()
        await until(pilot, lambda: app.main.reply is None)
        assert app.main.engine_state == "idle"  # not left on "generating"
        assert [v.text for v in app.query(MessageView)] == ["from before"]
    rows = store.messages(first)
    assert [r.role for r in rows] == ["user", "assistant"]
    assert rows[1].content.startswith("one two three") and rows[1].complete


async def test_a_reply_whose_row_cannot_be_saved_leaves_the_message_unsent_in_the_box(monkeypatch):
    real_add = HistoryStore.add_message
    full = [True]

    def add_message(self, conversation_id, role, *args, **kwargs):
        if role == "assistant" and full[0]:
            raise sqlite3.OperationalError("database is locked")
        return real_add(self, conversation_id, role, *args, **kwargs)

    monkeypatch.setattr(HistoryStore, "add_message", add_message)
    app = fake_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await typed(pilot, app, "ask")
        await until(pilot, lambda: any("database is locked" in n for n in notices(app)))
        await until(pilot, lambda: not app.main.busy)
        assert app.query_one(PromptInput).text == "ask" and not app.query(MessageView)
        full[0] = False
        app.query_one(PromptInput).focus()
        await pilot.press("enter")
        await until(pilot, lambda: app.main.reply is None and len(app.query(MessageView)) == 2 and app.query(MessageView).last().border_subtitle)
        conv = app.main.conversation_id
    # No user turn left without its reply in the history: the unsent one was taken back.
    assert [m.role for m in HistoryStore(data_dir() / "history.sqlite3").messages(conv)] == ["user", "assistant"]


async def test_a_reply_that_failed_before_its_first_token_stays_a_turn():
    engine = FakeEngine(fail_reply="the drive went away")
    engine.reply_words = []  # fails before any token
    app = fake_app(engine)
    async with app.run_test(size=(120, 40)) as pilot:
        await typed(pilot, app, "Hi")
        await until(pilot, lambda: app.main.reply is None and str(app.query(MessageView).last().border_subtitle).startswith("error:"))
        engine.fail_reply, engine.reply_words = None, ["fine"]
        await typed(pilot, app, "Hello")
        await until(pilot, lambda: app.main.reply is None and len(app.query(MessageView)) == 4 and app.query(MessageView).last().border_subtitle)
    # Roles alternate, as templates that insist on it need: the empty reply is a turn.
    assert [(m["role"], m["content"]) for m in engine.asked[-1] if m["role"] != "system"] == [("user", "Hi"), ("assistant", ""), ("user", "Hello")]


async def test_a_failed_engine_refuses_the_send_in_one_line_and_keeps_the_message():
    engine = FakeEngine()
    app = fake_app(engine)
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: app.main.ready)
        engine.lifecycle.fail("llama.cpp could not make a new context for streaming (out of memory)")
        await typed(pilot, app, "still here")
        await until(pilot, lambda: any("new context" in n for n in notices(app)))
        assert app.query_one(PromptInput).text == "still here" and not app.query(MessageView)


# -- random keys: no exception, no lost message ---------------------------------------------------

KEYS = ["a", "b", "enter", "escape", "ctrl+e", "up", "down", "left", "right", "ctrl+n", "ctrl+r", "ctrl+t", "ctrl+y",
        "1", "5", "7", "z", "p", "plus", "minus", "tab", "backspace", "ctrl+j"]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.lists(st.sampled_from(KEYS), min_size=5, max_size=40))
async def test_random_keys_while_streaming_and_tuning_raise_nothing_and_keep_every_shown_message(keys):
    import threading

    engine = FakeEngine(reply="w " * 12)
    engine.gate = threading.Event()
    app = fake_app(engine)
    async with app.run_test(size=(120, 40)) as pilot:
        await typed(pilot, app, "hold")  # a reply held mid-stream while the keys arrive
        await until(pilot, lambda: app.main.reply is not None)
        await pilot.press("ctrl+e")  # and the tuning strip open
        for i, key in enumerate(keys):
            if i == len(keys) // 2:
                engine.gate.set()  # the reply ends in the middle of it
            if app.screen is not app.main:
                await pilot.press("escape")  # a dialog opened: closed, and the keys go on
            await pilot.press(key)
        engine.gate.set()
        while app.screen is not app.main:
            await pilot.press("escape")
        await until(pilot, lambda: app.main.reply is None and not app.main.busy)
        conv = app.main.conversation_id
        shown = [(v.role, v.text) for v in app.query(MessageView)]
    assert app.return_code in (None, 0)
    # Every message that reached the chat is in the history, as shown (none lost, none half-kept).
    if conv is not None:
        kept = [(m.role, m.content) for m in HistoryStore(data_dir() / "history.sqlite3").messages(conv)]
        assert kept == shown
