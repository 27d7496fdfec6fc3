"""The main screen: the chat beside the live panels and the tuning strip, and their keys.

It owns what they show (reactives bound to the widgets with ``data_bind``), the engine's
load, pin and replies (thread workers whose failures all end in ``on_worker_state_changed``),
and the chat's history (written through a thread of its own).
"""

from __future__ import annotations

import itertools
import sqlite3
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.reactive import reactive
from textual.screen import Screen
from textual.widgets import Footer, Static
from textual.worker import Worker, WorkerState

from kimitui.engine.interface import ChatEngine
from kimitui.engine.metrics import Sampler, Snapshot
from kimitui.engine.generation import GenerationResult, Sampling
from kimitui.engine.state import EngineError
from kimitui.tui.history_writer import HistoryWriter
from kimitui.tui.messages import LoadFinished, LoadProgress, PinFinished, PinProgressed, ReplyFinished, SnapshotReady, TokenReceived
from kimitui.tui.widgets.chat import ChatLog, MessageView, PromptInput
from kimitui.tui.widgets.panels import NOT_STREAMING, PANEL_TYPES, ApiPanel, LatencyPanel, Panel, PanelColumn
from kimitui.tui.widgets.status import StatusBar
from kimitui.tui.widgets.trace_log import TokenBreakdown, TraceLog
from kimitui.tui.widgets.tuning import TuningPanel
from kimitui.units import format_bytes

PERSIST_EVERY_S = 1.0  # how often a streaming reply is written to the history database
PANEL_KEYS = Binding.Group("panels", compact=True)  # the footer shows the panels' keys as one group
DROPPED_KEY = "dropped_conversation"  # the history setting naming the chat a closed terminal left
DROP_GRACE_S = 60.0  # after the terminal closed, how long a reply may take to stop before the app exits anyway


def state_key(conversation_id: int) -> str:
    """The name the engine keeps a conversation's saved state under."""
    return f"conversation-{conversation_id}"


@dataclass
class Reply:
    """A reply in flight: its widget, its database row and the engine's generation. Its text
    is kept here, not only in the widget: a reply whose chat was left (another conversation
    opened, a new chat) ends into its own history row with nothing lost (``detached``)."""

    id: int
    view: MessageView
    message_id: int
    conversation_id: int | None = None
    generation: object = None
    text: str = ""
    detached: bool = False
    last_saved: float = field(default_factory=time.monotonic)

    def leave(self) -> None:
        """Its chat is no longer shown: stop it; it still ends into the history."""
        self.detached = True
        if self.generation is not None:
            self.generation.cancel()


class HistoryError(Exception):
    """A history write or read the screen waited for failed: one line saying what and why."""


def _failure(error: BaseException) -> str:
    """An engine's own error is its one line; anything else is a bug, named as such."""
    return str(error) if isinstance(error, EngineError) else f"{type(error).__name__}: {error}"


def _history_reason(exc: BaseException) -> str:
    if isinstance(exc, sqlite3.IntegrityError) and "FOREIGN KEY" in str(exc):
        return "the conversation was deleted meanwhile (by another kimitui?); ctrl+n starts a new one"
    return str(exc) or type(exc).__name__


