"""What the main screen shows, as SVG snapshots (pytest-textual-snapshot), at a desktop's 120x40
and a phone's 50x30: idle, a reply streaming with the panels fed, the tuning strip open with a
change pending, an error shown. On the fake engine and fixed metrics, so every run draws the
same screen. `pytest tests/test_snapshots.py --snapshot-update` rewrites them after a change
that is meant; look at the report of a failing run first."""

from __future__ import annotations

import threading

import pytest

from fakes import FakeEngine, fake_app
from kimitui.tui.widgets.chat import MessageView, PromptInput

SIZES = {"desktop": (120, 40), "phone": (50, 30)}


async def _ready(pilot) -> None:
    app = pilot.app
    app.main.prompt.cursor_blink = False
    while not app.main.ready:
        await pilot.pause(0.02)


async def _type_and_send(pilot, text: str) -> None:
    pilot.app.query_one(PromptInput).focus()
    await pilot.press(*text, "enter")


def idle():
    async def run_before(pilot) -> None:
        await _ready(pilot)

    return fake_app(), run_before


def streaming():
    engine = FakeEngine()
    engine.gate = threading.Event()  # the reply stops half-way until the app closes

    async def run_before(pilot) -> None:
        await _ready(pilot)
        await _type_and_send(pilot, "What is LatentMoE?")
        main = pilot.app.main
        while main.reply is None or len(main.reply.view.text.split()) < len(engine.reply_words) // 2:
            await pilot.pause(0.02)
        main.sampler.play()
        await pilot.pause(0.1)

    return fake_app(engine), run_before


def tuning():
    async def run_before(pilot) -> None:
        await _ready(pilot)
        pilot.app.main.sampler.play(4)
        await pilot.press("ctrl+e", "down", "right")  # prefetch 2 -> 3, not applied yet
        await pilot.pause(0.1)

    return fake_app(), run_before


def error():
    engine = FakeEngine(fail_reply="model file k3-cut.gguf ended at byte 8388608; expert 12 of layer 3 needs bytes up to 9437184 (file truncated or drive removed?)")

    async def run_before(pilot) -> None:
        await _ready(pilot)
        await _type_and_send(pilot, "Hi")
        main = pilot.app.main
        while main.reply is not None or not pilot.app.query(MessageView) or not pilot.app.query(MessageView).last().border_subtitle:
            await pilot.pause(0.02)
        await pilot.pause(0.1)

    return fake_app(engine), run_before


@pytest.mark.parametrize("size", SIZES, ids=list(SIZES))
@pytest.mark.parametrize("state", [idle, streaming, tuning, error], ids=lambda f: f.__name__)
def test_main_screen(snap_compare, state, size):
    app, run_before = state()
    assert snap_compare(app, terminal_size=SIZES[size], run_before=run_before)
