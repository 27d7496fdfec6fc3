"""Change sampling settings while chatting; checked with the same rules as the config file."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Input, Label

from kimitui.config import SCHEMA, coerce
from kimitui.tui.screens.form import FormScreen
from kimitui.engine.generation import Sampling

FIELDS = (
    ("temperature", "temperature", float),
    ("top_p", "top_p", float),
    ("max_tokens", "max_tokens", int),
    ("system_prompt", "system prompt", str),
)


class SamplingScreen(FormScreen[tuple[Sampling, str] | None]):
    def __init__(self, sampling: Sampling, system_prompt: str) -> None:
        super().__init__()
        self.sampling = sampling
        self.system_prompt = system_prompt

    def compose(self) -> ComposeResult:
        current = {
            "temperature": self.sampling.temperature,
            "top_p": self.sampling.top_p,
            "max_tokens": self.sampling.max_tokens,
            "system_prompt": self.system_prompt,
        }
        with Vertical(id="sampling-box"):
            yield Label("Sampling  [dim]applies from the next reply[/]")
            for key, label, _ in FIELDS:
                yield Label(label)
                yield Input(str(current[key]), id=f"field-{key}")
            yield Label("", id="sampling-error")
            yield from self.buttons()

    def apply(self) -> None:
        values = {}
        for key, _, kind in FIELDS:
            raw = self.query_one(f"#field-{key}", Input).value.strip()
            error = None
            try:
                parsed = raw if kind is str else kind(raw)
            except ValueError:
                error = f"expected {'an integer' if kind is int else 'a number'}, got {raw!r}"
            else:
                try:
                    values[key] = coerce(f"sampling.{key}", parsed, SCHEMA["sampling"][key])
                except ValueError as exc:
                    error = str(exc)
            if error:
                self.query_one("#sampling-error", Label).update(f"[b]{key}[/]: {error}")
                return
        sampling = Sampling(
            temperature=values["temperature"],
            top_p=values["top_p"],
            max_tokens=values["max_tokens"],
            top_k=self.sampling.top_k,
            min_p=self.sampling.min_p,
            repeat_penalty=self.sampling.repeat_penalty,
            seed=self.sampling.seed,
        )
        self.dismiss((sampling, values["system_prompt"]))
