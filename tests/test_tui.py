"""The real app, driven with Pilot against the real default model, at desktop and phone sizes."""

from __future__ import annotations

import signal
import sqlite3
import threading

import pytest
from helpers import until

from kimitui import cli
from kimitui.cli import build_parser, resolve_model, resolve_settings
from kimitui.history import HistoryStore
from kimitui.config import data_dir
from kimitui.tui.app import KimituiApp
from kimitui.tui.messages import LoadFinished, TokenReceived
from kimitui.tui.screens.history import HistoryScreen
from kimitui.tui.screens.sampling import SamplingScreen
from kimitui.tui.widgets.chat import MessageView, PromptInput
from kimitui.tui.widgets.panels import LatencyPanel, MemoryPanel, Panel
from kimitui.tui.widgets.status import StatusBar

SIZES = [(120, 40), (50, 30)]


@pytest.fixture(autouse=True)
def short_replies(tmp_path, monkeypatch):
    """Greedy, short replies keep the suite quick on two shared cores."""
    config = tmp_path / "config.toml"
    config.write_text("[sampling]\ntemperature = 0.0\nmax_tokens = 40\n")
    monkeypatch.setenv("KIMITUI_CONFIG", str(config))


def make_app(*flags: str) -> KimituiApp:
    settings = resolve_settings(build_parser().parse_args(list(flags)))
    return cli.make_app(settings, resolve_model(settings))


async def ask(pilot, app: KimituiApp, text: str) -> None:
    await until(pilot, lambda: app.main.ready)
    app.query_one(PromptInput).focus()
    await pilot.press(*text)
    await pilot.press("enter")
    await until(pilot, lambda: app.main.reply is None and app.query(MessageView) and app.query(MessageView).last().border_subtitle)


@pytest.mark.parametrize("size", SIZES)
async def test_chat_streams_and_panels_fill(size):
    app = make_app()
    tokens = []

    def hook(message):
        if isinstance(message, TokenReceived):
            tokens.append(message.event)

    async with app.run_test(size=size, message_hook=hook) as pilot:
        await ask(pilot, app, "Say hello")
        views = list(app.query(MessageView))
        assert [v.role for v in views] == ["user", "assistant"]
        reply = views[-1]
        assert reply.text and len(tokens) > 1  # streamed token by token, not in one piece
        assert reply.text == "".join(e.text for e in tokens)
        assert "tok" in str(reply.border_subtitle)
        await until(pilot, lambda: "p50 —" not in str(app.query_one(LatencyPanel).body.render()))
        latency = str(app.query_one(LatencyPanel).body.render())
        assert "ms" in latency and "tok/s" in latency and "TTFT" in latency
        memory = app.query_one(MemoryPanel).summary
        assert "RSS" in memory and "RSS 0 B" not in memory and "of " in memory
        assert app.query_one(PromptInput).text == ""
        assert app.screen.has_class("-narrow") == (size[0] < 100)
        status = app.query_one(StatusBar)
        assert status.model_name and status.model_name in str(status.render())  # at 50 columns too
        # Every shown panel is on screen at this size, none clipped to nothing; the API panel only with --serve.
        for panel in app.query(Panel):
            if panel.id == "panel-6":
                assert not panel.display
            else:
                assert panel.region.height >= 3, panel.id


async def test_status_bar_reports_the_engines_load_time_when_the_load_started_early():
    # As `kimitui` starts it: the load runs before the UI exists, so the time is the engine's.
    from kimitui.cli import build_app

    import gc

    app = build_app(build_parser().parse_args([]))
    assert not gc.isenabled()  # start-up runs without the cyclic collector...
    loaded = []
    try:
        async with app.run_test(size=(120, 40), message_hook=lambda m: loaded.append(m) if isinstance(m, LoadFinished) else None) as pilot:
            await until(pilot, lambda: app.main.ready)
            assert loaded[0].seconds == app.engine.load_s > 0
            assert gc.isenabled()  # ...and the app turns it back on once it is up
    finally:
        gc.enable()


