"""Chat history: survives restarts and a crash mid-reply; lists, deletes, exports."""

from __future__ import annotations

import subprocess
import sys

from kimitui.history import HistoryStore, export_filename


def test_roundtrip_and_export(tmp_path):
    store = HistoryStore(tmp_path / "h.sqlite3")
    conv = store.create_conversation("Sea facts", "SmolLM2")
    store.add_message(conv, "user", "Tell me about the sea")
    reply = store.add_message(conv, "assistant", "", complete=False)
    store.update_message(reply, "It is *wet*.", complete=True, stats={"completion_tokens": 5})
    store.close()

    again = HistoryStore(tmp_path / "h.sqlite3")
    [listed] = again.list_conversations()
    assert listed.title == "Sea facts" and listed.n_messages == 2
    msgs = again.messages(conv)
    assert [m.role for m in msgs] == ["user", "assistant"]
    assert msgs[1].complete and msgs[1].stats == {"completion_tokens": 5}
    md = again.export_markdown(conv)
    assert "# Sea facts" in md and "## You" in md and "It is *wet*." in md
    assert export_filename(listed) == f"kimitui-{conv}-sea-facts.md"
    again.delete_conversation(conv)
    assert again.list_conversations() == [] and again.messages(conv) == []


def test_partial_reply_survives_a_crash(tmp_path):
    db = tmp_path / "h.sqlite3"
    # A separate process writes a partial reply and dies without closing the database.
    code = f"""
import os
from kimitui.history import HistoryStore
s = HistoryStore(__import__('pathlib').Path({str(db)!r}))
c = s.create_conversation('crash', 'm')
s.add_message(c, 'user', 'hi')
r = s.add_message(c, 'assistant', '', complete=False)
s.update_message(r, 'half a repl', complete=False)
os._exit(9)
"""
    proc = subprocess.run([sys.executable, "-c", code], timeout=60)
    assert proc.returncode == 9
    store = HistoryStore(db)
    [conv] = store.list_conversations()
    msgs = store.messages(conv.id)
    assert msgs[-1].content == "half a repl" and not msgs[-1].complete
    assert "(interrupted)" in store.export_markdown(conv.id)


def test_settings(tmp_path):
    store = HistoryStore(tmp_path / "h.sqlite3")
    assert store.get_setting("theme") is None
    store.set_setting("theme", "kimitui-paper")
    store.set_setting("theme", "nord")
    assert store.get_setting("theme") == "nord"
