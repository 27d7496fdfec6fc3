"""A dialog of fields with Apply/Cancel: Enter in a field or Apply checks and applies, Esc cancels."""

from __future__ import annotations

from typing import TypeVar

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.screen import ModalScreen
from textual.widgets import Button

Result = TypeVar("Result")


class FormScreen(ModalScreen[Result]):
    BINDINGS = [Binding("escape", "dismiss(None)", "cancel")]

    def buttons(self) -> ComposeResult:
        with Horizontal():
            yield Button("Apply", variant="primary", id="apply")
            yield Button("Cancel", id="cancel")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "cancel":
            self.dismiss(None)
        else:
            self.apply()

    def on_input_submitted(self) -> None:
        self.apply()

    def apply(self) -> None:
        """Check the fields; show what is wrong, or dismiss with the result."""
        raise NotImplementedError