def test_a_refused_start_leaves_the_collector_on(tmp_path):
    import gc

    from kimitui.cli import build_app
    from kimitui.errors import UserError

    with pytest.raises(UserError):
        build_app(build_parser().parse_args(["--model", str(tmp_path / "missing.gguf")]))
    assert gc.isenabled()


async def test_status_bar_shows_pinning_progress_then_what_was_pinned():
    from kimitui.tui.messages import PinProgressed

    app = make_app()
    progress = []
    async with app.run_test(size=(120, 40), message_hook=lambda m: progress.append(m.progress) if isinstance(m, PinProgressed) else None) as pilot:
        status = app.query_one(StatusBar)
        await until(pilot, lambda: status.pinned.startswith("pinned"))
        assert progress and progress[-1].finished
        assert status.pinned in str(status.render()) and not status.pinning
        status.pinning = progress[0].describe()  # as it showed while the reads ran
        rendered = str(status.render())
        assert "pinning" in rendered and "MB/s" in rendered and "ETA" in rendered


async def test_the_app_watches_for_a_hangup_only_while_it_runs():
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: app.main.ready)
        assert signal.getsignal(signal.SIGHUP) is not signal.SIG_DFL  # the loop's own handler
    # The loop outlives the app here: a hangup after it must not reach an app that is gone.
    assert signal.getsignal(signal.SIGHUP) is signal.SIG_DFL


async def test_a_hangup_handler_of_the_program_running_the_app_is_back_after_it():
    def own_handler(signum, frame):  # a program that embeds the app and handles hangups itself
        pass

    signal.signal(signal.SIGHUP, own_handler)
    try:
        app = make_app()
        async with app.run_test(size=(120, 40)) as pilot:
            await until(pilot, lambda: app.main.ready)
            assert signal.getsignal(signal.SIGHUP) is not own_handler
        assert signal.getsignal(signal.SIGHUP) is own_handler
    finally:
        signal.signal(signal.SIGHUP, signal.SIG_DFL)


async def test_escape_cancels_a_reply_and_keeps_history():
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: app.main.ready)
        app.main.sampling.max_tokens = 400
        await pilot.press(*"Write a long story about a lighthouse")
        await pilot.press("enter")
        await until(pilot, lambda: app.main.reply is not None and len(app.main.reply.view.text) > 10)
        await pilot.press("escape")
        await until(pilot, lambda: app.main.reply is None)
        reply = app.query(MessageView).last()
        assert "cancelled" in str(reply.border_subtitle)
        assert reply.text
        conv = app.main.conversation_id
    store = HistoryStore(data_dir() / "history.sqlite3")
    msgs = store.messages(conv)
    assert [m.role for m in msgs] == ["user", "assistant"]
    assert msgs[1].content == reply.text and msgs[1].stats["finish_reason"] == "cancelled"


async def test_history_reopens_after_restart():
    first = make_app()
    async with first.run_test(size=(120, 40)) as pilot:
        await ask(pilot, first, "What is two plus two?")
        texts = [v.text for v in first.query(MessageView)]
    second = make_app()
    async with second.run_test(size=(50, 30)) as pilot:
        await until(pilot, lambda: second.main.ready)
        assert not second.query(MessageView)
        await pilot.press("ctrl+o")
        await until(pilot, lambda: isinstance(second.screen, HistoryScreen) and second.screen.filled)
        await pilot.press("enter")
        await until(pilot, lambda: len(second.query(MessageView)) == 2)
        assert [v.text for v in second.query(MessageView)] == texts
        # The reopened chat continues: a new question sees the earlier turns.
        await ask(pilot, second, "And three plus three?")
        assert len(second.query(MessageView)) == 4


async def test_history_lists_markup_titles_and_survives_deleting_the_open_chat():
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await ask(pilot, app, "what does [/] mean")  # the title is text, not Textual markup
        await pilot.press("ctrl+o")
        await until(pilot, lambda: isinstance(app.screen, HistoryScreen) and app.screen.filled)
        await pilot.press("d", "escape")
        await until(pilot, lambda: not isinstance(app.screen, HistoryScreen) and not app.query(MessageView))
        assert app.main.conversation_id is None
        await ask(pilot, app, "Hi")  # a new conversation, not the deleted one
        messages = app.store.messages(app.main.conversation_id)
        assert [(m.role, m.content) for m in messages][:1] == [("user", "Hi")] and len(messages) == 2