class MainScreen(Screen):
    CSS_PATH = "main.tcss"

    BINDINGS = [
        # Priority: the prompt box would otherwise take these (ctrl+y is its redo). They are the
        # screen's, so a dialog on top has its own keys and these are not in force there.
        Binding("escape", "cancel_or_leave", "cancel", priority=True),
        Binding("ctrl+r", "regenerate", "regenerate", priority=True),
        Binding("ctrl+n", "new_chat", "new chat", priority=True),
        Binding("ctrl+o", "history", "history", priority=True),
        Binding("ctrl+y", "copy_reply", "copy reply", priority=True),
        Binding("ctrl+t", "sampling", "sampling", priority=True),
        Binding("ctrl+e", "tuning", "tune", priority=True),
        *(
            Binding(panel.KEY, f"toggle_panel({panel.KEY})", panel.LABEL or panel.TITLE, group=PANEL_KEYS)
            for panel in sorted(PANEL_TYPES, key=lambda panel: panel.KEY)
        ),
        Binding("9", "toggle_trace", "trace", group=PANEL_KEYS),
        Binding("z", "maximize_panel", "maximise"),
        Binding("p", "pause", "pause"),
        Binding("plus,equals_sign", "faster", "faster", group=Binding.Group("refresh", compact=True)),
        Binding("minus", "slower", "slower", group=Binding.Group("refresh", compact=True)),
    ]

    # What the widgets show; each is bound to them in compose.
    snapshot: reactive[Snapshot | None] = reactive(None, init=False, always_update=True)
    idle_note = reactive(NOT_STREAMING)
    model_name = reactive("")
    model_bytes = reactive(0)
    engine_state = reactive("starting")
    status_detail = reactive("")
    sampling_line = reactive("")
    pinning = reactive("")
    pinned = reactive("")
    lossy = reactive("")

    def __init__(self, engine: ChatEngine, sampler: Sampler, history: HistoryWriter, sampling: Sampling,
                 system_prompt: str, *, trace=None, api=None) -> None:
        """``api``: starts the HTTP API from this engine, given a callback for each request
        served (called on the server's thread); returns its URL. None: no API."""
        super().__init__()
        self.engine = engine
        self.sampler = sampler
        self.history = history
        self.sampling = sampling
        self.system_prompt = system_prompt
        self.trace = trace
        self._api = api
        self.api_url: str | None = None  # where the API serves, once started
        self.conversation_id: int | None = None
        self.ready = False
        self.reply: Reply | None = None
        self._starting = False  # a message or a regenerate is being written and its reply started
        self._reply_ids = itertools.count(1)
        self._trace_error_shown = False
        self.terminal_gone = False  # the terminal closed (SIGHUP): the app ends once the reply has
        self.status_bar = StatusBar(lambda: engine.metrics.budget_bytes, id="status")
        self.chat_log = ChatLog(id="chat-log")
        self.trace_log = TraceLog(id="trace-log")
        self.prompt = PromptInput(id="prompt")
        self.tuning_panel = TuningPanel(id="tuning")
        self.panels = {panel_type.KEY: panel_type(id=f"panel-{panel_type.KEY}") for panel_type in PANEL_TYPES}

    # -- layout --------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield self.status_bar.data_bind(
            MainScreen.model_name, MainScreen.model_bytes, MainScreen.pinning, MainScreen.pinned, MainScreen.lossy,
            state=MainScreen.engine_state, detail=MainScreen.status_detail, sampling=MainScreen.sampling_line,
        )
        with Horizontal(id="main"):
            with Vertical(id="chat-pane"):
                yield self.chat_log
                yield self.trace_log
                yield self.tuning_panel.data_bind(MainScreen.snapshot)
                yield self.prompt
            yield PanelColumn(
                *(panel.data_bind(MainScreen.snapshot, MainScreen.idle_note) for panel in self.panels.values()), id="panels",
            )
        yield Footer()

    def on_mount(self) -> None:
        self._show_label()
        self.engine_state = "loading"
        self.tuning_panel.display = False
        # On a phone-sized terminal the chat needs the room: the pane starts hidden (key 9 shows it).
        self.trace_log.display = self.trace is not None and self.app.size.width >= 100
        if self.trace is not None:
            bar = TokenBreakdown(id="token-breakdown")
            self.panels["5"].mount(bar)  # the last token's split, under the latency sparkline
            # feed() only queues; the widgets drain on a UI timer, so read threads never wait for the UI.
            self.trace.subscribe(self.trace_log.feed)
            self.trace.subscribe(bar.feed)
        api_panel = self.panels["6"]
        api_panel.display = self._api is not None
        if self._api is not None:
            self.api_url = self._api(lambda record: self.app.call_from_thread(api_panel.add_request, record))
            api_panel.url = f"serving {self.api_url}"
            api_panel.show_requests()
        self.show_sampling()
        self.sampler.subscribe(lambda snap: self.post_message(SnapshotReady(snap)))
        self.sampler.start()
        self.prompt.focus()
        self.run_worker(self._load, thread=True, group="load", exit_on_error=False)
        self.call_later(self.reopen_dropped)

    def _show_label(self) -> None:
        self.model_name, model_bytes = self.engine.label()
        self.model_bytes = model_bytes or 0
        self.chat_log.show_hint(self.model_name)

    def on_unmount(self) -> None:
        if self.reply is not None and self.reply.generation is not None:
            self.reply.generation.cancel()
        self.engine.abort_load()
        self.sampler.stop()

    def show_sampling(self) -> None:
        s = self.sampling
        paused = " paused" if self.sampler.paused else ""
        self.sampling_line = f"T {s.temperature:g} top_p {s.top_p:g} max {s.max_tokens} · {self.sampler.interval:g}s{paused}"

    # -- workers: load, pin, reply ----------------------------------------------------------

    def _load(self) -> None:
        last = [0.0]

        def progress(fraction: float) -> None:
            # llama.cpp calls back per tensor; a repaint per whole percent is plenty.
            if fraction - last[0] >= 0.01 or fraction >= 1.0:
                last[0] = fraction
                self.post_message(LoadProgress(fraction))

        self.engine.load(progress)
        # The engine's own figure: the load may have started before this worker (start_loading).
        self.post_message(LoadFinished(self.engine.load_s or 0.0))

    def _pin(self) -> None:
        last = [0.0]

        def progress(p) -> None:
            now = time.monotonic()
            if now - last[0] >= 0.1 or p.finished:
                last[0] = now
                self.post_message(PinProgressed(p))

        outcome = self.engine.pin(progress)
        self.post_message(PinFinished(outcome.pinned_bytes, outcome.note, outcome.whole_model))

    def _generate(self, reply: Reply, messages: list[dict], sampling: Sampling) -> None:
        keep = state_key(reply.conversation_id) if reply.conversation_id is not None else None
        generation = self.engine.chat(messages, sampling, keep=keep)
        reply.generation = generation
        if reply.detached:  # its chat was left before the generation existed
            generation.cancel()
        for event in generation:
            self.post_message(TokenReceived(reply.id, event))
        self.post_message(ReplyFinished(reply.id, generation.result))

    async def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        """Every worker's failure ends here: the load's, the pin's, a reply's."""
        if event.state is not WorkerState.ERROR:
            return
        error = _failure(event.worker.error)
        if event.worker.group == "load":
            self.engine_state, self.status_detail = "failed", ""
            self.notify(error, severity="error", timeout=30)
        elif event.worker.group == "pin":
            self.ready = True  # replies work without a pinned set: the next one tries again
            self.notify(error, severity="error", timeout=15)
        elif event.worker.group == "generate":
            reply = self.reply
            if reply is not None and event.worker.name == f"reply-{reply.id}":
                result = getattr(reply.generation, "result", None) or GenerationResult()
                await self._end_reply(reply.id, result, error)
        else:
            self.notify(error, severity="error", timeout=15)

    def on_load_progress(self, message: LoadProgress) -> None:
        self.status_detail = f"{message.fraction:.0%}"

    def on_load_finished(self, message: LoadFinished) -> None:
        self.engine_state, self.status_detail = "idle", f"(loaded in {message.seconds:.1f}s)"
        self._show_label()  # a remote engine knows its model only now
        for notice in self.engine.notices():
            self.notify(notice, severity="warning", timeout=15)
        self.tuning_panel.current = self.engine.tuning()
        self._show_lossy()
        self.run_worker(self._pin, thread=True, group="pin", exit_on_error=False)

    def on_pin_progressed(self, message: PinProgressed) -> None:
        p = message.progress
        # A re-pin from live tuning ends without a PinFinished: its last progress says it all.
        self.pinning = "" if p.finished else p.describe()
        if p.finished:
            self.pinned = f"pinned {format_bytes(p.total_bytes)}"

    def on_pin_finished(self, message: PinFinished) -> None:
        self.ready = True  # the pinned set and the streamer are complete (the engine's turn holds replies till then)
        if message.whole_model:
            self.idle_note = "model fits in memory: nothing streams"
        elif self.engine.tuning() is not None and not message.pinned_bytes:  # local; a server's engine is its own
            self.idle_note = "not streamed: fast start was unavailable, llama.cpp read the model at load"
        locked = "" if message.note is None else " (not locked)"
        self.pinning = ""
        self.pinned = f"pinned {format_bytes(message.pinned_bytes)}{locked}" if message.pinned_bytes else ""
        if message.note:
            self.notify(message.note, severity="warning", timeout=15)

    def on_snapshot_ready(self, message: SnapshotReady) -> None:
        self.snapshot = message.snapshot
        self._show_lossy()

    def _show_lossy(self) -> None:
        """Expert trimming, while it is on, with the share of routes it skipped so far."""
        setting = self.engine.lossy_setting()
        streaming = self.snapshot.streaming if self.snapshot is not None else None
        routes = streaming.expert_routes if streaming is not None else None
        if setting and routes:
            setting += f" ({streaming.expert_routes_skipped / routes:.0%} skipped)"
        self.lossy = setting or ""

    # -- chat ----------------------------------------------------------------------------

    @on(PromptInput.Submitted)
    async def send(self, event: PromptInput.Submitted) -> None:
        if not self.ready:
            self.notify("the model is still loading; your message stays in the box", severity="warning")
            return
        if self.busy:
            self.notify("a reply is streaming; Esc cancels it", severity="warning")
            return
        refused = self.engine.lifecycle.refusal()
        if refused is not None:
            self.notify(f"{refused}; your message stays in the box", severity="error", timeout=15)
            return
        # The message leaves the box only once it is saved, and only if the box still holds it.
        store = self.history.store
        with self._starting_reply():
            try:
                if self.conversation_id is None:
                    self.conversation_id = await self._history(
                        "start a conversation", store.create_conversation, event.text.splitlines()[0], self.model_name,
                    )
                message_id = await self._history("save your message", store.add_message, self.conversation_id, "user", event.text)
            except HistoryError as exc:
                self.notify(f"{exc}; your message stays in the box", severity="error", timeout=15)
                return
            view = MessageView("user", event.text, message_id=message_id)
            await self.chat_log.add(view)
            try:
                await self._start_reply()
            except HistoryError as exc:  # no reply can follow it: the message goes back to being unsent
                self.history.post(store.delete_message, message_id)
                await view.remove()
                self.notify(f"{exc}; no reply started, your message stays in the box", severity="error", timeout=15)
                return
            if self.prompt.text == event.text:
                self.prompt.clear()

    async def _history(self, what: str, fn, *args, **kwargs):
        """A history call the screen waits for; HistoryError says what failed and why (a full
        disk, a read-only or locked database, a conversation deleted by another instance)."""
        try:
            return await self.history.call(fn, *args, **kwargs)
        except (sqlite3.Error, OSError) as exc:
            raise HistoryError(f"history: could not {what}: {_history_reason(exc)}") from None

    @contextmanager
    def _starting_reply(self):
        """Held while a message or a reply's rows are written and its reply started: the awaits
        let keys in, and none may start another reply or clear the chat meanwhile (nests)."""
        held, self._starting = self._starting, True
        try:
            yield
        finally:
            self._starting = held

    @property
    def busy(self) -> bool:
        """A reply streams, or one is on its way (its rows being written)."""
        return self.reply is not None or self._starting

    def _history_messages(self) -> list[dict]:
        """The chat as the model sees it. An empty reply (one that failed before its first
        token) stays a turn: without it two user turns would follow each other, which
        templates that insist on alternating roles refuse for the rest of the conversation."""
        msgs = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        for view in self.chat_log.query(MessageView):
            msgs.append({"role": view.role, "content": view.text})
        return msgs

    async def _start_reply(self) -> None:
        """HistoryError where the reply's row cannot be written (nothing started)."""
        messages = self._history_messages()
        view = MessageView("assistant", "")
        with self._starting_reply():
            await self.chat_log.add(view)
            try:
                view.message_id = await self._history(
                    "save the reply's row", self.history.store.add_message, self.conversation_id, "assistant", "", complete=False,
                )
            except HistoryError:
                await view.remove()
                raise
        self.reply = Reply(next(self._reply_ids), view, view.message_id, self.conversation_id)
        if self.terminal_gone:
            self.reply.leave()  # the terminal closed while its rows were written: it stops at once
        self.engine_state, self.status_detail = "generating", ""
        self.run_worker(
            partial(self._generate, self.reply, messages, Sampling(**vars(self.sampling))),
            thread=True, group="generate", name=f"reply-{self.reply.id}", exit_on_error=False,
        )

    async def on_token_received(self, message: TokenReceived) -> None:
        reply = self.reply
        if reply is None or reply.id != message.reply_id:
            return
        reply.text += message.event.text
        if not reply.detached:
            await reply.view.add_fragment(message.event.text)
            self.status_detail = f"{message.event.index + 1} tok"
        if time.monotonic() - reply.last_saved >= PERSIST_EVERY_S:
            self.history.post(self.history.store.update_message, reply.message_id, reply.text, complete=False)
            reply.last_saved = time.monotonic()

    async def on_reply_finished(self, message: ReplyFinished) -> None:
        await self._end_reply(message.reply_id, message.result, None)

    async def _end_reply(self, reply_id: int, result: GenerationResult, error: str | None) -> None:
        reply = self.reply
        if reply is None or reply.id != reply_id:
            return
        self.reply = None
        tok_s = (result.completion_tokens - 1) / result.decode_s if result.decode_s > 0 and result.completion_tokens > 1 else None
        stats = {
            "finish_reason": result.finish_reason,
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": result.completion_tokens,
            "prompt_s": round(result.prompt_s, 4),
            "decode_tok_s": round(tok_s, 2) if tok_s else None,
        }
        note = f"{result.completion_tokens} tok" + (f" · {tok_s:.1f} tok/s" if tok_s else "")
        if result.finish_reason == "cancelled":
            note += " · cancelled"
        elif result.finish_reason == "length":
            note += " · max tokens reached"
        if error:
            note = f"error: {error}"
            self.notify(error, severity="error", timeout=15)
        # Queued before the view is finished: the app may be closing while it awaits.
        self.history.post(self.history.store.update_message, reply.message_id, reply.text, complete=error is None, stats=stats)
        if self.trace is not None and self.trace.error and not self._trace_error_shown:
            self._trace_error_shown = True
            self.notify(f"trace stopped: {self.trace.error}", severity="warning", timeout=15)
        self.engine_state, self.status_detail = "idle", ""
        if not reply.detached:
            await reply.view.finish(note)
            # What the user should know of this reply (old turns left the context, the context
            # filled, a saved state refused) stays in the chat under it; the history keeps the messages.
            for notice in result.notices:
                await self.chat_log.add(Static(notice, classes="chat-notice", markup=False))
        else:
            for notice in result.notices:
                self.notify(notice, severity="warning", timeout=15)
        if self.terminal_gone:
            self.app.exit()

    # -- tuning --------------------------------------------------------------------------

    def action_tuning(self) -> None:
        """Show the tuning strip and give it the keys; again: hide it."""
        panel = self.tuning_panel
        if self.engine.tuning() is None:
            self.notify("remote mode: the server's engine is tuned on the server")
            return
        if panel.display and panel.has_focus:
            panel.display = False
            self.remove_class("-tuning")
            self.prompt.focus()
            return
        panel.current = self.engine.tuning()
        panel.display = True
        self.add_class("-tuning")
        panel.focus()

    @on(TuningPanel.Apply)
    def apply_tuning(self, event: TuningPanel.Apply) -> None:
        names = ", ".join(name.replace("_", " ") for name in event.changes)
        try:
            when = self.engine.retune(**event.changes)
        except EngineError as exc:
            self.tuning_panel.applied(f"not applied: {exc}")
            return
        self.status_bar.refresh()  # it reads the budget the engine has now
        self.tuning_panel.current = self.engine.tuning()
        self.tuning_panel.applied(f"{names}: {when}")

    # -- actions -------------------------------------------------------------------------

    def action_cancel_or_leave(self) -> None:
        if self.maximized is not None:
            self.minimize()
        elif self.tuning_panel.has_focus and self.tuning_panel.drop_pending():
            pass  # values stepped in the strip, mid-reply or not: Esc drops them, the reply goes on
        elif self.reply is not None and self.reply.generation is not None:
            self.reply.generation.cancel()
            self.engine_state = "cancelling"
        elif self.focused is self.prompt:
            # Leave the prompt so the panel keys (1-9, p, +, -, z) reach the screen.
            self.panels["5"].focus()
        else:
            self.prompt.focus()

    def _refused_while_starting(self) -> bool:
        if self._starting:
            self.notify("a message is on its way into this chat; try again in a moment", severity="warning")
        return self._starting

    async def action_regenerate(self) -> None:
        if not self.ready or self.reply is not None or self._refused_while_starting():
            return
        refused = self.engine.lifecycle.refusal()
        if refused is not None:
            self.notify(refused, severity="error", timeout=15)
            return
        last = self.chat_log.last_reply()
        views = list(self.chat_log.query(MessageView))
        if views and views[-1].role == "user":
            last = None  # a message whose reply never started: start it now
        elif last is None or not views or views[-1] is not last:
            self.notify("nothing to regenerate yet")
            return
        with self._starting_reply():
            if last is not None:
                if last.message_id is not None:
                    self.history.post(self.history.store.delete_message, last.message_id)
                await self.chat_log.query(".chat-notice").remove()  # the old reply's notices go with it
                await last.remove()
            try:
                await self._start_reply()
            except HistoryError as exc:
                self.notify(f"{exc}; no reply started (ctrl+r tries again)", severity="error", timeout=15)

    async def action_new_chat(self) -> None:
        if self._refused_while_starting():
            return
        with self._starting_reply():
            await self._clear_chat()

    async def _clear_chat(self) -> None:
        if self.reply is not None:
            self.reply.leave()
        self.conversation_id = None
        await self.chat_log.remove_children()
        self.chat_log.show_hint(self.model_name)
        self.prompt.focus()

    def action_history(self) -> None:
        from kimitui.tui.screens.history import HistoryScreen  # dialogs load when first opened: start-up is on the clock

        engine = self.engine
        dialog = HistoryScreen(
            self.history, Path.cwd(),
            resumes=lambda conversation_id: engine.resumes(state_key(conversation_id)),
            forget=lambda conversation_id: engine.forget_state(state_key(conversation_id)),
        )
        self.app.push_screen(dialog, self._open_conversation)

    # -- the terminal going away (an SSH drop) ------------------------------------------

    def terminal_lost(self) -> None:
        """The terminal closed (SIGHUP): the reply streaming stops cleanly into the history (the
        engine saves the conversation's state as it ends), the next start reopens this chat, and
        the app exits."""
        if self.terminal_gone:
            return
        self.terminal_gone = True
        if self.conversation_id is not None:
            self.history.post(self.history.store.set_setting, DROPPED_KEY, str(self.conversation_id))
        if self.reply is None and not self._starting:
            self.app.exit()
            return
        if self.reply is not None:
            self.reply.leave()  # cancels its generation, or the generation as soon as it exists
        # (A reply still being started is left as soon as it exists: see _start_reply.)
        self.set_timer(DROP_GRACE_S, self.app.exit)

    async def reopen_dropped(self) -> None:
        """At start: reopen the chat a closed terminal left, once (its state resumes it)."""
        store = self.history.store
        try:
            dropped = await self._history("read the chat a closed terminal left", store.get_setting, DROPPED_KEY)
            if dropped is None:
                return
            await self._history("forget the chat a closed terminal left", store.set_setting, DROPPED_KEY, "")
        except HistoryError as exc:
            self.notify(str(exc), severity="error", timeout=15)
            return
        if not dropped.isdigit() or self.conversation_id is not None:
            return
        with self._starting_reply():
            await self._show_conversation(int(dropped))
        if self.conversation_id == int(dropped):
            self.notify("reopened the chat the closed terminal left", timeout=10)

    async def _open_conversation(self, conversation_id: int | None) -> None:
        if self._refused_while_starting():
            return
        with self._starting_reply():
            await self._show_conversation(conversation_id)

    async def _show_conversation(self, conversation_id: int | None) -> None:
        store = self.history.store
        try:
            if self.conversation_id is not None and await self._history("read the open conversation", store.get_conversation, self.conversation_id) is None:
                await self._clear_chat()  # the open conversation was deleted: its view goes too
            if conversation_id is None or await self._history("read the conversation", store.get_conversation, conversation_id) is None:
                return
            messages = await self._history("read the conversation's messages", store.messages, conversation_id)
        except HistoryError as exc:
            self.notify(str(exc), severity="error", timeout=15)
            return
        if self.reply is not None:
            self.reply.leave()  # it ends into its own conversation's history (see Reply)
        await self.chat_log.remove_children()
        self.conversation_id = conversation_id
        for msg in messages:
            note = "" if msg.complete else "interrupted"
            await self.chat_log.add(MessageView(msg.role, msg.content, message_id=msg.id, note=note))
        self.prompt.focus()

    def action_copy_reply(self) -> None:
        last = self.chat_log.last_reply()
        if last is None or not last.text:
            self.notify("no reply to copy yet")
            return
        # OSC 52: the terminal on the user's side of SSH receives it.
        self.app.copy_to_clipboard(last.text)
        self.notify(f"copied {len(last.text)} characters")

    def action_sampling(self) -> None:
        from kimitui.tui.screens.sampling import SamplingScreen

        def applied(result: tuple[Sampling, str] | None) -> None:
            if result is not None:
                self.sampling, self.system_prompt = result
                self.show_sampling()
                self.notify("sampling settings apply from the next reply")

        self.app.push_screen(SamplingScreen(self.sampling, self.system_prompt), applied)

    def action_toggle_trace(self) -> None:
        if self.trace is None:
            self.notify("tracing is off: start with --trace FILE or set enabled = true under [trace]")
            return
        self.trace_log.display = not self.trace_log.display

    def action_toggle_panel(self, key: int) -> None:
        panel = self.panels[str(key)]
        if isinstance(panel, ApiPanel) and self._api is None:
            return
        panel.display = not panel.display

    def action_maximize_panel(self) -> None:
        focused = self.focused
        key = focused.KEY if isinstance(focused, Panel) else LatencyPanel.KEY
        if self.maximized is not None:
            self.minimize()
        else:
            self.maximize_panel(key)

    def maximize_panel(self, key: str) -> None:
        panel = self.panels[key]
        panel.display = True
        self.maximize(panel, container=False)

    def action_pause(self) -> None:
        self.sampler.paused = not self.sampler.paused
        self.show_sampling()

    def action_faster(self) -> None:
        self.sampler.set_interval(self.sampler.interval / 2)
        self.show_sampling()

    def action_slower(self) -> None:
        self.sampler.set_interval(self.sampler.interval * 2)
        self.show_sampling()
