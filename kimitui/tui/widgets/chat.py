"""Chat pane: the scrolling conversation and the multi-line prompt."""

from __future__ import annotations

from dataclasses import dataclass

from textual import events
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.markup import escape
from textual.message import Message
from textual.widgets import Markdown, Static, TextArea
from textual.widgets.markdown import MarkdownStream


class MessageView(Markdown):
    """One chat message. Assistant replies stream into it through a MarkdownStream."""

    def __init__(self, role: str, text: str = "", *, message_id: int | None = None, note: str = "") -> None:
        super().__init__(text, classes=f"message {role}")
        self.role = role
        self.text = text
        self.message_id = message_id
        self.border_title = {"user": "you", "assistant": "assistant", "system": "system"}.get(role, role)
        if note:
            self.border_subtitle = note
        self._stream: MarkdownStream | None = None

    async def add_fragment(self, fragment: str) -> None:
        if not fragment:
            return
        self.text += fragment
        if self._stream is None:
            self._stream = Markdown.get_stream(self)
        await self._stream.write(fragment)

    async def finish(self, note: str = "") -> None:
        # stop() then a full update(): a stream stopped alone can leave the widget blank.
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        await self.update(self.text)
        self.border_subtitle = note


class ChatLog(VerticalScroll, can_focus=True):
    """Stays at the bottom while replies stream, unless the user scrolls up (Textual's anchor).
    Empty, it says what to do and which model answers."""

    def on_mount(self) -> None:
        self.anchor()

    def show_hint(self, model: str) -> None:
        if self.query(MessageView):
            return
        text = (
            f"Ask [b]{escape(model)}[/b] anything: type below, Enter sends, ctrl+j for a new line.\n"
            "[dim]ctrl+e tune the engine · ctrl+o history · ctrl+t sampling · ctrl+p all commands[/dim]"
        )
        hints = self.query(".chat-hint")
        if hints:
            hints.first(Static).update(text)
        else:
            self.mount(Static(text, classes="chat-hint"))

    async def add(self, view: MessageView | Static) -> None:
        await self.query(".chat-hint").remove()
        await self.mount(view)
        self.anchor()

    def last_reply(self) -> MessageView | None:
        replies = [v for v in self.query(MessageView) if v.role == "assistant"]
        return replies[-1] if replies else None


class PromptInput(TextArea):
    """Enter sends; ctrl+j inserts a newline (it works in every terminal, unlike shift+enter)."""

    BINDINGS = [
        Binding("enter", "submit", "send", priority=True),
        Binding("ctrl+j", "newline", "newline", priority=True),
    ]

    @dataclass
    class Submitted(Message):
        text: str

    def __init__(self, **kwargs) -> None:
        super().__init__(soft_wrap=True, show_line_numbers=False, tab_behavior="focus", **kwargs)

    def action_submit(self) -> None:
        text = self.text.strip()
        if text:
            self.post_message(self.Submitted(text))

    def action_newline(self) -> None:
        self.insert("\n")

    async def _on_key(self, event: events.Key) -> None:
        # Some terminals send ctrl+j as a bare line feed that Textual reports as "newline".
        if event.key == "newline":
            event.prevent_default()
            event.stop()
            self.insert("\n")
            return
        await super()._on_key(event)