async def test_history_exports_a_conversation_to_markdown(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the dialog exports into the working directory
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await ask(pilot, app, "Name a sea")
        await pilot.press("ctrl+o")
        await until(pilot, lambda: isinstance(app.screen, HistoryScreen) and app.screen.filled)
        await pilot.press("e")
        await until(pilot, lambda: list(tmp_path.glob("kimitui-*.md")))
        text = next(tmp_path.glob("kimitui-*.md")).read_text(encoding="utf-8")
        assert "Name a sea" in text and app.query(MessageView).last().text.strip()[:20] in text


async def test_a_database_error_in_the_history_dialog_is_a_notice_and_the_chat_goes_on(monkeypatch):
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: app.main.ready)

        def locked():
            raise sqlite3.OperationalError("database is locked")

        monkeypatch.setattr(app.store, "list_conversations", locked)
        await pilot.press("ctrl+o")
        await until(pilot, lambda: any("database is locked" in n.message for n in app._notifications))
        assert isinstance(app.screen, HistoryScreen) and not app.screen.filled
        await pilot.press("escape")
        await ask(pilot, app, "Hi")  # the chat still answers, and is still saved
        assert [m.role for m in HistoryStore(data_dir() / "history.sqlite3").messages(app.main.conversation_id)] == ["user", "assistant"]


async def test_regenerate_new_chat_copy_and_panel_keys():
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await ask(pilot, app, "Hi")
        first_reply = app.query(MessageView).last()
        await pilot.press("ctrl+r")
        await until(pilot, lambda: app.query(MessageView).last() is not first_reply)
        await until(pilot, lambda: app.main.reply is None and app.query(MessageView).last().border_subtitle)
        assert len(app.query(MessageView)) == 2
        await pilot.press("ctrl+y")
        assert app.clipboard == app.query(MessageView).last().text

        await pilot.press("escape")  # leave the prompt: panel keys now reach the app
        assert not isinstance(app.focused, PromptInput)
        await pilot.press("1")
        assert not app.query_one("#panel-1").display
        await pilot.press("1")
        assert app.query_one("#panel-1").display
        interval = app.main.sampler.interval
        await pilot.press("minus")
        assert app.main.sampler.interval == interval * 2
        await pilot.press("p")
        assert app.main.sampler.paused
        await pilot.press("z")
        assert app.screen.maximized is not None
        await pilot.press("escape")
        assert app.screen.maximized is None

        await pilot.press("ctrl+n")
        await pilot.pause()
        assert not app.query(MessageView) and app.main.conversation_id is None


async def test_sampling_screen_validates_and_applies():
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("ctrl+t")
        await until(pilot, lambda: isinstance(app.screen, SamplingScreen))
        field = app.screen.query_one("#field-temperature")
        field.value = "hot"
        await pilot.click("#apply")
        await pilot.pause(0.2)  # the error line moves the button; let layout settle before the next click
        assert isinstance(app.screen, SamplingScreen)
        assert "temperature" in str(app.screen.query_one("#sampling-error").render())
        field.value = "0"
        app.screen.query_one("#field-max_tokens").value = "7"
        await pilot.click("#apply")
        await until(pilot, lambda: not isinstance(app.screen, SamplingScreen))
        assert app.main.sampling.temperature == 0.0 and app.main.sampling.max_tokens == 7
        await ask(pilot, app, "Count to twenty")
        assert app.query(MessageView).last().border_subtitle.startswith("7 tok")


async def test_theme_flag_and_memory():
    app = make_app("--theme", "kimitui-paper")
    async with app.run_test(size=(80, 30)) as pilot:
        assert app.theme == "kimitui-paper"
        app.theme = "nord"
        await pilot.pause()
    again = make_app()
    async with again.run_test(size=(80, 30)):
        assert again.theme == "nord"


