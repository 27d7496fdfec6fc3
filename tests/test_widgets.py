"""The app's screen and widgets on a fake engine and replayed metrics: fast, and the same on
every run (the real engine behind the same screen is test_tui.py's)."""

from __future__ import annotations

import threading

import pytest
from rich.cells import cell_len
from textual.widgets import Sparkline

from fakes import FakeEngine, fake_app, recorded_snapshots
from kimitui.tui.widgets.chat import MessageView, PromptInput
from kimitui.tui.widgets.panels import CachePanel, DiskPanel, LatencyPanel, Panel, PanelColumn, PrefetchPanel, ResidencyPanel
from kimitui.tui.widgets.status import StatusBar
from kimitui.tui.widgets.tuning import TuningPanel, Window

MIB = 2**20


async def settle(pilot, condition, timeout: float = 10.0) -> None:
    waited = 0.0
    while not condition():
        await pilot.pause(0.02)
        waited += 0.02
        assert waited < timeout, "condition not reached in time"


async def send(pilot, app, text: str) -> MessageView:
    await settle(pilot, lambda: app.main.ready)
    app.query_one(PromptInput).focus()
    await pilot.press(*text, "enter")
    await settle(pilot, lambda: app.main.reply is None and app.query(MessageView) and app.query(MessageView).last().border_subtitle)
    return app.query(MessageView).last()


async def test_an_empty_chat_says_what_to_do_and_which_model_answers():
    app = fake_app()
    async with app.run_test(size=(50, 30)) as pilot:
        await settle(pilot, lambda: app.main.ready)
        hint = str(app.query_one(".chat-hint").render())
        assert "k3-cut.gguf" in hint and "Enter sends" in hint and "ctrl+e" in hint
        reply = await send(pilot, app, "Hi")
        assert not app.query(".chat-hint")
        assert reply.text.startswith("Hello! I am a fake Kimi") and "tok" in str(reply.border_subtitle)
        await pilot.press("ctrl+n")
        await pilot.pause()
        assert app.query(".chat-hint")


async def test_panels_are_fed_through_their_bindings_and_no_figure_wraps_at_50_columns():
    app = fake_app()
    async with app.run_test(size=(50, 30)) as pilot:
        await settle(pilot, lambda: app.main.ready)
        last = app.main.sampler.snapshots[-1]
        app.main.sampler.play()
        await settle(pilot, lambda: app.main.snapshot is not None and app.main.snapshot.time == last.time)
        await pilot.pause()
        experts = f"experts {last.streaming.expert_hits:,}/{last.streaming.expert_hits + last.streaming.expert_misses:,}"
        assert experts in str(app.query_one(CachePanel).body.render())
        assert app.query_one(CachePanel).snapshot is app.main.snapshot  # bound, not pushed panel by panel
        for panel_type in (CachePanel, PrefetchPanel, DiskPanel, LatencyPanel, ResidencyPanel):
            body = app.query_one(panel_type).body
            width = body.content_region.width
            assert width > 0
            for line in str(body.render()).splitlines():
                assert cell_len(line) <= width, (panel_type.__name__, line, width)
        latency = str(app.query_one(LatencyPanel).body.render()).splitlines()
        assert f"TTFT {last.ttft_s * 1000:.0f} ms" in latency and f"{last.decode_tok_s:.1f} tok/s" in latency


async def test_sparklines_stay_inside_their_panels_and_start_empty():
    app = fake_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot, lambda: app.main.ready)
        latency = app.query_one(LatencyPanel)
        app.main.sampler.play(1)  # a first sample: no tokens, no rate yet
        await pilot.pause()
        for panel in (latency, app.query_one(DiskPanel)):  # nothing measured yet: no sparkline row at all
            spark = panel.query_one(Sparkline)
            assert spark.data == [] and spark.region.height == 0
        app.main.sampler.play()
        await pilot.pause()
        for panel in (latency, app.query_one(DiskPanel)):
            spark = panel.query_one(Sparkline)
            assert spark.data
            inside = panel.content_region
            assert inside.x <= spark.region.x and spark.region.right <= inside.right, (spark.region, inside)


async def test_on_ios_the_memory_panel_shows_the_footprint_against_jetsam_and_the_ssd_panel_says_why_no_drive():
    from dataclasses import replace

    from kimitui.tui.widgets.panels import MemoryPanel

    phone = [
        replace(snap, footprint_bytes=5 * 2**30, footprint_limit_bytes=6 * 2**30, disk_name=None, disk_rates={}, disk_note="drive rate: Linux only")
        for snap in recorded_snapshots()
    ]
    app = fake_app(snapshots=phone)
    async with app.run_test(size=(50, 30)) as pilot:
        await settle(pilot, lambda: app.main.ready)
        app.main.sampler.play()
        await settle(pilot, lambda: app.main.snapshot is not None and app.main.snapshot.time == phone[-1].time)
        await pilot.pause()
        memory = app.query_one(MemoryPanel)
        assert "footprint 5.0 GiB of 6.0 GiB" in memory.summary
        assert memory.has_class("-warning") or memory.has_class("-error")  # 83% of jetsam's limit at least
        disk = app.query_one(DiskPanel)
        assert "disk —" in str(disk.body.render()) and str(disk.note.render()) == "drive rate: Linux only"


