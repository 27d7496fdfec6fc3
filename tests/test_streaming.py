"""The streaming engine on a real synthetic model: same tokens as llama.cpp, bytes that add up,
faults that end a reply instead of the process, and the Darwin read/drop path by injection."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import places_reads

from kimitui.engine.platform import (
    F_RDADVISE, F_RDAHEAD, MADV_DONTNEED, MADV_POPULATE_READ, MS_INVALIDATE, POSIX_FADV_DONTNEED, POSIX_FADV_RANDOM,
    POSIX_FADV_WILLNEED, PlatformIO,
)
from kimitui.engine.generation import Sampling
from kimitui.engine.session import Engine
from kimitui.engine.streaming import StreamSettings
from kimitui.model import synth
from kimitui.model.gguf_map import load_model_map

MIB = 2**20
PROMPT = "Once upon a time"
TOKENS = 6


@pytest.fixture(scope="module")
def model(dense) -> Path:
    return dense  # conftest's: the 160 MiB dense model the engine tests share


def greedy(engine: Engine) -> tuple[str, int]:
    gen = engine.complete(PROMPT, Sampling(temperature=0.0, max_tokens=TOKENS))
    list(gen)
    return gen.result.text, gen.result.completion_tokens


@pytest.fixture(scope="module")
def stock_text(model) -> str:
    engine = Engine(model, n_ctx=256, fast_load=False)
    engine.load()
    text, n = greedy(engine)
    engine.close()
    assert n == TOKENS
    return text


def streaming_engine(model: Path, policy: str = "pin-stream", depth: int = 2) -> Engine:
    # A budget far below the model: most layers stream.
    engine = Engine(model, n_ctx=256, budget=150 * MIB, stream_settings=StreamSettings(prefetch_depth=depth, policy=policy))
    engine.load()
    engine.pin()
    return engine


@pytest.mark.parametrize("policy,depth", [("pin-stream", 2), ("lru", 1), ("pin-stream", 0)])
def test_streamed_tokens_match_stock_and_bytes_add_up(model, stock_text, policy, depth):
    engine = streaming_engine(model, policy, depth)
    try:
        s = engine.streamer
        assert s is not None, "the budget should force streaming"
        mm = load_model_map(model)
        assert 0 < engine.pinned.bytes < mm.tensor_bytes
        text, n = greedy(engine)
        assert text == stock_text
        if places_reads():  # shards were placed (a slow machine may spill a little)
            assert s.placer is not None and s.placer._made > 0 and s.page_cache_fallback_bytes < s.bytes_read / 4
        # Every layer's streamed shards are checked once per evaluated batch of tokens.
        per_pass = sum(len(shards) for shards in s.layer_shards)
        passes = n  # the prompt is one batch, then one pass per sampled token but the last
        assert s.hits + s.misses == per_pass * passes
        # Storage bytes: what was read is streamed bytes per pass, plus read-ahead not yet used,
        # less the end pages a neighbour already held (a pinned or resident shard shares them).
        shared = 2 * os.sysconf("SC_PAGE_SIZE") * per_pass * passes if s.placer is not None else 0
        assert s.bytes_read >= s.streamed_bytes_per_token * passes - shared
        assert s.bytes_read <= s.streamed_bytes_per_token * (passes + 1)
        assert s.prefetch_used <= s.prefetch_issued
        if depth == 0:
            assert s.hits == 0 and s.prefetch_issued == 0
        view = engine.metrics.view()["streaming"]
        assert view.cache_hits == s.hits and view.cache_misses == s.misses
        cells = s.residency_by_layer()
        assert len(cells) == mm.n_layers and "pinned" in cells
    finally:
        engine.close()


def test_streaming_leaves_no_trail_of_kernel_mappings(model):
    """Direct reads split llama.cpp's mapping while a piece is placed; given back through the
    same open file, the ranges merge again, so the count of mappings never grows with tokens."""
    engine = streaming_engine(model)
    try:
        placer = engine.streamer.placer
        if not places_reads():
            pytest.skip("no placement on this kernel: the mapping is never split")

        def file_mappings() -> int:
            return sum(1 for line in Path("/proc/self/maps").read_text().splitlines() if line.endswith(str(model)))

        before = file_mappings()
        for _ in range(2):
            greedy(engine)
            engine.streamer._dropper.flush()
            # What is placed now (read ahead for the next token) splits the mapping, two cuts each.
            assert file_mappings() <= before + 2 * len(placer._placed)
    finally:
        engine.close()


def test_whole_pieces_land_on_huge_page_boundaries(model):
    """The load hooks put the model's mapping on a 2 MiB boundary, so a whole 4 MiB piece moves
    in as whole huge pages from a huge-page buffer at the same offset."""
    from kimitui.engine.direct import PIECE_BYTES
    from kimitui.engine.platform import HUGE_ALIGN

    engine = streaming_engine(model)
    try:
        if not sys.platform.startswith("linux"):
            pytest.skip("the alignment is Linux's")
        assert all(m.address % HUGE_ALIGN == 0 for m in engine.mappings.values())
        placer = engine.streamer.placer
        if not places_reads():
            pytest.skip("no placement on this kernel")
        greedy(engine)
        streamer = engine.streamer
        first = next(layer for layer, shards in enumerate(streamer.layer_shards) if shards)
        streamer._prefetch_from(first)  # as at a layer start: read the first streamed layers ahead
        for futures in streamer._futures.values():
            for f in futures:
                f.result()
        placed = list(placer._placed.items())
        whole = [(offset, buf) for (_, offset), (buf, at, length, is_whole) in placed if is_whole]
        assert whole, "some whole pieces should be placed"
        for offset, buf in whole:
            assert offset % PIECE_BYTES == 0 and buf % HUGE_ALIGN == 0
            assert (engine.mappings[0].address + offset) % HUGE_ALIGN == 0
    finally:
        engine.close()


def test_live_tuning_applies_from_the_next_token(model):
    engine = streaming_engine(model, depth=2)
    try:
        s = engine.streamer
        s.reconfigure(prefetch_depth=0, policy="lru")
        assert s.settings.prefetch_depth == 2  # not before the next token starts
        greedy(engine)
        assert s.settings.prefetch_depth == 0 and s.settings.policy == "lru"
        with pytest.raises(ValueError):
            s.reconfigure(policy="fifo")
    finally:
        engine.close()


def test_budget_and_shard_size_apply_from_the_next_token_mid_reply(model, stock_text):
    engine = streaming_engine(model)
    try:
        first = engine.streamer
        pinned_before = engine.pinned.bytes
        gen = engine.complete(PROMPT, Sampling(temperature=0.0, max_tokens=TOKENS))
        seen = []
        for event in gen:
            seen.append((engine.pinned.bytes, engine.streamer))
            if len(seen) == 2:
                assert "next token" in engine.retune(budget=120 * MIB, shard_size=16 * MIB)
        # The third token already ran on the new pinned set and a streamer of 16 MiB shards.
        assert seen[1] == (pinned_before, first)
        assert seen[2][0] != pinned_before and seen[2][1] is not first
        assert len(engine.streamer.model.shards) > len(first.model.shards)  # cut at 16 MiB, not 64
        assert gen.result.text == stock_text  # same greedy tokens across the switch
    finally:
        engine.close()


def test_lowering_the_budget_of_a_model_that_fits_starts_streaming_next_reply(model, stock_text):
    engine = Engine(model, n_ctx=256, budget=2**30)
    try:
        engine.load()
        engine.pin()
        assert engine.streamer is None  # it fits: no eval callback, plain llama.cpp speed
        assert "next reply" in engine.retune(budget=150 * MIB)
        text, _ = greedy(engine)
        assert engine.streamer is not None and engine.streamer.bytes_read > 0
        assert engine.pinned.bytes < 150 * MIB
        assert text == stock_text
    finally:
        engine.close()


def test_a_budget_at_the_minimum_still_pins_the_non_layer_tensors(model, stock_text):
    from kimitui.engine.budget import minimum_budget

    model_map = load_model_map(model)
    engine = Engine(model, n_ctx=256, budget=minimum_budget(model_map))
    try:
        engine.load()
        engine.pin()
        # Working memory and the prefetch window leave nothing, yet what every token reads and
        # the streamer never reads (embeddings, output) is pinned.
        assert engine.pinned.bytes >= model_map.nonlayer_bytes > 0
        text, _ = greedy(engine)
        assert text == stock_text
    finally:
        engine.close()


TRUNCATE_SCRIPT = r"""
import json, os, sys
from pathlib import Path
from kimitui.engine.generation import Sampling
from kimitui.engine.session import Engine
from kimitui.engine.state import EngineError
from kimitui.engine.streaming import StreamSettings
path = Path(sys.argv[1])
engine = Engine(path, n_ctx=256, budget=int(sys.argv[2]), stream_settings=StreamSettings(prefetch_depth=1))
engine.load(); engine.pin()
gen = engine.chat([{"role": "user", "content": "Tell me a story"}], Sampling(temperature=0.0, max_tokens=40))
events, error = 0, None
real = engine.streamer.on_layer_start
def cut_then_start(layer):
    # The SSD goes away mid-reply, at a layer boundary (a cut while a layer computes can still
    # fault inside llama.cpp: see docs/design.md's limits): the file loses its second half.
    if events >= 3 and layer == 2 and path.stat().st_size == full:
        os.truncate(path, full // 2)
    return real(layer)
full = path.stat().st_size
engine.streamer.on_layer_start = cut_then_start
try:
    for event in gen:
        events += 1
except EngineError as exc:
    error = str(exc)
# The app goes on: the engine answers the next request with the same clear error.
try:
    list(engine.complete("Hi", Sampling(max_tokens=2)))
    again = None
except EngineError as exc:
    again = str(exc)
print(json.dumps({"events": events, "error": error, "again": again, "finish": gen.result.finish_reason}))
"""


def test_truncated_file_mid_reply_ends_the_reply_not_the_process(model, tmp_path):
    victim = tmp_path / "victim.gguf"
    victim.write_bytes(model.read_bytes())
    out = subprocess.run(
        [sys.executable, "-c", TRUNCATE_SCRIPT, str(victim), str(150 * MIB)],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]  # no SIGBUS (-7), no traceback
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["events"] >= 3
    assert result["finish"] == "error"
    assert "victim.gguf" in result["error"] and ("truncated" in result["error"] or "ended at byte" in result["error"])
    assert result["again"] and "victim.gguf" in result["again"]


FITS_TRUNCATE_SCRIPT = r"""
import json, os, sys
from pathlib import Path
from kimitui.engine.generation import Sampling
from kimitui.engine.session import Engine
from kimitui.engine.state import EngineError
path = Path(sys.argv[1])
engine = Engine(path, n_ctx=256, budget=2**30)  # fits: no eval callback, no per-layer check
engine.load(); engine.pin()
assert engine.streamer is None
list(engine.complete("Hi", Sampling(temperature=0.0, max_tokens=2)))
os.truncate(path, path.stat().st_size // 2)
try:
    list(engine.complete("Hi", Sampling(temperature=0.0, max_tokens=2)))
    error = None
except EngineError as exc:
    error = str(exc)
print(json.dumps({"error": error}))
"""


def test_truncated_file_of_a_model_that_fits_is_an_error_not_a_crash(model_path, tmp_path):
    victim = tmp_path / "small.gguf"
    victim.write_bytes(model_path.read_bytes())
    out = subprocess.run([sys.executable, "-c", FITS_TRUNCATE_SCRIPT, str(victim)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]  # no SIGBUS (-7)
    error = json.loads(out.stdout.strip().splitlines()[-1])["error"]
    assert error and "small.gguf" in error and "truncated" in error


def test_budget_below_the_minimum_working_set_is_one_line(model):
    proc = subprocess.run(
        [sys.executable, "-m", "kimitui", "--model", str(model), "--budget", "8MiB"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--budget" in lines[0] and "minimum" in lines[0], proc.stderr


class RecordingSyscalls:
    def __init__(self):
        self.calls = []

    def madvise(self, address, length, advice):
        self.calls.append(("madvise", address, length, advice))
        return 0

    def msync(self, address, length, flags):
        self.calls.append(("msync", address, length, flags))
        return 0

    def fadvise(self, fd, offset, length, advice):
        self.calls.append(("fadvise", fd, offset, length, advice))

    def fcntl(self, fd, cmd, arg):
        self.calls.append(("fcntl", fd, cmd, arg))
        return arg


def test_darwin_drop_and_readahead_by_injection():
    calls = RecordingSyscalls()
    io = PlatformIO("darwin", calls)
    page = io.page
    base = 100 * page
    io.advise_read(7, 3 * page + 10, 5 * page)
    io.drop(7, base, 3 * page + 10, 5 * page)  # partial first page is a neighbour's: left alone
    assert io.populate(7, base, 0, page) is False  # no MADV_POPULATE_READ on Darwin: plain reads instead
    kinds = [c[0] for c in calls.calls]
    assert kinds == ["fcntl", "madvise", "msync"]
    assert calls.calls[0][2] == F_RDADVISE
    _, start, length, advice = calls.calls[1]
    assert advice == MADV_DONTNEED and start == base + 4 * page and length == 4 * page
    assert calls.calls[2][3] == MS_INVALIDATE


def test_linux_drop_uses_fadvise():
    calls = RecordingSyscalls()
    io = PlatformIO("linux", calls)
    page = io.page
    io.drop(3, 10 * page, 0, 2 * page)
    assert calls.calls == [("madvise", 10 * page, 2 * page, MADV_DONTNEED), ("fadvise", 3, 0, 2 * page, POSIX_FADV_DONTNEED)]


def test_linux_populate_queues_the_range_before_faulting_it_in():
    calls = RecordingSyscalls()
    io = PlatformIO("linux", calls)
    page = io.page
    assert io.populate(3, 10 * page, page + 8, 4 * page) is True
    assert calls.calls == [
        ("fadvise", 3, page + 8, 4 * page, POSIX_FADV_WILLNEED),  # large requests, not read-ahead windows
        ("madvise", 11 * page, 4 * page + 8, MADV_POPULATE_READ),
    ]


def test_exact_reads_turn_read_ahead_off_per_platform():
    calls = RecordingSyscalls()
    PlatformIO("darwin", calls).exact_reads(7)
    PlatformIO("linux", calls).exact_reads(3)
    assert calls.calls == [("fcntl", 7, F_RDAHEAD, 0), ("fadvise", 3, 0, 0, POSIX_FADV_RANDOM)]


def test_expert_reads_fetch_little_more_than_the_experts(tmp_path):
    """A fault on the mapping would bring the disk's read-ahead window with each expert slice;
    the engine's expert reads go through a descriptor with read-ahead off."""
    from kimitui.benchmarks.common import drop_from_page_cache

    path = tmp_path / "moe.gguf"
    synth.write_model(synth.plan_moe(200 * MIB, "q4_1", synth.default_tokenizer()), path, progress=False)
    drop_from_page_cache(path)
    engine = Engine(path, n_ctx=256, budget=100 * MIB)
    try:
        engine.load()
        engine.pin()
        streamer = engine.streamer
        assert streamer is not None and streamer.experts is not None
        list(engine.complete("The", Sampling(temperature=0.0, max_tokens=4)))
        counters = streamer.counters()
        # Everything read was asked for: the bytes read are the pieces submitted, and the
        # kernel-side page cache of the file holds about what we read plus what we pinned.
        from kimitui.benchmarks.common import cached_bytes

        assert counters["bytes_needed"] > 0
        assert cached_bytes(path) <= 1.25 * (engine.pinned.bytes + counters["bytes_read"]) + 4 * MIB
    finally:
        engine.close()


def test_an_auto_budget_below_the_minimum_working_set_is_one_line(model, monkeypatch, capsys):
    from kimitui.cli import main
    from kimitui.engine import memory

    monkeypatch.setattr(memory, "default_budget", lambda room=None: 8 * MIB)  # a phone with little memory free
    assert main(["--model", str(model)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "budget auto" in err and "below the minimum working set of dense.gguf" in err


def test_live_tuning_refuses_a_budget_below_the_minimum_and_changes_nothing(model):
    from kimitui.engine.state import EngineError

    engine = Engine(model, n_ctx=256, budget=100 * MIB)
    engine.load()
    engine.pin()
    try:
        with pytest.raises(EngineError, match="budget 8.0 MiB is below the minimum working set of dense.gguf"):
            engine.retune(budget=8 * MIB, prefetch_depth=3)
        assert engine.budget == 100 * MIB and engine.stream_settings.prefetch_depth != 3
        assert greedy(engine)[1] > 0  # and it goes on
    finally:
        engine.close()


def test_live_tuning_says_what_each_change_waits_for():
    from kimitui.engine.tuning import PendingTuning, schedule

    cases = [
        (dict(repin=False, streams=True, fits=False, mapped=True, ubatch_changes=True), "applies from the next token", (False, False)),
        (dict(repin=True, streams=True, fits=False, mapped=True, ubatch_changes=False), "after the pinned set is re-read", (True, False)),
        (dict(repin=True, streams=False, fits=False, mapped=True, ubatch_changes=False), "streaming starts on a fresh", (True, True)),
        (dict(repin=True, streams=False, fits=False, mapped=False, ubatch_changes=False), "applies at the next start", (False, False)),
        (dict(repin=True, streams=True, fits=False, mapped=True, ubatch_changes=True), "sized for the new expert cache", (True, True)),
    ]
    for facts, said, (repin, rebuild) in cases:
        pending = PendingTuning()
        facts = dict(facts, fits=lambda v=facts["fits"]: v, ubatch_changes=lambda v=facts["ubatch_changes"]: v)
        assert said in schedule(pending, **facts)
        assert (pending.repin, pending.rebuild) == (repin, rebuild), facts
    pending = PendingTuning(repin=True, rebuild=True)
    assert not pending.due(mid_reply=True) and pending.due(mid_reply=False)  # a fresh context waits for a reply's start