async def test_message_typed_while_loading_is_kept():
    app = make_app()
    gate = threading.Event()
    real_load = app.engine.load

    def slow_load(on_progress=None):
        gate.wait(60)  # a large model on a slow drive: the load is still running
        real_load(on_progress)

    app.engine.load = slow_load
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press(*"early")
        await pilot.press("enter")
        assert app.query_one(PromptInput).text == "early"
        assert not app.query(MessageView)
        assert "loading" in str(app.query_one(StatusBar).render())
        gate.set()
        await until(pilot, lambda: app.main.ready)
        await pilot.press("enter")
        await until(pilot, lambda: len(app.query(MessageView)) == 2)


async def test_serve_inside_the_app_shares_the_engine():
    import httpx

    from kimitui.cli import build_app
    from kimitui.tui.widgets.panels import ApiPanel

    # As `kimitui --serve 127.0.0.1:0 --api-key KEY` builds it: the key guards the app's API.
    app = build_app(build_parser().parse_args(["--serve", "127.0.0.1:0", "--api-key", "app-key"]))
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: app.main.ready)
        url = app.main.api_url
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            body = {"prompt": "The sea is", "n_predict": 8, "temperature": 0}
            assert (await client.post("/completion", json=body)).status_code == 401
            response = await client.post("/completion", json=body, headers={"Authorization": "Bearer app-key"})
        assert response.status_code == 200 and response.json()["timings"]["predicted_n"] == 8
        panel = app.query_one(ApiPanel)
        # Both requests show, the refused one too; the panel hears of them from the server's thread.
        await until(pilot, lambda: any("200 POST /completion" in line for line in panel.lines))
        assert any("401 POST /completion" in line for line in panel.lines)
        assert "200 POST /completion 8 tok" in panel.lines[-1]
        await ask(pilot, app, "Hello")  # the chat still works beside the API
        assert app.engine.metrics.view()["requests_total"] == 2


async def test_remote_mode_chats_through_our_server(model_path):
    from kimitui.engine.session import Engine
    from kimitui.server.app import create_app
    from kimitui.server.runner import ServerThread, bind_socket

    settings = resolve_settings(build_parser().parse_args([]))
    engine = Engine(model_path, n_ctx=1024)
    engine.load()
    server = ServerThread(create_app(engine, settings), bind_socket("127.0.0.1", 0)).start()
    try:
        app = cli.make_app(settings, remote=(server.url, None))
        async with app.run_test(size=(50, 30)) as pilot:
            await ask(pilot, app, "Say hi")
            reply = app.query(MessageView).last()
            assert reply.text and "tok" in str(reply.border_subtitle)
            assert server.url in str(app.query_one(StatusBar).render())
            # Panels filled from the server's /metrics: its RSS, not ours.
            await until(pilot, lambda: "RSS —" not in app.query_one(MemoryPanel).summary)
    finally:
        server.stop()
        engine.close()


