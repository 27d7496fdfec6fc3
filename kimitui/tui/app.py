"""The kimitui Textual app: themes, the command palette and the main screen.

The app is handed what it shows (an engine, local or remote, its metrics sampler, the history
store, a trace and the HTTP API where asked for); ``kimitui.cli`` builds them. The main
screen owns the chat, the panels and their keys.
"""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Callable, Iterable

from textual.app import App, SystemCommand
from textual.screen import Screen

from kimitui.config import Settings
from kimitui.engine.interface import ChatEngine
from kimitui.engine.metrics import Sampler
from kimitui.engine.generation import Sampling
from kimitui.history import HistoryStore
from kimitui.startup import start_up_finished
from kimitui.tui.history_writer import HistoryWriter
from kimitui.tui.messages import HistoryFailed
from kimitui.tui.screens.main import MainScreen
from kimitui.tui.themes import DEFAULT_THEME, bundled_themes
from kimitui.tui.widgets.panels import PANEL_TYPES


class KimituiApp(App[int]):
    CSS_PATH = "app.tcss"
    TITLE = "kimitui"
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (100, "-wide")]
    DEFAULT_MODE = "main"

    def __init__(
        self,
        settings: Settings,
        engine: ChatEngine,
        sampler: Sampler,
        store: HistoryStore,
        *,
        trace=None,
        api: Callable[[Callable[[dict], None]], str] | None = None,
        on_exit: Callable[[], None] | None = None,
    ) -> None:
        """``api`` starts the HTTP API from ``engine`` (see MainScreen); ``on_exit`` stops what
        the builder started beside the app (the API server, the trace)."""
        super().__init__()
        self.settings = settings
        self.engine = engine
        self.store = store
        # Posted, not called: the writer's thread must never wait on the event loop (at exit the
        # loop waits for that thread).
        self.history = HistoryWriter(store, lambda exc: self.post_message(HistoryFailed(str(exc))))
        sampling = Sampling(
            temperature=settings["sampling.temperature"],
            top_p=settings["sampling.top_p"],
            max_tokens=settings["sampling.max_tokens"],
            seed=None if settings["sampling.seed"] == -1 else settings["sampling.seed"],
        )
        self.main = MainScreen(engine, sampler, self.history, sampling, settings["sampling.system_prompt"], trace=trace, api=api)
        # The main screen is the app's one mode: a mode's screen brings its own CSS (main.tcss).
        self.add_mode("main", lambda: self.main)
        self._on_exit = on_exit
        self._hangup_watched = False
        self._hangup_before = None  # the process's SIGHUP handler before the app's

    def on_mount(self) -> None:
        for theme in bundled_themes():
            self.register_theme(theme)
        self.theme = self.settings["ui.theme"] or self.store.get_setting("theme") or DEFAULT_THEME
        self.theme_changed_signal.subscribe(self, lambda theme: self.history.post(self.store.set_setting, "theme", theme.name))
        start_up_finished()  # the imports are done and the load runs in C: the collector may run again
        try:
            # A program that runs the app may have its own handler: it is put back on unmount.
            self._hangup_before = signal.getsignal(signal.SIGHUP)
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self._terminal_closed)
            self._hangup_watched = True
        except (NotImplementedError, RuntimeError, ValueError):  # no SIGHUP here, or not the main thread (tests)
            pass

    def _terminal_closed(self) -> None:
        """SIGHUP, the way an SSH drop reaches the app: what is drawn from now on goes nowhere
        (writes to a closed terminal would fail), and the main screen ends the reply cleanly."""
        try:
            devnull = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(devnull, fd)
            os.close(devnull)
        except OSError:
            pass
        self.main.terminal_lost()

    def on_unmount(self) -> None:
        try:
            if self._hangup_watched:  # the loop may outlive the app (an app run inside another program)
                self._hangup_watched = False
                asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
                if self._hangup_before is not None:  # None: one not set from Python, left as the loop leaves it
                    signal.signal(signal.SIGHUP, self._hangup_before)
        finally:
            self.history.close()
            if self._on_exit is not None:
                self._on_exit()

    def on_history_failed(self, message: HistoryFailed) -> None:
        self.notify(f"could not save the chat history: {message.error}", severity="error", timeout=15)

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        main = self.main
        yield SystemCommand("New chat", "Start a new conversation", main.action_new_chat)
        yield SystemCommand("History", "Open, delete or export saved conversations", main.action_history)
        yield SystemCommand("Regenerate", "Replace the last reply with a new one", main.action_regenerate)
        yield SystemCommand("Cancel reply", "Stop the reply that is streaming", main.action_cancel_or_leave)
        yield SystemCommand("Copy reply", "Copy the last reply to the clipboard (OSC 52)", main.action_copy_reply)
        yield SystemCommand("Sampling settings", "Temperature, top_p, max tokens, system prompt", main.action_sampling)
        yield SystemCommand("Engine tuning", "Budget, prefetch, shard size, policies, I/O threads, look-ahead: beside the panels", main.action_tuning)
        yield SystemCommand("Pause sampling", "Freeze or resume the live panels", main.action_pause)
        yield SystemCommand("Refresh faster", "Halve the sampling interval", main.action_faster)
        yield SystemCommand("Refresh slower", "Double the sampling interval", main.action_slower)
        yield SystemCommand("Toggle trace pane", "Show or hide the live per-token trace and its filter (key 9)", main.action_toggle_trace)
        for panel_type in PANEL_TYPES:
            key = panel_type.KEY
            yield SystemCommand(
                f"Toggle panel: {panel_type.TITLE}", f"Show or hide the {panel_type.TITLE} panel (key {key})",
                lambda key=key: main.action_toggle_panel(int(key)),
            )
            yield SystemCommand(
                f"Maximise panel: {panel_type.TITLE}", "Fill the screen with it (Esc restores)",
                lambda key=key: main.maximize_panel(key),
            )