def app_serving_the_api(engine: FakeEngine):
    """The fake app with its API on (a URL, no server): every panel is shown, the API's too."""
    from kimitui.tui.app import KimituiApp

    app = fake_app(engine)
    return KimituiApp(app.settings, app.engine, app.main.sampler, app.store, api=lambda record: "http://127.0.0.1:8080")


@pytest.mark.parametrize("size", [(120, 40), (50, 30)], ids=["desktop", "phone"])
async def test_every_panel_on_draws_nothing_beside_the_panels_and_the_column_says_what_is_out_of_view(size):
    """More panels than rows: the column scrolls with no scrollbar (its thumb's block glyphs,
    drawn beside a panel's border, read as sparkline cells past it) and its last row counts
    the panels out of view."""
    engine = FakeEngine()
    engine.gate = threading.Event()  # a reply streams, half-way, while the panels are read
    app = app_serving_the_api(engine)
    async with app.run_test(size=size) as pilot:
        await settle(pilot, lambda: app.main.ready)
        app.query_one(PromptInput).focus()
        await pilot.press(*"Hi", "enter")
        await settle(pilot, lambda: app.main.reply is not None and app.main.reply.text)
        app.main.sampler.play()
        column = app.query_one(PanelColumn)
        await settle(pilot, lambda: column.more.display)
        # Laid out again (as a terminal's resize or a toggled panel does): the layout right after
        # the column overflowed left no room for a bar yet, the next one would.
        app.screen.refresh(layout=True)
        await pilot.pause(0.2)
        panels = [panel for panel in column.query_children(Panel) if panel.display]
        assert len(panels) == 8
        right = column.region.right
        assert max(panel.region.right for panel in panels) == right  # no gutter kept for a bar
        rows = [strip.text for strip in app.screen._compositor.render_strips()]
        for y in range(column.region.y, column.region.bottom):
            last = rows[y][right - 1]
            assert last not in "▁▂▃▄▅▆▇█▔▏▕", (y, rows[y][column.region.x:right])
        bottom = column.region.bottom - 1  # the note's row
        below = [panel for panel in panels if panel.region.bottom > bottom]
        assert below and str(column.more.render()) == f"+{len(below)} panels below: scroll or hide (1-8)"
        assert rows[bottom][column.region.x:right].strip() == str(column.more.render())
        column.scroll_end(animate=False)
        await settle(pilot, lambda: "panels above" in str(column.more.render()))
        app.main.panels["5"].focus()  # the panel keys are the screen's, not the prompt's
        await pilot.press(*"12345678")  # every panel hidden: nothing out of view, no note
        await settle(pilot, lambda: not column.more.display)
        engine.gate.set()


async def test_the_residency_strip_shows_the_experts_as_well_as_the_trunk():
    app = fake_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot, lambda: app.main.ready)
        app.main.sampler.play()
        await pilot.pause()
        lines = str(app.query_one(ResidencyPanel).body.render()).splitlines()
        assert lines[0] == "trunk   ████"  # the recorded cut's trunk is pinned whole
        assert lines[1].startswith("experts  ") and len(lines[1]) == len("experts ") + 4  # dense layer 0 blank
        assert lines[1][9:] == "░░░"  # 8-24 of 896 in memory per layer: a sliver each
        assert lines[2] == "in memory 42/2,688"  # experts, of all layers (8 + 10 + 24)


async def test_tuning_steps_values_beside_the_panels_and_shows_what_the_change_did():
    engine = FakeEngine()
    app = fake_app(engine)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot, lambda: app.main.ready)
        app.main.sampler.play(3)
        await pilot.press("ctrl+e")
        strip = app.query_one(TuningPanel)
        assert strip.has_focus and app.screen is app.main
        await pilot.press("right")
        assert "52.1 MiB → 57.1 MiB" in str(strip.render()) and not engine.retuned  # a tenth more, in whole MiB
        await pilot.press("enter")
        assert engine.retuned == [{"budget": 54_646_416 + 5 * MIB}]
        assert "budget: applies from the next token, after the pinned set is re-read" in str(strip.render())
        assert "budget 57.1 MiB" in str(app.query_one(StatusBar).render())
        app.main.sampler.play()
        await pilot.pause()
        shown = str(strip.render()).splitlines()
        before = next(line for line in shown if line.startswith("before"))
        after = next(line for line in shown if line.startswith("after"))
        snaps = recorded_snapshots()
        window = Window.between(snaps[2], snaps[7])  # from the sample the change was applied at to the last
        assert "8 tok" in before and f"{window.tokens} tok" in after and f"{window.hit_rate:.0%}" in after
        for _ in range(20):  # far below the working set: refused, nothing changed
            await pilot.press("left")
        await pilot.press("enter")
        assert "not applied: budget below the minimum working set" in str(strip.render())
        assert engine.values.budget == 54_646_416 + 5 * MIB


