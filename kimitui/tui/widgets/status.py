"""One-line status bar: model, budget, engine state, sampling."""

from __future__ import annotations

from typing import Callable

from textual.reactive import reactive
from textual.widgets import Static

from kimitui.units import format_bytes


class StatusBar(Static):
    """Fed by its screen (``data_bind``) but for the budget, which it reads from the engine as
    it draws: the engine's is the one figure, whatever changed it."""

    model_name = reactive("")
    model_bytes = reactive(0)
    state = reactive("starting")
    detail = reactive("")
    sampling = reactive("")
    pinning = reactive("")  # progress while the pinned set is read
    pinned = reactive("")  # what was pinned, once it was
    lossy = reactive("")  # a setting on that changes what the model computes (expert trimming)

    def __init__(self, budget: Callable[[], int | None], **kwargs) -> None:
        super().__init__(**kwargs)
        self.budget = budget

    def render(self) -> str:
        model = f"{self.model_name} ({format_bytes(self.model_bytes)})"
        budget_bytes = self.budget()
        budget = f"budget {format_bytes(budget_bytes) if budget_bytes else '—'}"
        state = self.state + (f" {self.detail}" if self.detail else "")
        if self.size.width < 100:
            # Narrow terminals (a phone over SSH): two lines, the state first.
            # While the pinned set is read its progress is the news; after that the model is,
            # with the pinned size beside it when the line has room.
            second = self.pinning or model
            if not self.pinning and self.pinned and len(f"{model} │ {self.pinned}") <= self.size.width:
                second = f"{model} │ {self.pinned}"
            first = f"{state} │ {budget}" + (f" │ {self.lossy}" if self.lossy else "")
            return f"{first}\n{second}"
        return " │ ".join(part for part in (model, budget, state, self.lossy, self.pinning or self.pinned, self.sampling) if part)
