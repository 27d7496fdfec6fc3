"""One-line status bar: model, budget, engine state, sampling."""

from __future__ import annotations

from textual.reactive import reactive
from textual.widgets import Static

from kimitui.units import format_bytes


class StatusBar(Static):
    model_name = reactive("")
    model_bytes = reactive(0)
    budget = reactive(0)
    state = reactive("starting")
    detail = reactive("")
    sampling = reactive("")
    pinning = reactive("")

    def render(self) -> str:
        model = f"{self.model_name} ({format_bytes(self.model_bytes)})"
        budget = f"budget {format_bytes(self.budget) if self.budget else '—'}"
        state = self.state + (f" {self.detail}" if self.detail else "")
        if self.size.width < 100:
            # Narrow terminals (a phone over SSH): two lines, the state first.
            second = " │ ".join(part for part in (model, self.pinning) if part)
            if len(second) > self.size.width:  # the model stays in view; pinning detail is cut
                second = second[: max(1, self.size.width - 1)] + "…"
            return f"{state} │ {budget}\n{second}"
        return " │ ".join(part for part in (model, budget, state, self.pinning, self.sampling) if part)
