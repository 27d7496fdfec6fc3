"""Chat history in SQLite (WAL): conversations survive restarts and crashes mid-reply.

A reply's row is written when it starts and updated as it streams, so a crash leaves the
partial text marked incomplete rather than nothing. Small app settings (the chosen theme)
live in the same file.
"""

from __future__ import annotations

import json
import re
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY,
    title TEXT NOT NULL,
    model TEXT NOT NULL,
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    role TEXT NOT NULL,
    content TEXT NOT NULL,
    complete INTEGER NOT NULL DEFAULT 1,
    stats TEXT,
    created REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id, id);
CREATE TABLE IF NOT EXISTS settings (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


@dataclass(frozen=True)
class Conversation:
    id: int
    title: str
    model: str
    created: float
    updated: float
    n_messages: int = 0


@dataclass(frozen=True)
class Message:
    id: int
    role: str
    content: str
    complete: bool
    stats: dict | None


class HistoryStore:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)

    def close(self) -> None:
        self._db.close()

    # conversations
    def create_conversation(self, title: str, model: str) -> int:
        now = time.time()
        cur = self._db.execute(
            "INSERT INTO conversations(title, model, created, updated) VALUES (?, ?, ?, ?)",
            (title[:80] or "New chat", model, now, now),
        )
        return int(cur.lastrowid)

    def list_conversations(self) -> list[Conversation]:
        rows = self._db.execute(
            "SELECT c.id, c.title, c.model, c.created, c.updated, COUNT(m.id) FROM conversations c "
            "LEFT JOIN messages m ON m.conversation_id = c.id GROUP BY c.id ORDER BY c.updated DESC, c.id DESC"
        ).fetchall()
        return [Conversation(*row) for row in rows]

    def get_conversation(self, conversation_id: int) -> Conversation | None:
        row = self._db.execute(
            "SELECT id, title, model, created, updated FROM conversations WHERE id = ?", (conversation_id,)
        ).fetchone()
        return Conversation(*row) if row else None

    def delete_conversation(self, conversation_id: int) -> None:
        self._db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))

    # messages
    def add_message(self, conversation_id: int, role: str, content: str, *, complete: bool = True) -> int:
        now = time.time()
        cur = self._db.execute(
            "INSERT INTO messages(conversation_id, role, content, complete, created) VALUES (?, ?, ?, ?, ?)",
            (conversation_id, role, content, int(complete), now),
        )
        self._db.execute("UPDATE conversations SET updated = ? WHERE id = ?", (now, conversation_id))
        return int(cur.lastrowid)

    def update_message(self, message_id: int, content: str, *, complete: bool, stats: dict | None = None) -> None:
        self._db.execute(
            "UPDATE messages SET content = ?, complete = ?, stats = ? WHERE id = ?",
            (content, int(complete), json.dumps(stats) if stats is not None else None, message_id),
        )

    def delete_message(self, message_id: int) -> None:
        self._db.execute("DELETE FROM messages WHERE id = ?", (message_id,))

    def messages(self, conversation_id: int) -> list[Message]:
        rows = self._db.execute(
            "SELECT id, role, content, complete, stats FROM messages WHERE conversation_id = ? ORDER BY id",
            (conversation_id,),
        ).fetchall()
        return [Message(i, r, c, bool(done), json.loads(st) if st else None) for i, r, c, done, st in rows]

    def export_markdown(self, conversation_id: int) -> str:
        conv = self.get_conversation(conversation_id)
        if conv is None:
            raise KeyError(conversation_id)
        stamp = time.strftime("%Y-%m-%d %H:%M", time.localtime(conv.created))
        lines = [f"# {conv.title}", "", f"*{conv.model} · {stamp}*", ""]
        for msg in self.messages(conversation_id):
            heading = {"user": "You", "assistant": "Assistant", "system": "System"}.get(msg.role, msg.role)
            suffix = "" if msg.complete else " (interrupted)"
            lines += [f"## {heading}{suffix}", "", msg.content, ""]
        return "\n".join(lines)

    # settings
    def get_setting(self, key: str) -> str | None:
        row = self._db.execute("SELECT value FROM settings WHERE key = ?", (key,)).fetchone()
        return row[0] if row else None

    def set_setting(self, key: str, value: str) -> None:
        self._db.execute(
            "INSERT INTO settings(key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = excluded.value",
            (key, value),
        )


def export_filename(conv: Conversation) -> str:
    slug = re.sub(r"[^a-zA-Z0-9]+", "-", conv.title).strip("-").lower()[:40] or "chat"
    return f"kimitui-{conv.id}-{slug}.md"
