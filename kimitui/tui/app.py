"""The kimitui Textual app: chat beside live engine panels.

Blocking work (loading, generating) runs in thread workers that post Messages back; the
event loop only renders, so typing stays responsive while a reply streams.
"""

from __future__ import annotations

import itertools
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from textual import on, work
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Footer

from kimitui.config import Settings, data_dir
from kimitui.engine.metrics import Sampler
from kimitui.engine.session import Engine, EngineError, Generation, GenerationResult, Sampling, engine_from_settings
from kimitui.history import HistoryStore
from kimitui.startup import start_up_finished
from kimitui.trace import open_trace
from kimitui.tui.messages import (
    LoadFailed,
    LoadFinished,
    LoadProgress,
    PinFinished,
    PinProgressed,
    ReplyFailed,
    ReplyFinished,
    SnapshotReady,
    TokenReceived,
)
from kimitui.tui.themes import DEFAULT_THEME, bundled_themes
from kimitui.tui.widgets.chat import ChatLog, MessageView, PromptInput
from kimitui.tui.widgets.trace_log import TokenBreakdown, TraceLog
from kimitui.tui.widgets.panels import PANEL_TYPES, ApiPanel, Panel
from kimitui.tui.widgets.status import StatusBar
from kimitui.units import format_bytes

PERSIST_EVERY_S = 1.0  # how often a streaming reply is written to the history database


@dataclass
class Reply:
    """A reply in flight: its widget, its database row and the engine's generation."""

    id: int
    view: MessageView
    message_id: int
    generation: Generation | None = None
    last_saved: float = field(default_factory=time.monotonic)


