"""Saved conversations: open, delete, export to Markdown. Every read and write of the store
runs on the history thread (HistoryWriter), after the writes queued before it: a long history
never holds the event loop, and a dialog never shows a reply's state older than the chat's."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path
from typing import Callable

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.markup import escape
from textual.screen import ModalScreen
from textual.widgets import Label, OptionList
from textual.widgets.option_list import Option

from kimitui.history import export_filename
from kimitui.tui.history_writer import HistoryWriter


FAILED = object()  # what _stored gives back when the database refused


class HistoryScreen(ModalScreen[int | None]):
    """Dismisses with the id of the conversation to open, or None."""

    BINDINGS = [
        Binding("escape", "dismiss(None)", "close"),
        Binding("d", "delete", "delete"),
        Binding("e", "export", "export .md"),
    ]

    def __init__(self, history: HistoryWriter, export_dir: Path, *, resumes: Callable[[int], bool] = lambda _: False,
                 forget: Callable[[int], None] = lambda _: None) -> None:
        """``resumes(id)``: whether the engine would resume that conversation from its saved
        state; ``forget(id)``: a deleted conversation's saved state goes."""
        super().__init__()
        self.history = history
        self.resumes = resumes
        self.forget = forget
        self.store = history.store
        self.export_dir = export_dir
        self.filled = False  # the list has been read (it is read off the event loop)

    def compose(self) -> ComposeResult:
        with Vertical(id="history-box"):
            yield Label("Conversations  [dim]enter open · d delete · e export · esc close[/]")
            yield OptionList(id="history-list")

    async def on_mount(self) -> None:
        self.query_one(OptionList).focus()
        await self._fill()

    async def _stored(self, fn, *args, what: str):
        """``fn`` on the history thread; a database error is a notice and FAILED (the chat goes on)."""
        try:
            return await self.history.call(fn, *args)
        except sqlite3.Error as exc:
            self.notify(f"history: cannot {what}: {exc}", severity="error")
            return FAILED

    async def _fill(self) -> None:
        conversations = await self._stored(self.store.list_conversations, what="read the saved conversations")
        if not self.is_attached or conversations is FAILED:  # closed while the list was read, or unreadable
            return
        # Each saved state's header is read: off the event loop, as the list was.
        resuming = await asyncio.to_thread(lambda: {conv.id for conv in conversations if self.resumes(conv.id)})
        if not self.is_attached:
            return
        options = self.query_one(OptionList)
        options.clear_options()
        for conv in conversations:
            when = time.strftime("%m-%d %H:%M", time.localtime(conv.updated))
            ready = "  [b]resumes at once[/]" if conv.id in resuming else ""
            options.add_option(Option(f"{when}  {escape(conv.title)}  [dim]({conv.n_messages} msgs)[/]{ready}", id=str(conv.id)))
        if options.option_count == 0:
            options.add_option(Option("no saved conversations yet", disabled=True))
        else:
            options.highlighted = 0
        self.filled = True

    def _selected_id(self) -> int | None:
        options = self.query_one(OptionList)
        if options.highlighted is None:
            return None
        option = options.get_option_at_index(options.highlighted)
        return int(option.id) if option.id else None

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        if event.option.id:
            self.dismiss(int(event.option.id))

    async def action_delete(self) -> None:
        conv_id = self._selected_id()
        if conv_id is not None:
            if await self._stored(self.store.delete_conversation, conv_id, what="delete the conversation") is FAILED:
                return
            await asyncio.to_thread(self.forget, conv_id)
            self.notify("conversation deleted")
            if self.is_attached:  # the dialog may have closed while the delete ran
                await self._fill()

    async def action_export(self) -> None:
        conv_id = self._selected_id()
        conv = await self._stored(self.store.get_conversation, conv_id, what="read the conversation") if conv_id is not None else None
        if conv is None or conv is FAILED:
            return
        target = self.export_dir / export_filename(conv)
        text = await self._stored(self.store.export_markdown, conv.id, what="read the conversation")
        if text is FAILED:
            return
        try:
            await asyncio.to_thread(target.write_text, text, encoding="utf-8")
        except OSError as exc:
            self.notify(f"export failed: {exc.strerror}: {target}", severity="error")
            return
        self.notify(f"exported to {target}")