async def test_streaming_model_fills_cache_panels_and_tuning_applies(tmp_path):
    """Tuned from the strip beside the panels (no dialog): each key steps a value, Enter
    applies, and the strip shows when it applies and the figures before and after."""
    from kimitui.model import synth
    from kimitui.tui.widgets.panels import CachePanel, PrefetchPanel, ResidencyPanel
    from kimitui.tui.widgets.tuning import TuningPanel

    model = synth.write_model(synth.plan_dense(160 * 2**20, "q4_1", synth.default_tokenizer()), tmp_path / "m.gguf", progress=False).paths[0]
    app = make_app("--model", str(model), "--budget", "150MiB")
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: app.engine.streamer is not None)
        await ask(pilot, app, "Hello")
        await until(pilot, lambda: "hits —" not in str(app.query_one(CachePanel).body.render()))
        assert "hit rate" in str(app.query_one(CachePanel).body.render())
        cells = str(app.query_one(ResidencyPanel).body.render())
        assert "█" in cells or "▓" in cells or "░" in cells
        await pilot.press("ctrl+e")
        strip = app.query_one(TuningPanel)
        assert strip.display and strip.has_focus and app.screen is app.main  # beside the panels, not over them
        assert all(panel.region.width > 0 for panel in app.query(CachePanel))
        depth = app.engine.stream_settings.prefetch_depth
        await pilot.press("down", "left")  # the prefetch row, one less
        assert f"{depth} → {depth - 1}" in str(strip.render())
        assert app.engine.stream_settings.prefetch_depth == depth  # not until Enter
        await pilot.press("enter")
        assert app.engine.stream_settings.prefetch_depth == depth - 1
        assert "prefetch depth: applies from the next token" in str(strip.render())
        await ask(pilot, app, "Again")
        assert app.engine.streamer.settings.prefetch_depth == depth - 1
        await until(pilot, lambda: "after" in str(strip.render()) and " 0 tok" not in str(strip.render()).split("after")[1])
        shown = str(strip.render())
        assert "before" in shown and "tok/s" in shown and "read/tok" in shown
        placer = app.engine.streamer.placer
        if placer is not None:  # direct reads: a spent buffer pool is shown, not hidden
            placer.WAIT_FOR_BUFFER_S = 0
            placer.capacity = 0
            await ask(pilot, app, "Once more")
            note = app.query_one(PrefetchPanel).note
            await until(pilot, lambda: "via page cache" in str(note.render()))
        await pilot.press("ctrl+e")  # the chat had the keys: back to the strip, on the row it was at
        assert strip.has_focus
        await pilot.press("down", "down", "down", "down", "right", "right", "enter")  # I/O threads, two more
        assert app.engine.stream_settings.io_threads == 6
        await pilot.press("up", "right", "escape")  # a step dropped with Esc
        assert " → " not in str(strip.render()) and app.engine.stream_settings.expert_policy == "lfu"
        await pilot.press("ctrl+e")
        assert not strip.display and app.query_one(PromptInput).has_focus