class KimituiApp(App[int]):
    CSS_PATH = "app.tcss"
    TITLE = "kimitui"
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (100, "-wide")]

    BINDINGS = [
        Binding("escape", "cancel_or_leave", "cancel", priority=True),
        # Priority: the prompt box would otherwise swallow these (ctrl+y is its redo).
        Binding("ctrl+r", "regenerate", "regenerate", priority=True),
        Binding("ctrl+n", "new_chat", "new chat", priority=True),
        Binding("ctrl+o", "history", "history", priority=True),
        Binding("ctrl+y", "copy_reply", "copy reply", priority=True),
        Binding("ctrl+t", "sampling", "sampling", priority=True),
        Binding("ctrl+e", "tuning", "engine", priority=True),
        Binding("1", "toggle_panel(1)", "cache", group=Binding.Group("panels", compact=True)),
        Binding("2", "toggle_panel(2)", "prefetch", group=Binding.Group("panels", compact=True)),
        Binding("3", "toggle_panel(3)", "SSD", group=Binding.Group("panels", compact=True)),
        Binding("4", "toggle_panel(4)", "memory", group=Binding.Group("panels", compact=True)),
        Binding("5", "toggle_panel(5)", "latency", group=Binding.Group("panels", compact=True)),
        Binding("6", "toggle_panel(6)", "API", group=Binding.Group("panels", compact=True)),
        Binding("7", "toggle_panel(7)", "residency", group=Binding.Group("panels", compact=True)),
        Binding("8", "toggle_panel(8)", "experts", group=Binding.Group("panels", compact=True)),
        Binding("9", "toggle_trace", "trace", group=Binding.Group("panels", compact=True)),
        Binding("z", "maximize_panel", "maximise"),
        Binding("p", "pause", "pause"),
        Binding("plus,equals_sign", "faster", "faster", group=Binding.Group("refresh", compact=True)),
        Binding("minus", "slower", "slower", group=Binding.Group("refresh", compact=True)),
    ]

    def __init__(
        self,
        settings: Settings,
        model_path: Path | None,
        *,
        remote: tuple[str, str | None] | None = None,
        engine: Engine | None = None,
        api_socket: socket.socket | None = None,
        api_key: str | None = None,
    ) -> None:
        """``model_path`` runs the engine in-process; ``remote`` = (url, api key) chats with a server.

        ``engine``, built from the same settings, may already be loading (``start_loading``).
        ``api_socket``, already listening, serves the HTTP API from this process's engine,
        requiring ``api_key`` when given (flag or environment; else the configured one).
        """
        super().__init__()
        self.settings = settings
        if remote is not None:
            from kimitui.server.client import RemoteEngine, RemoteSampler

            url, key = remote
            self.engine = RemoteEngine(url, api_key=key)
            self.metrics = self.engine.metrics
            self.sampler: Sampler = RemoteSampler(self.engine, interval=max(1.0, settings["metrics.interval"]))
            self.trace = None
        else:
            self.engine = engine or engine_from_settings(settings, model_path)
            self.metrics = self.engine.metrics
            self.sampler = Sampler(self.metrics, interval=settings["metrics.interval"], model_path=model_path)
            self.trace = open_trace(settings, list(self.engine.inspect().files))
            if self.trace is not None:
                self.trace.attach(self.engine)
        self.api_socket = api_socket
        self.api_key = api_key
        self.api_server = None
        self._trace_error_shown = False
        self.sampling = Sampling(
            temperature=settings["sampling.temperature"],
            top_p=settings["sampling.top_p"],
            max_tokens=settings["sampling.max_tokens"],
            seed=None if settings["sampling.seed"] == -1 else settings["sampling.seed"],
        )
        self.system_prompt: str = settings["sampling.system_prompt"]
        self.store = HistoryStore(data_dir() / "history.sqlite3")
        self.conversation_id: int | None = None
        self.ready = False
        self.reply: Reply | None = None
        self._reply_ids = itertools.count(1)

    # -- layout --------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield StatusBar(id="status")
        with Horizontal(id="main"):
            with Vertical(id="chat-pane"):
                yield ChatLog(id="chat-log")
                yield TraceLog(id="trace-log")
                yield PromptInput(id="prompt")
            with Vertical(id="panels"):
                for panel_type in PANEL_TYPES:
                    yield panel_type(id=f"panel-{panel_type.KEY}")
        yield Footer()

    def on_mount(self) -> None:
        for theme in bundled_themes():
            self.register_theme(theme)
        self.theme = self.settings["ui.theme"] or self.store.get_setting("theme") or DEFAULT_THEME
        self.theme_changed_signal.subscribe(self, lambda theme: self.store.set_setting("theme", theme.name))
        status = self.query_one(StatusBar)
        if isinstance(self.engine, Engine):
            info = self.engine.inspect()
            status.model_name, status.model_bytes = info.name, info.file_bytes
        else:
            status.model_name = f"remote {self.engine.url}"
        status.budget = self.metrics.budget_bytes or 0
        status.state = "loading"
        trace_log = self.query_one(TraceLog)
        # On a phone-sized terminal the chat needs the room: the pane starts hidden (key 9 shows it).
        trace_log.display = self.trace is not None and self.size.width >= 100
        if self.trace is not None:
            bar = TokenBreakdown(id="token-breakdown")
            self.query_one("#panel-5", Panel).mount(bar)  # the last token's split, under the latency sparkline
            # feed() only queues; the widgets drain on a UI timer, so read threads never wait for the UI.
            self.trace.subscribe(trace_log.feed)
            self.trace.subscribe(bar.feed)
        api_panel = self.query_one(ApiPanel)
        api_panel.display = self.api_socket is not None
        if self.api_socket is not None:
            self._start_api(api_panel)
        self._show_sampling()
        self.sampler.subscribe(lambda snap: self.post_message(SnapshotReady(snap)))
        self.sampler.start()
        self.query_one(PromptInput).focus()
        self.load_model()
        start_up_finished()  # the imports are done and the load runs in C: the collector may run again

    def _start_api(self, panel: ApiPanel) -> None:
        from kimitui.server.app import create_app
        from kimitui.server.runner import ServerThread

        def on_request(record: dict) -> None:  # runs on the server's event-loop thread
            self.call_from_thread(panel.add_request, record)

        app = create_app(
            self.engine, self.settings, api_key=self.api_key, on_request=on_request, bind_host=self.api_socket.getsockname()[0]
        )
        self.api_server = ServerThread(app, self.api_socket, quiet=True).start()
        panel.url = f"serving {self.api_server.url}"
        panel.show_requests()

    def on_unmount(self) -> None:
        if self.reply is not None and self.reply.generation is not None:
            self.reply.generation.cancel()
        self.engine.abort_load()
        self.sampler.stop()
        if self.trace is not None:
            self.trace.close()
        if self.api_server is not None:
            self.api_server.stop()

    def _show_sampling(self) -> None:
        s = self.sampling
        paused = " paused" if self.sampler.paused else ""
        self.query_one(StatusBar).sampling = (
            f"T {s.temperature:g} · top_p {s.top_p:g} · max {s.max_tokens} · every {self.sampler.interval:g}s{paused}"
        )

    # -- loading -------------------------------------------------------------------------

    @work(thread=True, group="load", exit_on_error=False)
    def load_model(self) -> None:
        last = [0.0]

        def progress(fraction: float) -> None:
            # llama.cpp calls back per tensor; a repaint per whole percent is plenty.
            if fraction - last[0] >= 0.01 or fraction >= 1.0:
                last[0] = fraction
                self.post_message(LoadProgress(fraction))

        try:
            self.engine.load(progress)
        except EngineError as exc:
            self.post_message(LoadFailed(str(exc)))
            return
        except Exception as exc:  # a bug or a broken install: shown, and the app stays up
            self.post_message(LoadFailed(f"loading failed: {type(exc).__name__}: {exc}"))
            return
        # The engine's own figure: the load may have started before this worker (start_loading).
        self.post_message(LoadFinished(self.engine.load_s or 0.0))

    def on_load_progress(self, message: LoadProgress) -> None:
        if not self.query(StatusBar):
            return
        self.query_one(StatusBar).detail = f"{message.fraction:.0%}"

    def on_load_finished(self, message: LoadFinished) -> None:
        if not self.query(StatusBar):  # a late message while the app shuts down
            return
        status = self.query_one(StatusBar)
        status.state, status.detail = "idle", f"(loaded in {message.seconds:.1f}s)"
        if not isinstance(self.engine, Engine):
            if self.engine.info is not None:
                status.model_name = f"{self.engine.info.name} @ {self.engine.url}"
                status.model_bytes = self.engine.info.file_bytes
            self.ready = True
        else:
            if self.engine.fast_load_note:
                self.notify(self.engine.fast_load_note, severity="warning", timeout=15)
            if self.engine.fit_note:
                self.notify(self.engine.fit_note, severity="warning", timeout=15)
            if self.engine.template_error:
                self.notify(self.engine.template_error, severity="warning", timeout=15)
            self.pin_model()

    @work(thread=True, group="pin", exit_on_error=False)
    def pin_model(self) -> None:
        last = [0.0]

        def progress(p) -> None:
            now = time.monotonic()
            if now - last[0] >= 0.1 or p.finished:
                last[0] = now
                self.post_message(PinProgressed(p))

        try:
            self.engine.pin(progress)
        except EngineError as exc:
            self.post_message(PinFinished(0, str(exc)))
            return
        self.post_message(PinFinished(self.engine.pinned_bytes, self.engine.pin_note))

    def on_pin_progressed(self, message: PinProgressed) -> None:
        if not self.query(StatusBar):  # a late message while the app shuts down
            return
        p = message.progress
        # A re-pin from live tuning ends without a PinFinished: its last progress says it all.
        status = self.query_one(StatusBar)
        status.pinning = "" if p.finished else p.describe()
        if p.finished:
            status.pinned = f"pinned {format_bytes(p.total_bytes)}"

    def on_pin_finished(self, message: PinFinished) -> None:
        if not self.query(StatusBar):
            return
        self.ready = True  # the pinned set and the streamer are complete (the engine's turn holds replies till then)
        whole = message.pinned_bytes >= self.engine.inspect().tensor_bytes
        Panel.idle_note = (
            "model fits in memory: nothing streams" if whole
            # Honest about this build: beyond the pinned set, llama.cpp faults pages in itself.
            else "no streaming engine yet: the kernel pages in the unpinned part"
        )
        locked = "" if message.note is None else " (not locked)"
        status = self.query_one(StatusBar)
        status.pinning = ""
        status.pinned = f"pinned {format_bytes(message.pinned_bytes)}{locked}" if message.pinned_bytes else ""
        if message.note:
            self.notify(message.note, severity="warning", timeout=15)

    def on_load_failed(self, message: LoadFailed) -> None:
        if not self.query(StatusBar):  # a late message while the app shuts down
            return
        status = self.query_one(StatusBar)
        status.state, status.detail = "failed", ""
        self.notify(message.error, severity="error", timeout=30)

    # -- metrics -------------------------------------------------------------------------

    def on_snapshot_ready(self, message: SnapshotReady) -> None:
        for panel in self.query(Panel):
            if panel.display:
                panel.render_snapshot(message.snapshot)

    # -- chat ----------------------------------------------------------------------------

    @on(PromptInput.Submitted)
    async def send(self, event: PromptInput.Submitted) -> None:
        if not self.ready:
            self.notify("the model is still loading; your message stays in the box", severity="warning")
            return
        if self.reply is not None:
            self.notify("a reply is streaming; Esc cancels it", severity="warning")
            return
        prompt = self.query_one(PromptInput)
        prompt.clear()
        if self.conversation_id is None:
            self.conversation_id = self.store.create_conversation(event.text.splitlines()[0], self.query_one(StatusBar).model_name)
        message_id = self.store.add_message(self.conversation_id, "user", event.text)
        await self.query_one(ChatLog).add(MessageView("user", event.text, message_id=message_id))
        await self._start_reply()

    def _history_messages(self) -> list[dict]:
        msgs = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        for view in self.query_one(ChatLog).query(MessageView):
            if view.text:
                msgs.append({"role": view.role, "content": view.text})
        return msgs

    async def _start_reply(self) -> None:
        messages = self._history_messages()
        view = MessageView("assistant", "")
        await self.query_one(ChatLog).add(view)
        message_id = self.store.add_message(self.conversation_id, "assistant", "", complete=False)
        view.message_id = message_id
        self.reply = Reply(next(self._reply_ids), view, message_id)
        status = self.query_one(StatusBar)
        status.state, status.detail = "generating", ""
        self.generate(self.reply, messages, Sampling(**vars(self.sampling)))

    @work(thread=True, group="generate", exit_on_error=False)
    def generate(self, reply: Reply, messages: list[dict], sampling: Sampling) -> None:
        generation = self.engine.chat(messages, sampling)
        reply.generation = generation
        try:
            for event in generation:
                self.post_message(TokenReceived(reply.id, event))
        except EngineError as exc:
            self.post_message(ReplyFailed(reply.id, str(exc), generation.result))
            return
        except Exception as exc:  # a bug: this reply ends with it, the chat carries on
            self.post_message(ReplyFailed(reply.id, f"reply failed: {type(exc).__name__}: {exc}", generation.result))
            return
        self.post_message(ReplyFinished(reply.id, generation.result))

    async def on_token_received(self, message: TokenReceived) -> None:
        if not self.query(StatusBar):  # a late message while the app shuts down
            return
        reply = self.reply
        if reply is None or reply.id != message.reply_id:
            return
        await reply.view.add_fragment(message.event.text)
        self.query_one(StatusBar).detail = f"{message.event.index + 1} tok"
        if time.monotonic() - reply.last_saved >= PERSIST_EVERY_S:
            self.store.update_message(reply.message_id, reply.view.text, complete=False)
            reply.last_saved = time.monotonic()

    async def on_reply_finished(self, message: ReplyFinished) -> None:
        await self._end_reply(message.reply_id, message.result, None)

    async def on_reply_failed(self, message: ReplyFailed) -> None:
        await self._end_reply(message.reply_id, message.result, message.error)

    async def _end_reply(self, reply_id: int, result: GenerationResult, error: str | None) -> None:
        if not self.query(StatusBar):  # a late message while the app shuts down
            return
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
        # Saved before the view is finished: the app may be closing while it awaits.
        self.store.update_message(reply.message_id, reply.view.text, complete=error is None, stats=stats)
        if self.trace is not None and self.trace.error and not self._trace_error_shown:
            self._trace_error_shown = True
            self.notify(f"trace stopped: {self.trace.error}", severity="warning", timeout=15)
        status = self.query_one(StatusBar)
        status.state, status.detail = "idle", ""
        await reply.view.finish(note)

    # -- actions -------------------------------------------------------------------------

    CHAT_ACTIONS = {"cancel_or_leave", "regenerate", "new_chat", "history", "copy_reply", "sampling", "tuning"}

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        # App bindings are global; over a dialog, Esc and the chat keys belong to the dialog.
        if action in self.CHAT_ACTIONS and len(self.screen_stack) > 1:
            return False
        return True

    def action_cancel_or_leave(self) -> None:
        if self.screen.maximized is not None:
            self.screen.minimize()
        elif self.reply is not None and self.reply.generation is not None:
            self.reply.generation.cancel()
            self.query_one(StatusBar).state = "cancelling"
        elif isinstance(self.focused, PromptInput):
            # Leave the prompt so the panel keys (1-5, p, +, -, z) reach the app.
            self.query_one("#panel-5", Panel).focus()
        else:
            self.query_one(PromptInput).focus()

    async def action_regenerate(self) -> None:
        if not self.ready or self.reply is not None:
            return
        last = self.query_one(ChatLog).last_reply()
        views = list(self.query_one(ChatLog).query(MessageView))
        if last is None or not views or views[-1] is not last:
            self.notify("nothing to regenerate yet")
            return
        if last.message_id is not None:
            self.store.delete_message(last.message_id)
        await last.remove()
        await self._start_reply()

    async def action_new_chat(self) -> None:
        if self.reply is not None and self.reply.generation is not None:
            self.reply.generation.cancel()
        self.conversation_id = None
        await self.query_one(ChatLog).remove_children()
        self.query_one(PromptInput).focus()

    def action_history(self) -> None:
        from kimitui.tui.screens.history import HistoryScreen  # dialogs load when first opened: start-up is on the clock

        self.push_screen(HistoryScreen(self.store, Path.cwd()), self._open_conversation)

    async def _open_conversation(self, conversation_id: int | None) -> None:
        if self.conversation_id is not None and self.store.get_conversation(self.conversation_id) is None:
            await self.action_new_chat()  # the open conversation was deleted: its view goes too
        if conversation_id is None or self.store.get_conversation(conversation_id) is None:
            return
        if self.reply is not None and self.reply.generation is not None:
            self.reply.generation.cancel()
        self.reply = None
        log = self.query_one(ChatLog)
        await log.remove_children()
        self.conversation_id = conversation_id
        for msg in self.store.messages(conversation_id):
            note = "" if msg.complete else "interrupted"
            await log.add(MessageView(msg.role, msg.content, message_id=msg.id, note=note))
        self.query_one(PromptInput).focus()

    def action_copy_reply(self) -> None:
        last = self.query_one(ChatLog).last_reply()
        if last is None or not last.text:
            self.notify("no reply to copy yet")
            return
        # OSC 52: the terminal on the user's side of SSH receives it.
        self.copy_to_clipboard(last.text)
        self.notify(f"copied {len(last.text)} characters")

    def action_sampling(self) -> None:
        from kimitui.tui.screens.sampling import SamplingScreen

        def applied(result: tuple[Sampling, str] | None) -> None:
            if result is not None:
                self.sampling, self.system_prompt = result
                self._show_sampling()
                self.notify("sampling settings apply from the next reply")

        self.push_screen(SamplingScreen(self.sampling, self.system_prompt), applied)

    def action_tuning(self) -> None:
        from kimitui.tui.screens.tuning import TuningScreen

        engine = self.engine
        if not isinstance(engine, Engine):
            self.notify("remote mode: the server's engine is tuned on the server")
            return

        def applied(changes: dict | None) -> None:
            if changes:
                try:
                    when = engine.retune(**changes)
                except EngineError as exc:
                    self.notify(f"not applied: {exc}", severity="error", timeout=10)
                    return
                self.query_one(StatusBar).budget = engine.budget or 0
                self.notify(f"{', '.join(changes)}: {when}")

        settings = engine.stream_settings
        self.push_screen(
            TuningScreen(engine.budget or 0, settings.prefetch_depth, engine.shard_size, settings.policy), applied
        )

    def action_toggle_trace(self) -> None:
        if self.trace is None:
            self.notify("tracing is off: start with --trace FILE or set enabled = true under [trace]")
            return
        log = self.query_one(TraceLog)
        log.display = not log.display

    def action_toggle_panel(self, key: int) -> None:
        panel = self.query_one(f"#panel-{key}", Panel)
        if isinstance(panel, ApiPanel) and self.api_socket is None:
            return
        panel.display = not panel.display

    def action_maximize_panel(self) -> None:
        focused = self.focused
        key = int(focused.id.removeprefix("panel-")) if isinstance(focused, Panel) and focused.id else 5
        if self.screen.maximized is not None:
            self.screen.minimize()
        else:
            self._maximize(key)

    def action_pause(self) -> None:
        self.sampler.paused = not self.sampler.paused
        self._show_sampling()

    def action_faster(self) -> None:
        self.sampler.set_interval(self.sampler.interval / 2)
        self._show_sampling()

    def action_slower(self) -> None:
        self.sampler.set_interval(self.sampler.interval * 2)
        self._show_sampling()

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        yield SystemCommand("New chat", "Start a new conversation", self.action_new_chat)
        yield SystemCommand("History", "Open, delete or export saved conversations", self.action_history)
        yield SystemCommand("Regenerate", "Replace the last reply with a new one", self.action_regenerate)
        yield SystemCommand("Cancel reply", "Stop the reply that is streaming", self.action_cancel_or_leave)
        yield SystemCommand("Copy reply", "Copy the last reply to the clipboard (OSC 52)", self.action_copy_reply)
        yield SystemCommand("Sampling settings", "Temperature, top_p, max tokens, system prompt", self.action_sampling)
        yield SystemCommand("Engine tuning", "Budget, prefetch depth, shard size, policy", self.action_tuning)
        yield SystemCommand("Pause sampling", "Freeze or resume the live panels", self.action_pause)
        yield SystemCommand("Refresh faster", "Halve the sampling interval", self.action_faster)
        yield SystemCommand("Refresh slower", "Double the sampling interval", self.action_slower)
        yield SystemCommand("Toggle trace pane", "Show or hide the live per-token trace and its filter (key 9)", self.action_toggle_trace)
        for panel_type in PANEL_TYPES:
            key = int(panel_type.KEY)
            yield SystemCommand(
                f"Toggle panel: {panel_type.TITLE}", f"Show or hide the {panel_type.TITLE} panel (key {key})",
                lambda key=key: self.action_toggle_panel(key),
            )
            yield SystemCommand(
                f"Maximise panel: {panel_type.TITLE}", "Fill the screen with it (Esc restores)",
                lambda key=key: self._maximize(key),
            )

    def _maximize(self, key: int) -> None:
        panel = self.query_one(f"#panel-{key}", Panel)
        panel.display = True
        self.screen.maximize(panel, container=False)

