"""Tune the streaming engine while chatting: budget, prefetch depth, shard size, policy."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Input, Label, Select

from kimitui.config import SCHEMA, coerce
from kimitui.tui.screens.form import FormScreen
from kimitui.engine.streaming import POLICIES
from kimitui.units import format_bytes


class TuningScreen(FormScreen[dict | None]):
    """Dismisses with the changed values ({"budget": bytes, ...}) or None."""

    def __init__(self, budget: int, prefetch_depth: int, shard_size: int, policy: str) -> None:
        super().__init__()
        self.current = {"budget": budget, "prefetch_depth": prefetch_depth, "shard_size": shard_size, "policy": policy}

    def compose(self) -> ComposeResult:
        with Vertical(id="tuning-box"):
            yield Label("Engine  [dim]applies from the next token · budget and shard size re-read the pinned set first[/]")
            yield Label("budget")
            yield Input(format_bytes(self.current["budget"]).replace(" ", ""), id="tune-budget")
            yield Label("prefetch depth (layers ahead)")
            yield Input(str(self.current["prefetch_depth"]), id="tune-prefetch_depth")
            yield Label("shard size")
            yield Input(format_bytes(self.current["shard_size"]).replace(" ", ""), id="tune-shard_size")
            yield Label("policy")
            yield Select([(p, p) for p in POLICIES], value=self.current["policy"], allow_blank=False, id="tune-policy")
            yield Label("", id="tuning-error")
            yield from self.buttons()

    def apply(self) -> None:
        values: dict = {}
        for key in ("budget", "prefetch_depth", "shard_size"):
            raw = self.query_one(f"#tune-{key}", Input).value.strip()
            spec = SCHEMA["engine"][key]
            try:
                if spec.kind == "int" and not raw.isdigit():
                    raise ValueError(f"expected a whole number, got {raw!r}")
                values[key] = coerce(f"engine.{key}", int(raw) if spec.kind == "int" else raw, spec)
            except ValueError as exc:
                self.query_one("#tuning-error", Label).update(f"[b]{key}[/]: {exc}")
                return
            if values[key] == "auto":
                self.query_one("#tuning-error", Label).update("[b]budget[/]: give a size, e.g. 6GiB")
                return
        values["policy"] = self.query_one("#tune-policy", Select).value
        self.dismiss({k: v for k, v in values.items() if v != self.current[k]})
