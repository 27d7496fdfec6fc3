"""The per-token trace: records that add up on a real streamed run, summarize/compare on
recorded files, rotation, one-line errors for bad files, and the live TUI views."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from kimitui.cli import build_parser, main, resolve_settings
from kimitui.engine.generation import GenerationResult, Sampling
from kimitui.engine.session import Engine
from kimitui.engine.streaming import StreamSettings
from kimitui.errors import UserError
from kimitui.model.gguf_map import Shard
from kimitui.trace import TraceWriter, check_not_model_drive, default_trace_path, open_trace
from kimitui.trace.cli import METRICS
from kimitui.trace.reader import read_trace
from kimitui.trace.writer import COUNTERS, rotated_path

MIB = 2**20
PROMPT = "Once upon a time"
TOKENS = 8
DEPTH = 4


@pytest.fixture(scope="module")
def model(dense) -> Path:
    return dense  # conftest's: the 160 MiB dense model the engine tests share


@pytest.fixture(scope="module")
def engine(model):
    # Prefetch 4 layers deep: the read-ahead issued after each pass reaches past the pinned
    # first layers, so reads cross token boundaries and outlive the last token.
    engine = Engine(model, n_ctx=256, budget=160 * MIB, stream_settings=StreamSettings(prefetch_depth=DEPTH))
    engine.load()
    engine.pin()
    assert engine.streamer is not None, "the budget should force streaming"
    yield engine
    engine.close()


def records_of(*paths: Path) -> list[dict]:
    return [json.loads(line) for path in paths for line in path.read_text().splitlines()]


def wait_for_reads(streamer, timeout: float = 30.0) -> None:
    """Until no read is in flight (a test-only look at the streamer's queue): then every byte
    counted has also been reported."""
    deadline = time.monotonic() + timeout
    while any(not f.done() for futures in list(streamer._futures.values()) for f in futures):
        assert time.monotonic() < deadline, "reads still in flight"
        time.sleep(0.01)


def traced_request(engine: Engine, path: Path, tokens: int = TOKENS):
    writer = TraceWriter(path)
    writer.attach(engine)
    streamer = engine.streamer
    before = None if streamer is None else streamer.counters()
    gen = engine.complete(PROMPT, Sampling(temperature=0.0, max_tokens=tokens))
    list(gen)
    if streamer is not None:
        wait_for_reads(streamer)
    writer.close()
    after = None if streamer is None else streamer.counters()
    return gen, before, after


def test_traced_run_adds_up(engine, tmp_path):
    s = engine.streamer
    path = tmp_path / "run.jsonl"
    gen, before, after = traced_request(engine, path)
    records = records_of(path)
    assert [r["type"] for r in records[:2]] == ["session", "request"] and records[-1]["type"] == "close"
    (request,) = [r for r in records if r["type"] == "request"]
    tokens = [r for r in records if r["type"] == "token"]
    reads = [r for r in records if r["type"] == "read"]
    (end,) = [r for r in records if r["type"] == "end"]
    close = records[-1]

    assert request["id"] == gen.id and request["model"] == "dense.gguf"
    assert request["settings"] == engine.trace_settings() and request["settings"]["prefetch_depth"] == DEPTH
    assert len(tokens) == gen.result.completion_tokens == end["completion_tokens"] == TOKENS
    assert [t["i"] for t in tokens] == list(range(TOKENS))
    assert end["finish"] == "length" and end["prompt_tokens"] == gen.result.prompt_tokens

    # What the engine counted, checked against the model's geometry first: each of the 8
    # passes (prompt, then one per token but the last) reads every streamed shard once, and
    # the last pass's read-ahead for a 9th pass that never comes is read as well.
    counted = {k: after[k] - before[k] for k in COUNTERS}
    readahead = sum(sh.length for layer in range(DEPTH) for sh in s.layer_shards[layer])
    assert readahead > 0, "prefetch should reach streamed layers across the token boundary"
    # Direct reads take a shard's end pages whole, and skip one a neighbour already holds.
    shards_read = TOKENS * sum(len(shards) for shards in s.layer_shards) + sum(len(s.layer_shards[layer]) for layer in range(DEPTH))
    slack = 2 * os.sysconf("SC_PAGE_SIZE") * shards_read if s.placer is not None else 0
    assert abs(counted["bytes_read"] - (TOKENS * s.streamed_bytes_per_token + readahead)) <= slack

    # The stretches cover the counters exactly once: idle before, tokens, tail, idle after.
    stretches = [request["idle"], *tokens, end["tail"], close["idle"]]
    for key in ("bytes_read", "bytes_from_cache", "hits", "misses", "prefetch_issued", "prefetch_used", "prefetch_wasted"):
        assert sum(part[key] for part in stretches) == counted[key], key
    assert request["idle"]["bytes_read"] == 0  # nothing was in flight before the request
    assert sum(t["stall_s"] for t in stretches) == pytest.approx(counted["stall_s"], abs=1e-4)
    per_pass = sum(len(shards) for shards in s.layer_shards)
    assert sum(t["hits"] + t["misses"] for t in tokens) == TOKENS * per_pass

    # The read records are the same bytes, one by one, all issued by this request.
    assert sum(r["bytes"] for r in reads) == counted["bytes_read"]
    streamed = {sh.index: sh.layer for shards in s.layer_shards for sh in shards}
    for r in reads:
        assert r["req"] == gen.id and r["expert"] is None and streamed[r["shard"]] == r["layer"]
        assert r["start_s"] >= 0 and r["dur_s"] >= 0
    # compute is measured (time inside llama_decode less the stall), not derived from the wall:
    # what is left, sampling, detokenizing and Python, shows as "other".
    for t in tokens:
        assert 0 < t["compute_s"] <= t["wall_s"] - t["stall_s"] + 2e-6
    assert sum(t["wall_s"] - t["stall_s"] - t["compute_s"] for t in tokens) > 0


def test_summarize_and_compare_recorded_runs(engine, tmp_path, capsys):
    a, b = tmp_path / "depth4.jsonl", tmp_path / "depth1.jsonl"
    traced_request(engine, a)
    engine.retune(prefetch_depth=1)
    try:
        traced_request(engine, b)
    finally:
        engine.retune(prefetch_depth=DEPTH)

    assert main(["trace", "summarize", str(a), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert set(summary) == {"files", "models", "settings", "requests", "overall", "slowest"}
    assert summary["models"] == ["dense.gguf"] and summary["settings"][0]["prefetch_depth"] == DEPTH
    (req,) = summary["requests"]
    records = records_of(a)
    tokens = [r for r in records if r["type"] == "token"]
    (end,) = [r for r in records if r["type"] == "end"]
    assert req["tokens"] == TOKENS and req["finish"] == "length" and req["streamed"] is True
    assert req["ttft_s"] == tokens[0]["wall_s"]
    assert req["bytes_read"] == sum(t["bytes_read"] for t in tokens) + end["tail"]["bytes_read"]
    assert req["bytes_per_token"] == req["bytes_read"] / TOKENS
    assert req["hit_rate"] == req["hits"] / (req["hits"] + req["misses"])
    assert req["io_wait_s"] + req["compute_s"] + req["other_s"] == pytest.approx(req["wall_s"], abs=1e-5)
    assert req["p50_s"] <= req["p95_s"]
    assert req["reads"]["count"] == sum(1 for r in records if r["type"] == "read")
    slow = summary["slowest"]
    assert 1 <= len(slow) <= 5 and all(t["i"] > 0 for t in slow)
    assert [t["wall_s"] for t in slow] == sorted((t["wall_s"] for t in slow), reverse=True)
    assert {t["why"] for t in slow} <= {"stall-dominated", "compute-dominated"}

    assert main(["trace", "summarize", str(a)]) == 0
    text = capsys.readouterr().out
    assert "settings: budget 160.0 MiB" in text and "prefetch 4" in text
    assert gen_line(text, "req-") and gen_line(text, "overall") and "slowest decode tokens" in text

    assert main(["trace", "compare", str(a), str(b), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    settings = {s["key"]: s for s in result["settings"]}
    assert settings["prefetch_depth"]["a"] == DEPTH and settings["prefetch_depth"]["b"] == 1
    assert settings["prefetch_depth"]["differs"] and not settings["budget"]["differs"]
    assert [m["key"] for m in result["metrics"]] == [m[0] for m in METRICS]
    for m in result["metrics"]:
        assert m["verdict"] in (None, "better", "worse") and (m["verdict"] is None or m["matters"])
    tokens_row = next(m for m in result["metrics"] if m["key"] == "tokens")
    assert tokens_row["a"] == tokens_row["b"] == TOKENS and tokens_row["change"] == 0

    assert main(["trace", "compare", str(a), str(b)]) == 0
    text = capsys.readouterr().out
    assert "\x1b[" not in text  # piped: no colour codes, the arrows and words carry the meaning
    assert "≠" in gen_line(text, "prefetch depth") and "≠" not in gen_line(text, "budget")
    assert gen_line(text, "tokens").split()[1:] == ["8", "8", "=", "0.0%"]


def test_bench_measures_both_ways_on_the_engine(engine, tmp_path):
    from kimitui.trace.bench import measure

    result = measure(engine, rounds=2, tokens=3, trace_dir=tmp_path)
    assert len(result["off_ms_per_token"]) == len(result["on_ms_per_token"]) == 2
    assert sorted(p.name for p in tmp_path.glob("round-*.jsonl")) == ["round-0.jsonl", "round-1.jsonl"]
    # Every token of this model streams: read records and writer time come with each.
    assert result["reads_per_token"] > 0 and result["writer_us_per_token"] > 0
    assert result["trace_bytes_per_token"] > 0


def gen_line(text: str, start: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(start))


def test_model_not_streamed_writes_null_not_zero(model_path, tmp_path, capsys):
    engine = Engine(model_path, n_ctx=256)
    engine.load()
    try:
        assert engine.streamer is None
        gen, _, _ = traced_request(engine, tmp_path / "plain.jsonl", tokens=3)
    finally:
        engine.close()
    records = records_of(tmp_path / "plain.jsonl")
    tokens = [r for r in records if r["type"] == "token"]
    assert len(tokens) == gen.result.completion_tokens == 3
    for t in tokens:
        assert 0 < t["compute_s"] <= t["wall_s"]  # measured in llama_decode, streamed or not
        assert all(t[k] is None for k in COUNTERS)
    (end,) = [r for r in records if r["type"] == "end"]
    assert end["tail"] is None and not any(r["type"] == "read" for r in records)
    assert main(["trace", "summarize", str(tmp_path / "plain.jsonl"), "--json"]) == 0
    (req,) = json.loads(capsys.readouterr().out)["requests"]
    assert req["streamed"] is False and req["hit_rate"] is None and req["bytes_per_token"] is None
    assert req["ttft_s"] == tokens[0]["wall_s"]


# -- without an engine: the writer driven directly -----------------------------------------

SHARD = Shard(index=5, file=0, offset=0, length=4 * MIB, tensor_bytes=4 * MIB, layer=2, routed=False, tensors=())


def drive(writer: TraceWriter, request_id: str, tokens: int, reads_per_token: int = 3) -> None:
    """One request as the engine would report it: counters grow by a fixed step per token."""
    counters = {k: 0 for k in COUNTERS}
    writer.request_started(request_id, "fake.gguf", {"budget": 1, "streaming": True})
    for i in range(tokens):
        for _ in range(reads_per_token):
            writer.read(SHARD, 0, MIB, time.perf_counter(), 0.001)
        after = {k: v + (0.002 if k == "stall_s" else 1) for k, v in counters.items()}
        after["bytes_read"] = counters["bytes_read"] + reads_per_token * MIB
        writer.token(request_id, i, 0.01, counters, after, 0.009)
        counters = after
    writer.request_finished(request_id, GenerationResult(finish_reason="length", completion_tokens=tokens))


def test_rotation_by_size_keeps_n_files_each_readable(tmp_path):
    path = tmp_path / "trace.jsonl"
    writer = TraceWriter(path, max_bytes=8 * 1024, keep=2)
    drive(writer, "req-1", tokens=200)
    writer.close()
    files = [rotated_path(path, 2), rotated_path(path, 1), path]
    assert all(f.exists() for f in files) and not rotated_path(path, 3).exists()
    parts = []
    for f in files:
        records = records_of(f)
        assert records[0]["type"] == "session" and records[0]["session"] == writer.session
        parts.append(records[0]["part"])
        assert f.stat().st_size < 8 * 1024 + 512  # one record past the limit at most
        # Rotated mid-request: the request starts over in each file, so each reads on its own.
        assert records[1]["type"] == "request" and records[1]["id"] == "req-1"
        read_trace([f])
    assert parts == sorted(parts) and parts[-1] > 2
    assert records_of(rotated_path(path, 1))[1]["continued"] is True
    # Read together, oldest first, the kept files give one request, tokens in order, no gaps.
    (req,) = read_trace(files).requests
    indexes = [t["i"] for t in req.tokens]
    assert indexes == list(range(indexes[0], 200)) and req.end["completion_tokens"] == 200

    # A new run starts a new file; the last run's becomes trace.1.jsonl.
    second = TraceWriter(path, keep=2)
    second.close()
    assert records_of(rotated_path(path, 1))[-1]["type"] == "close"
    assert records_of(path)[0]["session"] == second.session != writer.session


def test_expert_reads_name_the_expert(tmp_path):
    from kimitui.engine.experts import ExpertUnit
    from kimitui.model.gguf_map import ByteRange

    writer = TraceWriter(tmp_path / "moe.jsonl")
    writer.request_started("req-1", "moe.gguf", {})
    unit = ExpertUnit(layer=3, expert=17, ranges=(ByteRange(1, 4096, 1000), ByteRange(1, 9000, 1000)))
    writer.read(unit, 4096, 1000, time.perf_counter(), 0.002)
    writer.close()
    (read,) = [r for r in records_of(tmp_path / "moe.jsonl") if r["type"] == "read"]
    assert (read["expert"], read["shard"], read["layer"], read["file"], read["bytes"]) == (17, None, 3, 1, 1000)


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full, a device that is always full")
def test_a_full_drive_stops_the_trace_not_the_reply():
    writer = TraceWriter("/dev/full")
    drive(writer, "req-1", tokens=2)  # the request's end flushes: the write fails, nothing raises
    writer.close()
    assert writer.error == "trace stopped: cannot write /dev/full: No space left on device"


BAD = [
    ('{"type":"session","v":1,"session":"s","part":0,"t":1}\n{"type":"close","t":2,"idle":null}\nnot json\n', "line 3: not JSON"),
    ('{"type":"request","id":"req-1","t":1,"model":"m","settings":{},"idle":null}\n', "line 1: not a kimitui trace"),
    ('{"type":"session","v":1,"session":"s","part":0,"t":1}\n{"type":"token","req":"req-9","i":0}\n', "line 2: token record lacks 't'"),
    ('{"type":"session","v":1,"session":"s","part":0,"t":1}\n{"type":"end","req":"req-9","t":1,"finish":"stop","error":null,'
     '"prompt_tokens":1,"completion_tokens":1,"prompt_s":0,"decode_s":0,"queued_s":0,"after_s":0,"tail":null}\n',
     "line 2: end record of request 'req-9' before its request record"),
    ('{"type":"session","v":1,"session":"s","part":0,"t":1}\n{"type":"close","t":"soon","idle":null}\n', "line 2: close record: t should be a number"),
    ('{"type":"session","v":9,"session":"s","part":0,"t":1}\n', "line 1: trace format 9 is newer"),
    ("[1, 2]\n", "line 1: not a trace record"),
    ("", "empty: no trace records"),
]


@pytest.mark.parametrize("content,message", BAD)
def test_bad_trace_file_is_one_line_exit_2(tmp_path, capsys, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    assert main(["trace", "summarize", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(path) in err[0] and message in err[0], err


def test_missing_file_and_cut_off_last_line(tmp_path, capsys):
    assert main(["trace", "compare", str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")]) == 2
    assert capsys.readouterr().err.strip() == f"kimitui: trace file not found: {tmp_path / 'a.jsonl'}"
    # A writer killed mid-line leaves a last line without its newline: skipped with a note.
    path = tmp_path / "cut.jsonl"
    writer = TraceWriter(path)
    drive(writer, "req-1", tokens=4)
    writer.close()
    path.write_text(path.read_text() + '{"type":"read","req":"req-1","sha')
    assert main(["trace", "summarize", str(path), "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["overall"]["tokens"] == 4
    assert "unfinished last record skipped" in captured.err


def test_trace_flag_config_and_default_location(tmp_path, isolated_dirs, monkeypatch):
    settings = resolve_settings(build_parser().parse_args(["--trace", str(tmp_path / "run.jsonl")]))
    assert settings["trace.enabled"] is True and settings.origin("trace.path") == "--trace"
    writer = open_trace(settings, [])
    assert writer is not None and writer.path == tmp_path / "run.jsonl"
    writer.close()
    default = resolve_settings(build_parser().parse_args([]))
    assert open_trace(default, []) is None  # off unless asked for
    assert default_trace_path().is_relative_to(isolated_dirs / "state")  # the user log dir
    assert default_trace_path().name == "trace.jsonl"

    # Devices by injection: the model's drive (2) is refused, the system drive (1) is not.
    import kimitui.trace as trace_module

    devices = {tmp_path / "ssd": 2}
    monkeypatch.setattr(trace_module, "_device", lambda p: next((d for root, d in devices.items() if p.is_relative_to(root)), 1))
    model = tmp_path / "ssd" / "kimi.gguf"
    with pytest.raises(UserError, match="is on the drive the model kimi.gguf streams from"):
        check_not_model_drive(tmp_path / "ssd" / "trace.jsonl", [model], "--trace")
    check_not_model_drive(tmp_path / "home" / "trace.jsonl", [model], "--trace")


async def test_live_views_filter_and_split(tmp_path):
    from textual.app import App
    from textual.widgets import Input, RichLog

    from kimitui.tui.widgets.trace_log import TokenBreakdown, TraceLog

    class Host(App):
        def compose(self):
            yield TraceLog()
            yield TokenBreakdown()

    writer = TraceWriter(tmp_path / "live.jsonl")
    app = Host()
    async with app.run_test(size=(100, 40)) as pilot:
        log, bar = app.query_one(TraceLog), app.query_one(TokenBreakdown)
        writer.subscribe(log.feed)
        writer.subscribe(bar.feed)
        # Records arrive from other threads, as from the engine and its I/O pool.
        thread = threading.Thread(target=lambda: (drive(writer, "req-1", 2), drive(writer, "req-2", 3)))
        thread.start()
        thread.join()
        lines = app.query_one("#trace-lines", RichLog)

        def records_shown() -> int:  # a record's line may wrap; its first line starts with its request
            return sum(1 for strip in lines.lines if strip.text.startswith("req-"))

        async def shows(expected: int) -> bool:
            """The pane drains on a timer: wait (a bounded while) for it to show ``expected``."""
            for _ in range(100):
                if records_shown() == expected:
                    return True
                await pilot.pause(0.05)
            return False

        total = 2 * 2 + (2 + 3) * 4  # request + end each, token + 3 reads per token (the session came before)
        assert await shows(total), records_shown()

        async def filtered(text: str, expected: int) -> bool:
            app.query_one("#trace-filter", Input).value = text
            return await shows(expected)

        assert await filtered("token", 5)
        assert await filtered("token req-2", 3)
        assert await filtered("-read", total - 15)
        assert await filtered("reads req-1", 6)
        assert await filtered("", total)

        bar.drain()  # its timer may not have fired yet
        assert bar.last is not None and bar.last["wall"] == pytest.approx(0.01)
        assert bar.last["stall"] == pytest.approx(0.002)
        parts = bar.last["stall"] + bar.last["overlap"] + bar.last["compute"] + bar.last["other"]
        assert parts == pytest.approx(bar.last["wall"])
        assert bar.last["other"] == pytest.approx(0.001)  # 10 ms wall, 9 ms of it inside llama_decode
        assert "other 1 ms" in bar.render().plain
        assert "stall 2" in bar.render().plain

        # A read in flight for 8 ms of a 10 ms token with 2 ms of stall: 6 ms of I/O hidden
        # behind compute, 2 ms of compute alone.
        bar.feed({"type": "request", "id": "req-3"})
        bar.feed({"type": "read", "start_s": 0.0, "dur_s": 0.008})
        bar.feed({"type": "token", "t": 0.01, "wall_s": 0.01, "stall_s": 0.002, "bytes_read": MIB})
        bar.drain()
        assert bar.last["overlap"] == pytest.approx(0.006) and bar.last["compute"] == pytest.approx(0.002)
        assert "I/O 6" in bar.render().plain and "read 1.0 MiB" in bar.render().plain
    writer.close()


def test_read_records_are_json_whatever_the_fields(tmp_path):
    """Read lines are formatted by hand (hundreds per token): check them against json."""
    from kimitui.engine.experts import ExpertUnit
    from kimitui.model.gguf_map import ByteRange

    seen: list[dict] = []
    writer = TraceWriter(tmp_path / "reads.jsonl")
    writer.subscribe(seen.append)
    writer.request_started('req-"ü"', "fake.gguf", {})
    nonlayer = Shard(index=0, file=0, offset=0, length=MIB, tensor_bytes=MIB, layer=None, routed=False, tensors=())
    expert = ExpertUnit(3, 17, (ByteRange(1, 4096, 100), ByteRange(1, 9000, 100)))
    writer.read(nonlayer, 0, MIB, time.perf_counter(), 1e-7)
    writer.read(expert, 4096, 200, time.perf_counter(), 0.25)
    writer.close()
    reads = [r for r in records_of(tmp_path / "reads.jsonl") if r["type"] == "read"]
    assert [(r["req"], r["shard"], r["expert"], r["layer"], r["file"], r["bytes"]) for r in reads] == [
        ('req-"ü"', 0, None, None, 0, MIB), ('req-"ü"', None, 17, 3, 1, 200),
    ]
    assert [r for r in seen if r["type"] == "read"] == reads  # listeners get the same records


# --- routing against the offline optimum -----------------------------------------------------


def test_belady_is_the_optimum_on_a_known_sequence():
    from kimitui.trace.routing import belady_hits, lfu_hits, lru_hits

    # One expert a choice, two slots: a b c a b c ... LRU always misses; the optimum keeps one.
    groups = [[(0, e)] for e in [0, 1, 2] * 4]
    assert lru_hits(groups, 2) == 0
    assert belady_hits(groups, 2) == 5  # hand-counted: accesses 4, 6, 8, 10 and 12 hit
    # Never better than what fits: with room for all, every reuse hits.
    assert belady_hits(groups, 3) == len(groups) - 3 == lru_hits(groups, 3) == lfu_hits(groups, 3)


def test_belady_never_loses_to_lru_or_lfu_on_random_routing():
    import random

    from kimitui.trace.routing import belady_hits, lfu_hits, lru_hits, static_hits

    rng = random.Random(7)
    groups = [[(layer, e) for e in rng.sample(range(40), 6)] for _ in range(60) for layer in range(3)]
    for slots in (6, 12, 30, 90):
        best = belady_hits(groups, slots)
        assert best >= lru_hits(groups, slots) and best >= lfu_hits(groups, slots)
        assert best >= static_hits(groups, slots)


def test_a_streamed_moe_trace_judges_the_expert_cache(tmp_path):
    """The engine's route records replay through the optimum at the cache's own slot count."""
    from kimitui.engine.generation import Sampling
    from kimitui.engine.session import Engine
    from kimitui.model import synth
    from kimitui.trace.reader import read_trace
    from kimitui.trace.routing import report
    from kimitui.trace.writer import TraceWriter

    spec = synth.plan_like("kimi-k3", None, 0.02, "q4_1", synth.default_tokenizer(), synth.Cut(layers=4))
    model = synth.write_model(spec, tmp_path / "k3.gguf", seed=3, progress=False).paths[0]
    engine = Engine(model, n_ctx=256, budget=24 * 2**20)
    engine.load()
    engine.pin()
    writer = TraceWriter(tmp_path / "trace.jsonl")
    try:
        writer.attach(engine)
        gen = engine.complete("The quick brown fox jumps over the lazy dog", Sampling(temperature=0.0, max_tokens=8))
        list(gen)
    finally:
        writer.close()
        engine.close()
    trace = read_trace([tmp_path / "trace.jsonl"])
    r = report(trace)
    assert r["slots"] == trace.requests[0].settings["expert_slots"] > 0
    assert r["choices"] == len(trace.requests[0].routes) >= 3 * gen.result.completion_tokens  # 3 MoE layers a token
    assert {x["layer"] for x in trace.requests[0].routes} == {1, 2, 3}
    assert 0 <= r["engine_hit_rate"] <= 1 and r["belady_hit_rate"] >= r["lru_hit_rate"]
    assert r["experts_asked"] == sum(len(x["experts"]) for x in trace.requests[0].routes)