async def test_model_file_cut_mid_reply_shows_an_error_and_keeps_the_app(tmp_path):
    import os

    from kimitui.model import synth

    model = synth.write_model(synth.plan_dense(160 * 2**20, "q4_1", synth.default_tokenizer()), tmp_path / "m.gguf", progress=False).paths[0]
    whole = model.read_bytes()
    half = whole[: len(whole) // 2]
    app = make_app("--model", str(model), "--budget", "150MiB")
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: app.engine.streamer is not None)
        app.main.sampling.max_tokens = 200
        await pilot.press(*"Tell me a story")
        await pilot.press("enter")
        await until(pilot, lambda: app.main.reply is not None and app.main.reply.view.text)
        # The drive goes away mid-reply, here at a layer start so that the cut surely lands
        # mid-reply (test_faults.py cuts at any moment, in a child process).
        streamer = app.engine.streamer
        real = streamer.on_layer_start

        cut = []

        def cut_then_start(layer):
            if layer == 3 and not cut:
                cut.append(layer)
                os.truncate(model, model.stat().st_size // 2)
            return real(layer)

        streamer.on_layer_start = cut_then_start
        # The reply ends, then its note is written (after the markdown stream stops).
        await until(pilot, lambda: app.main.reply is None and app.query(MessageView).last().border_subtitle)
        reply = app.query(MessageView).last()
        assert str(reply.border_subtitle).startswith("error:") and "m.gguf" in str(reply.border_subtitle)
        conv = app.main.conversation_id
        # The app goes on: typing still works and the chat is saved.
        await pilot.press(*"still here")
        assert app.query_one(PromptInput).text == "still here"
        # The drive is back (the same file, whole again): the next reply works, no restart.
        with open(model, "r+b") as f:
            f.seek(len(half))
            f.write(whole[len(half):])
        app.main.sampling.max_tokens = 8
        await pilot.press("enter")
        await until(pilot, lambda: app.main.reply is None and len(app.query(MessageView)) == 4 and app.query(MessageView).last().border_subtitle)
        again = app.query(MessageView).last()
        assert again.text and not str(again.border_subtitle).startswith("error:")
    msgs = HistoryStore(data_dir() / "history.sqlite3").messages(conv)
    assert [m.role for m in msgs] == ["user", "assistant", "user", "assistant"] and msgs[1].content == reply.text


async def test_trace_flag_shows_the_live_trace_and_writes_the_file(tmp_path):
    import json

    from kimitui.model import synth
    from kimitui.tui.widgets.trace_log import TokenBreakdown, TraceLog

    model = synth.write_model(synth.plan_dense(160 * 2**20, "q4_1", synth.default_tokenizer()), tmp_path / "m.gguf", progress=False).paths[0]
    trace = tmp_path / "trace.jsonl"
    app = make_app("--model", str(model), "--budget", "150MiB", "--trace", str(trace))
    async with app.run_test(size=(120, 40)) as pilot:
        assert app.query_one(TraceLog).display
        await until(pilot, lambda: app.engine.streamer is not None)
        await ask(pilot, app, "Hi")
        assert app.query_one(TokenBreakdown).is_mounted
        await until(pilot, lambda: len(app.query_one(TraceLog).query_one("RichLog").lines) > 0)
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    kinds = {r["type"] for r in records}
    assert {"request", "token", "read", "end"} <= kinds
    end = [r for r in records if r["type"] == "end"][-1]
    assert len([r for r in records if r["type"] == "token"]) == end["completion_tokens"] > 0


async def test_a_conversation_longer_than_the_context_goes_on_and_the_history_keeps_it(tmp_path, monkeypatch):
    """At a context of 256 tokens a few exchanges fill it: the next message still gets a reply
    (the oldest turns leave the context, the system prompt stays), the chat says so under the
    reply, and the history keeps every message."""
    config = tmp_path / "small.toml"
    config.write_text("[model]\nn_ctx = 256\n[sampling]\ntemperature = 0.0\nmax_tokens = 40\n")
    monkeypatch.setenv("KIMITUI_CONFIG", str(config))
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        asked = ["Tell me about the sea.", "Tell me about mountains.", "Tell me about rivers.", "Tell me about forests.",
                 "Tell me about deserts.", "Tell me about cities."]
        for text in asked:
            await ask(pilot, app, text)
            if app.query(".chat-notice"):
                break
        notices = [str(n.render()) for n in app.query(".chat-notice")]
        assert notices and "left the model's context" in notices[0] and "the history keeps them" in notices[0]
        replies = [v for v in app.query(MessageView) if v.role == "assistant"]
        assert replies[-1].text and "error" not in str(replies[-1].border_subtitle)
        kept = app.main.history.store.messages(app.main.conversation_id)
        sent = asked[: len(replies)]
        assert [m.content for m in kept if m.role == "user"] == sent and len(kept) == 2 * len(sent)
        # The system prompt stays in the context: the prompt the engine was given begins with it.
        assert app.main.engine.llm.detokenize(app.main.engine.llm.input_ids[:12].tolist()).decode().find("helpful assistant") != -1


async def test_remote_panels_show_only_what_a_stock_llama_server_reports():
    """Against a llama-server that reports neither memory, reads nor streaming, and whose
    predicted_tokens_seconds gauge reads 0 between replies: those panels say "not reported by
    this server", the residency panel claims nothing, and tok/s is the tokens that arrived."""
    from fakes import FakeLlamaServer
    from kimitui.tui.widgets.panels import NOT_REPORTED, CachePanel, DiskPanel, ExpertPanel, PrefetchPanel, ResidencyPanel

    fake = FakeLlamaServer(delay_s=0.03).start()
    try:
        settings = resolve_settings(build_parser().parse_args([]))
        app = cli.make_app(settings, remote=(fake.url, None))
        async with app.run_test(size=(120, 40)) as pilot:
            await ask(pilot, app, "Hi")
            assert app.query(MessageView).last().text == "".join(FakeLlamaServer.WORDS)
            latency = app.query_one(LatencyPanel)
            await until(pilot, lambda: "p50 —" not in str(latency.body.render()))
            shown = str(latency.body.render())
            rate = float(shown.split("\n")[3].split()[0])
            # 7 tokens 30 ms apart (33 tok/s alone; 2.4 seen once under the full suite's load), not the server's 0.0
            assert 1.0 < rate < 1000.0
            for panel in (CachePanel, PrefetchPanel, DiskPanel, MemoryPanel, ResidencyPanel, ExpertPanel):
                assert str(app.query_one(panel).note.render()) == NOT_REPORTED, panel.__name__
            assert "pinned" not in str(app.query_one(ResidencyPanel).body.render())
            assert "timed here" in str(latency.note.render())
    finally:
        fake.stop()