def test_a_window_between_two_snapshots():
    snaps = recorded_snapshots()
    a, b = snaps[2], snaps[6]
    window = Window.between(a, b)
    assert window.tokens == b.tokens_total - a.tokens_total == 36
    assert window.read_per_token == (b.process_read_bytes - a.process_read_bytes) / 36
    hits = b.streaming.expert_hits - a.streaming.expert_hits
    misses = b.streaming.expert_misses - a.streaming.expert_misses
    assert window.hit_rate == hits / (hits + misses)
    assert window.tok_s == 36 / sum(b.latencies[-36:]) and window.model_bytes == b.model_rss_bytes
    # A re-pin (budget, shard size) makes a new streamer whose counts start at zero: the window
    # then counts from there, never negative.
    from dataclasses import replace

    from kimitui.engine.metrics import StreamingCounters

    fresh = replace(snaps[6], streaming=StreamingCounters(cache_hits=400, cache_misses=100, expert_hits=100, expert_misses=400, generation=2))
    assert Window.between(snaps[5], fresh).hit_rate == 0.5  # its own counts, even once above the old one's


async def test_a_failed_reply_is_shown_once_the_history_kept_and_the_next_reply_works():
    engine = FakeEngine(fail_reply="cannot read expert 12 of layer 3 from model file k3.gguf at byte 4096: Input/output error")
    app = fake_app(engine)
    async with app.run_test(size=(120, 40)) as pilot:
        failed = await send(pilot, app, "Hi")
        assert str(failed.border_subtitle).startswith("error: cannot read expert 12")
        engine.fail_reply = None
        ok = await send(pilot, app, "Again")
        assert not str(ok.border_subtitle).startswith("error")
        await pilot.pause(0.2)
        rows = app.store.messages(app.main.conversation_id)
        assert [(m.role, m.complete) for m in rows] == [("user", True), ("assistant", False), ("user", True), ("assistant", True)]


async def test_a_failed_load_is_one_notice_and_a_failed_state():
    app = fake_app(FakeEngine(fail_load="llama.cpp could not load k3-cut.gguf: check_tensor_dims"))
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot, lambda: app.main.engine_state == "failed")
        await pilot.pause()
        assert [n.message for n in app._notifications] == ["llama.cpp could not load k3-cut.gguf: check_tensor_dims"]
        assert not app.main.ready


async def test_history_is_written_off_the_event_loop():
    app = fake_app()
    writers = []
    store = app.store
    real_update = store.update_message

    def update(*args, **kwargs):
        writers.append(threading.current_thread().name)
        return real_update(*args, **kwargs)

    store.update_message = update
    async with app.run_test(size=(120, 40)) as pilot:
        await send(pilot, app, "Hi")
        await pilot.pause(0.2)
    assert writers and all(name.startswith("kimitui-history") for name in writers)


async def test_remote_engines_are_tuned_on_their_server():
    class Remote(FakeEngine):
        def tuning(self):
            return None

    app = fake_app(Remote())
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot, lambda: app.main.ready)
        await pilot.press("ctrl+e")
        await pilot.pause()
        assert not app.query_one(TuningPanel).display
        assert [n.message for n in app._notifications] == ["remote mode: the server's engine is tuned on the server"]


async def test_chat_keys_belong_to_a_dialog_over_the_main_screen():
    from kimitui.tui.screens.sampling import SamplingScreen

    app = fake_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await send(pilot, app, "Hi")
        await pilot.press("ctrl+t")
        assert isinstance(app.screen, SamplingScreen)
        await pilot.press("ctrl+n")  # the main screen's key: not in force over the dialog
        await pilot.press("escape")  # the dialog's: it closes, the chat is still there
        await pilot.pause()
        assert app.screen is app.main and len(app.main.chat_log.query(MessageView)) == 2


def test_every_panel_has_its_own_key_from_the_panel_registry():
    """The screen's panel keys are made from the panels' own KEY and LABEL: a panel added to the
    registry gets its key, and no two panels share one (nor the trace pane's 9). Pressing them:
    tests/test_tui.py::test_regenerate_new_chat_copy_and_panel_keys."""
    from kimitui.tui.screens.main import MainScreen
    from kimitui.tui.widgets.panels import PANEL_TYPES

    keys = [panel.KEY for panel in PANEL_TYPES]
    assert len(set(keys)) == len(keys) and "9" not in keys
    bindings = {binding.key: binding for binding in MainScreen.BINDINGS}
    for panel in PANEL_TYPES:
        assert bindings[panel.KEY].action == f"toggle_panel({panel.KEY})"
        assert bindings[panel.KEY].description == (panel.LABEL or panel.TITLE)
