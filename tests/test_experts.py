"""Expert streaming on a real synthetic deepseek2 MoE: only routed experts are read, tokens
match plain llama.cpp, the heatmap carries over to the next run."""

from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path

import pytest

from kimitui.config import SCHEMA
from kimitui.engine.budget import matrix_footprint
from kimitui.engine.expert_policies import POLICIES_BY_NAME, make_policy
from kimitui.engine.experts import ExpertCache, ExpertUnit, heatmap_path, hot_experts, load_heatmap
from kimitui.engine.generation import Sampling
from kimitui.engine.session import Engine
from kimitui.engine.streaming import StreamSettings
from kimitui.model import synth
from kimitui.model.gguf_map import load_model_map

MIB = 2**20


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("moe") / "moe.gguf"
    spec = synth.plan_moe(200 * MIB, "q4_1", synth.default_tokenizer())
    return synth.write_model(spec, out, seed=11, progress=False).paths[0]


def run(engine: Engine, tokens: int = 8) -> str:
    gen = engine.complete("Once upon a time", Sampling(temperature=0.0, max_tokens=tokens))
    list(gen)
    return gen.result.text


def expert_engine(path: Path, budget_mib: int = 100, policy: str = "lfu", lookahead: bool = False) -> Engine:
    settings = StreamSettings(expert_policy=policy, expert_lookahead=lookahead)
    engine = Engine(path, n_ctx=256, budget=budget_mib * MIB, stream_settings=settings)
    engine.load()
    engine.pin()
    return engine


def arena_engine(path: Path, budget_mib: int = 170) -> Engine:
    """``expert_engine`` where the placer reads slices in place (the arena); skips where it cannot."""
    engine = expert_engine(path, budget_mib)
    placer = engine.streamer.placer
    if placer is None or not placer.reads_in_place:
        engine.close()
        pytest.skip("no arena here (no direct reads)")
    return engine


@pytest.mark.parametrize("policy,lookahead", [("lfu", False), ("lru", False), ("lfu", True)])
def test_only_routed_experts_are_read_and_tokens_match(moe_model, policy, lookahead):
    stock = Engine(moe_model, n_ctx=256, fast_load=False)
    stock.load()
    expected = run(stock)
    stock.close()

    engine = expert_engine(moe_model, policy=policy, lookahead=lookahead)
    try:
        streamer = engine.streamer
        assert streamer is not None and streamer.experts is not None
        routed: set[tuple[int, int]] = set()
        original = streamer.on_experts

        def spy(layer, ids):
            routed.update((layer, e) for e in ids)
            original(layer, ids)

        streamer.on_experts = spy
        if streamer.placer is not None and streamer.placer.direct:
            assert streamer.placer.reads_in_place, "slices of tens of KiB are read into the arena"
        reads: list = []
        streamer.on_read = lambda unit, offset, length, start, seconds: reads.append((unit, offset, length))
        assert run(engine) == expected
        model = load_model_map(moe_model)
        expert_reads = {(u.layer, u.expert) for u, _, _ in reads if isinstance(u, ExpertUnit)}
        assert expert_reads, "a budget this small must read experts"
        x = streamer.experts
        if lookahead:
            # Read-ahead guesses with the next layer's router (the synthetic routers are F32):
            # most guesses are used; what it read beyond the router's picks is counted as
            # wasted, never silently.
            assert streamer.predictor is not None
            assert x.prefetch_issued > 0 and x.prefetch_used <= x.prefetch_issued
            chance = model.n_expert_used / model.n_expert  # a blind guess's share of used reads
            assert x.prefetch_used >= 3 * chance * x.prefetch_issued, (x.prefetch_used, x.prefetch_issued)
            guessed = expert_reads - routed
            assert x.prefetch_wasted_bytes > 0 or not guessed
            # What a trace records and the prefetch panel shows include the experts read ahead.
            counted = streamer.counters()
            assert counted["prefetch_issued"] >= x.prefetch_issued and counted["prefetch_used"] >= x.prefetch_used
            assert counted["prefetch_wasted"] >= x.prefetch_wasted
            shown = engine.metrics.streaming
            assert shown.prefetch_used >= x.prefetch_used and shown.prefetch_wasted_bytes >= x.prefetch_wasted_bytes
            assert engine.trace_settings()["expert_lookahead"] is True and engine.tuning().expert_lookahead
            return
        assert expert_reads <= routed  # nothing the router did not pick
        # Unrouted experts are read only through a short gap. An expert is read in whole pages
        # (into place, see direct.py), and neighbouring routed slices of a layer as one request,
        # read through gaps of at most the placer's gap_bytes: a request starts and ends on a
        # routed slice's page, and no run of pages without one is wider than that.
        page = os.sysconf("SC_PAGE_SIZE")
        routed_slices = sorted(
            (r.file, r.offset, r.end) for layer, e in routed for r in model.expert_ranges(layer, e)
        )
        gap_most = streamer.placer.gap_bytes if streamer.placer is not None else 0
        for unit, offset, length in reads:
            if not isinstance(unit, ExpertUnit):
                continue
            pages = range(offset // page * page, offset + length, page)
            routed_pages = [any(f == unit.file and lo < at + page and at < hi for f, lo, hi in routed_slices) for at in pages]
            assert routed_pages[0] and routed_pages[-1], (unit, offset)
            unrouted = 0
            for is_routed in routed_pages:
                unrouted = 0 if is_routed else unrouted + page
                assert unrouted <= gap_most, (unit, offset)
        # Each test has a fresh cache dir: every routing decision was counted once, as a hit or a miss.
        assert x.hits + x.misses == sum(sum(row) for row in x.counts)
        assert x.misses >= len(expert_reads)
    finally:
        engine.close()


def test_the_arena_is_the_routed_slices_whole_pages_less_the_pinned_ones(moe_model, monkeypatch):
    from kimitui.engine import streaming

    model = load_model_map(moe_model)
    page = os.sysconf("SC_PAGE_SIZE")
    moe_layer = next(layer for layer in range(model.n_layers) if model.layers[layer].n_expert)
    hot = [ExpertUnit(moe_layer, 3, tuple(model.expert_ranges(moe_layer, 3)))]
    segments = streaming.arena_segments(model, hot, page)
    spans = [(file, lo, hi) for file, pairs in segments.items() for lo, hi in pairs]
    assert spans
    routed = [s for s in model.shards if s.routed]
    for file, lo, hi in spans:
        assert lo % page == 0 and hi % page == 0 and hi > lo
        # inside one run of routed shards: no trunk byte ever lies in the arena
        assert all(any(s.file == file and s.offset <= at < s.offset + s.length for s in routed) for at in range(lo, hi, page))
    held = [(r.file, r.offset // page * page, -(-r.end // page) * page) for r in hot[0].ranges]
    for file, lo, hi in held:
        assert not any(f == file and a < hi and lo < b for f, a, b in spans), "a pinned expert's pages are not the arena's"
    # every other slice's own whole pages are in it
    for e in (0, 1, 5):
        for r in model.expert_ranges(moe_layer, e):
            inner = (-(-r.offset // page) * page + page, r.end // page * page - page)
            if inner[1] > inner[0]:
                assert any(f == r.file and a <= inner[0] and inner[1] <= b for f, a, b in spans)
    # Slices of a huge page or more keep a mapping each (huge pages): no arena.
    monkeypatch.setattr(streaming, "HUGE_ALIGN", 4096)
    assert streaming.arena_segments(model, hot, page) == {}


def _arena_neighbours(engine, moe_model):
    """(streamer, placer, page size, a, b, the page they share): two neighbouring experts' first
    routed slices of the first MoE layer, sharing an end page. Skips where there is no arena."""
    streamer = engine.streamer
    placer = streamer.placer
    if placer is None or not placer.reads_in_place:
        pytest.skip("no arena here (no direct reads)")
    model = load_model_map(moe_model)
    page = os.sysconf("SC_PAGE_SIZE")
    layer = next(layer for layer in range(model.n_layers) if model.layers[layer].n_expert)
    first = next(
        e for e in range(model.n_expert - 1)
        if model.expert_ranges(layer, e)[0].end % page and model.expert_ranges(layer, e)[0].end // page == model.expert_ranges(layer, e + 1)[0].offset // page
    )
    a = ExpertUnit(layer, first, (model.expert_ranges(layer, first)[0],))
    b = ExpertUnit(layer, first + 1, (model.expert_ranges(layer, first + 1)[0],))
    return streamer, placer, page, a, b, a.ranges[0].end // page * page


def test_a_slice_whose_end_page_another_read_brings_waits_for_that_read(moe_model, monkeypatch):
    """In the arena a shared end page reads as zeros until the read that holds it lands: the
    neighbour read after it, even when its own read is done first, is not handed over before."""
    import threading
    import time

    engine = expert_engine(moe_model)
    try:
        streamer, placer, page, a, b, shared = _arena_neighbours(engine, moe_model)
        release = threading.Event()
        read = placer._read

        def slow_for_a(file, views, offset):
            if offset <= shared < offset + sum(len(v) for v in views) and offset < a.ranges[0].end:
                release.wait(10)  # a's read, which brings the shared page
            return read(file, views, offset)

        monkeypatch.setattr(placer, "_read", slow_for_a)
        (a_reads,) = streamer._read_experts([a])
        (b_reads,) = streamer._read_experts([b])
        time.sleep(0.3)
        assert not all(f.done() for f in b_reads), "b's own read is done, but the page it shares with a is not"
        release.set()
        for f in a_reads + b_reads:
            f.result(timeout=10)
        address = engine.mappings[0].address
        with open(moe_model, "rb") as f:
            f.seek(shared)
            assert ctypes.string_at(address + shared, page) == f.read(page)
        for unit in (a, b):
            for r in unit.ranges:
                streamer._release_expert(r)
    finally:
        engine.close()


def test_a_slice_that_found_its_end_page_held_by_a_read_that_then_failed_waits_on_that_failure(moe_model, monkeypatch):
    """In the arena a slice that counted on another read for its shared end page is handed that
    read to wait on even when it has failed since: the wait fails (the page is not there)
    rather than compute reading zeros."""
    import errno
    import threading

    engine = expert_engine(moe_model)
    try:
        streamer, placer, page, a, b, shared = _arena_neighbours(engine, moe_model)
        read, go = placer._read, threading.Event()

        def failing_late(file, views, offset):
            go.wait(10)
            raise OSError(errno.EIO, os.strerror(errno.EIO))

        monkeypatch.setattr(placer, "_read", failing_late)
        (a_reads,) = streamer._read_experts([a])
        assert shared not in streamer._take_edges(list(b.ranges))[0]  # a's read brings it
        go.set()
        with pytest.raises(Exception, match="Input/output error"):
            for f in a_reads:
                f.result(timeout=10)
        monkeypatch.setattr(placer, "_read", read)
        (b_waits,) = streamer._handed([[]], [b.ranges])
        assert set(b_waits) & set(a_reads)
        with pytest.raises(Exception, match="Input/output error"):
            for f in b_waits:
                f.result(timeout=10)
        for unit in (a, b):
            for r in unit.ranges:
                streamer._release_expert(r)
    finally:
        engine.close()


def test_an_end_page_whose_read_failed_is_read_by_the_next_slice_that_needs_it(moe_model, monkeypatch):
    """In the arena a failed read leaves its shared end page unread: a neighbour read after it
    reads the page itself rather than counting on the failed one."""
    import errno

    engine = expert_engine(moe_model)
    try:
        streamer, placer, page, a, b, shared = _arena_neighbours(engine, moe_model)
        read = placer._read

        def failing_for_a(file, views, offset):
            if offset < a.ranges[0].end and offset <= shared < offset + sum(len(v) for v in views):
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            return read(file, views, offset)

        monkeypatch.setattr(placer, "_read", failing_for_a)
        (a_reads,) = streamer._read_experts([a])
        with pytest.raises(Exception, match="Input/output error"):
            for f in a_reads:
                f.result(timeout=10)
        monkeypatch.setattr(placer, "_read", read)
        (b_reads,) = streamer._read_experts([b])
        for f in b_reads:
            f.result(timeout=10)
        address = engine.mappings[0].address
        with open(moe_model, "rb") as f:
            f.seek(shared)
            assert ctypes.string_at(address + shared, page) == f.read(page)
        for unit in (a, b):
            for r in unit.ranges:
                streamer._release_expert(r)
    finally:
        engine.close()


def test_heatmap_pins_hot_experts_next_run(moe_model):
    first = expert_engine(moe_model)
    try:
        run(first)
        model = first.streamer.model
        path = first.heatmap_path(model)
        assert path.exists()
        counts = load_heatmap(path, model.n_layers, model.n_expert)
        assert sum(map(sum, counts)) > 0
    finally:
        first.close()
    second = expert_engine(moe_model)
    try:
        hot = second.streamer.experts.pinned
        assert hot, "the next run pins what the last one used"
        top = hot_experts(model, counts, 10**12)[0]
        assert (top.layer, top.expert) in hot
        run(second)
        assert second.streamer.experts.hits > 0
    finally:
        second.close()
    assert heatmap_path(model, path.parent.parent) == path


def test_cache_evicts_by_policy(moe_model):
    model = load_model_map(moe_model)
    layer = next(i for i, info in enumerate(model.layers) if info.is_moe)
    # room for two experts in whole pages (what an expert takes in memory), not three
    size = max(ExpertUnit(layer, e, tuple(model.expert_ranges(layer, e))).footprint for e in range(3))
    counts = [[0] * model.n_expert for _ in model.layers]
    counts[layer][0] = 100  # expert 0 is popular
    dropped: list[int] = []
    cache = ExpertCache(model, 2 * size, [], counts, lambda unit: [], lambda unit: dropped.append(unit.expert), "lfu")
    cache.ensure(layer, [0])
    cache.ensure(layer, [1])
    cache.ensure(layer, [2])  # over capacity: LFU keeps the popular expert 0
    assert dropped == [1]
    lru = ExpertCache(model, 2 * size, [], [row[:] for row in counts], lambda unit: [], lambda unit: dropped.append(unit.expert), "lru")
    dropped.clear()
    lru.ensure(layer, [0])
    lru.ensure(layer, [1])
    lru.ensure(layer, [2])  # LRU drops the oldest, popular or not
    assert dropped == [0]
    assert lru.misses == 3 and lru.hits == 0
    lru.ensure(layer, [2, 1])
    assert lru.hits == 2


def test_the_experts_one_ask_evicts_go_back_as_one_release(moe_model):
    model = load_model_map(moe_model)
    layer = next(i for i, info in enumerate(model.layers) if info.is_moe)
    size = max(ExpertUnit(layer, e, tuple(model.expert_ranges(layer, e))).footprint for e in range(8))
    counts = [[0] * model.n_expert for _ in model.layers]
    released: list[list[int]] = []
    cache = ExpertCache(
        model, 4 * size, [], counts, lambda unit: [], lambda unit: released.append([unit.expert]), "lru",
        drop_units=lambda units: released.append([u.expert for u in units]),
    )
    cache.ensure(layer, [0, 1, 2, 3])
    assert released == []
    cache.ensure(layer, [4, 5, 6])  # three must go: one release, oldest first
    assert released == [[0, 1, 2]]
    assert cache.resident_bytes <= 4 * size


def test_an_evictions_experts_given_back_in_one_release_leave_no_page_placed_and_the_tokens_stay(moe_model):
    """Through the real streamer: every cached expert evicted by one call goes back in one
    release, after which none of their own pages is placed or resident, each end page they
    shared is held once less for each of them, and the next reply reads them again and gives
    the same tokens."""
    from collections import Counter

    from kimitui.engine.memory import pagemap_resident_bytes

    engine = expert_engine(moe_model)
    try:
        first = run(engine)
        streamer, experts = engine.streamer, engine.streamer.experts
        if streamer.placer is None or not streamer.placer.reads_in_place:
            pytest.skip("no arena here (no direct reads)")
        evicted = len(experts._resident)
        slices = [r for unit in experts._resident.values() for r in unit.ranges]
        assert evicted > 10
        shared = Counter((r.file, edge) for r in slices for edge in streamer._slice_pages(r)[2])
        refs_before = dict(streamer._edge_refs)
        releases = []
        drop_units = experts._drop_units
        experts._drop_units = lambda units: releases.append(len(units)) or drop_units(units)
        capacity, experts.capacity = experts.capacity, 0
        experts._make_room(1, set())
        streamer._dropper.flush()
        assert releases == [evicted] and experts.resident_bytes == 0
        own = [(r.file, streamer._slice_own(r)) for r in slices]
        assert not any(streamer.placer.holds(file, part[0]) for file, part in own if part)
        spans = [(engine.space.at(file, part[0]), engine.space.at(file, part[0] + part[1])) for file, part in own if part]
        assert pagemap_resident_bytes(spans) == 0
        for key, count in shared.items():
            assert streamer._edge_refs.get(key, 0) == refs_before[key] - count
        experts.capacity = capacity
        experts._drop_units = drop_units
        assert run(engine) == first
    finally:
        engine.close()


def test_the_expert_policy_switched_live_keeps_the_capacity(moe_model):
    """Experts made resident under LRU carry no LFU rank: after a switch to LFU they must still
    be the ones evicted, or every read passes the capacity (the budget)."""
    model = load_model_map(moe_model)
    layer = next(i for i, info in enumerate(model.layers) if info.is_moe)
    size = max(ExpertUnit(layer, e, tuple(model.expert_ranges(layer, e))).footprint for e in range(4))
    counts = [[0] * model.n_expert for _ in model.layers]
    counts[layer][0] = 100
    dropped: list[int] = []
    cache = ExpertCache(model, 2 * size, [], counts, lambda unit: [], lambda unit: dropped.append(unit.expert), "lru")
    cache.ensure(layer, [0])
    cache.ensure(layer, [1])
    cache.set_policy("lfu")
    cache.ensure(layer, [2])
    cache.ensure(layer, [3])
    assert cache.resident_bytes <= cache.capacity
    assert dropped == [1, 2] and (layer, 0) in cache.resident_keys()  # the popular one stays
    cache.set_policy("lru")
    cache.ensure(layer, [1])
    assert dropped == [1, 2, 0] and cache.resident_bytes <= cache.capacity  # oldest use first again


def test_the_config_file_takes_every_expert_policy_and_no_other():
    """config.py imports no engine module: its choices are spelled out there, kept in step here."""
    assert sorted(SCHEMA["engine"]["expert_policy"].choices) == sorted(POLICIES_BY_NAME)
    with pytest.raises(ValueError, match="must be one of lfu, lru"):
        make_policy("fifo", {}, [])


def test_lfu_evicts_the_least_used_then_the_least_recent_over_a_long_run(moe_model):
    """The heap-based LFU picks the same victims as a scan over every resident expert would."""
    import random

    model = load_model_map(moe_model)
    layer = next(i for i, layer in enumerate(model.layers) if layer.is_moe)
    # Room for six experts in whole pages, whichever six (an expert's page count varies by one
    # a slice with where it starts), never seven.
    sizes = [ExpertUnit(layer, e, tuple(model.expert_ranges(layer, e))).footprint for e in range(model.n_expert)]
    assert 7 * min(sizes) > 6 * max(sizes)
    counts = [[0] * model.n_expert for _ in model.layers]
    dropped: list[int] = []
    cache = ExpertCache(model, 6 * max(sizes), [], counts, lambda unit: [], lambda unit: dropped.append(unit.expert), "lfu")
    rng = random.Random(1)
    uses: dict[int, int] = {}
    last: dict[int, int] = {}
    resident: set[int] = set()
    tick = 0
    for step in range(400):
        wanted = set(rng.choices(range(model.n_expert), weights=[1 / (e + 1) for e in range(model.n_expert)], k=2))
        expected = []
        for e in sorted(wanted):  # the cache's own order: bookkeeping first, then room per miss
            uses[e] = uses.get(e, 0) + 1
            tick += 1
            if e in resident:
                last[e] = tick
                continue
            if len(resident) == 6:
                victim = min((r for r in resident if r not in wanted), key=lambda r: (uses[r], last[r]))
                resident.discard(victim)
                expected.append(victim)
            resident.add(e)
            last[e] = tick
        dropped.clear()
        cache.ensure(layer, wanted)
        assert dropped == expected, step
    assert cache.resident_keys() == {(layer, e) for e in resident}


def test_look_ahead_never_evicts_the_experts_of_the_layer_computing_now(moe_model):
    model = load_model_map(moe_model)
    moe = [i for i, info in enumerate(model.layers) if info.is_moe]
    layer, following = moe[0], moe[1]
    held = sum(ExpertUnit(layer, e, model.expert_ranges(layer, e)).footprint for e in (0, 1, 2))
    dropped: list[tuple[int, int]] = []
    counts = [[0] * model.n_expert for _ in model.layers]
    cache = ExpertCache(model, held, [], counts, lambda unit: [], lambda unit: dropped.append((unit.layer, unit.expert)), "lfu")
    cache.ensure(layer, [0, 1, 2])  # full: the three experts the layer's matmuls are about to use
    cache.prefetch(following, [5, 6])  # no room but theirs: the look-ahead gives up instead
    assert dropped == [] and {(layer, 0), (layer, 1), (layer, 2)} <= cache.resident_keys()


def test_a_failed_expert_read_stops_the_reply_and_is_read_again_next_time(moe_model, monkeypatch):
    """The drive fails under an expert read: one clear line, nothing half-read kept as cached."""
    import errno

    from kimitui.engine.state import EngineError

    engine = expert_engine(moe_model, budget_mib=60)
    try:
        cache = engine.streamer.experts
        requested: list[tuple[int, int]] = []
        real_read_units, real_preadv = cache._read_units, os.preadv

        def read_units(units):
            requested.extend((unit.layer, unit.expert) for unit in units)
            return real_read_units(units)

        page = os.sysconf("SC_PAGE_SIZE")
        routed = [  # pages wholly inside a routed tensor: its end pages may be a trunk shard's too
        (-(-t.offset // page) * page, (t.offset + t.n_bytes) // page * page)
        for t in load_model_map(moe_model).tensors if t.role == "routed_experts"
    ]

        def failing_preadv(fd, buffers, offset):
            if any(lo <= offset < hi for lo, hi in routed):  # an expert's read, direct or not
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            return real_preadv(fd, buffers, offset)

        cache._read_units = read_units
        monkeypatch.setattr(os, "preadv", failing_preadv)
        gen = engine.complete("Once upon a time", Sampling(temperature=0.0, max_tokens=4))
        with pytest.raises(EngineError, match=r"cannot read expert \d+ of layer \d+ from model file moe\.gguf at byte \d+: Input/output error"):
            list(gen)
        assert gen.result.finish_reason == "error"
        failed = set(requested)
        assert failed and not failed & cache.resident_keys()

        monkeypatch.setattr(os, "preadv", real_preadv)  # the drive is back
        requested.clear()
        assert run(engine, tokens=4)
        assert failed <= set(requested)  # each read again (a request may carry several slices)
    finally:
        engine.close()


PREFILL_PROMPT = "The quick brown fox jumps over the lazy dog while seven wizards quietly juggle " * 3


def stock_texts(path: Path, prompts: list[str], tokens: int) -> list[str]:
    """Plain llama.cpp's greedy replies to ``prompts`` (the model read whole, no streaming)."""
    stock = Engine(path, n_ctx=256, fast_load=False)
    stock.load()
    try:
        texts = []
        for prompt in prompts:
            gen = stock.complete(prompt, Sampling(temperature=0.0, max_tokens=tokens))
            list(gen)
            texts.append(gen.result.text)
        return texts
    finally:
        stock.close()


def prefill_expert_reads(engine: Engine) -> list[tuple[int, int, int]]:
    """The storage requests for experts while the prompt is evaluated: (file, offset, length)."""
    reads: list = []
    engine.streamer.on_read = lambda unit, offset, length, start, seconds: reads.append((unit, offset, length))
    gen = engine.complete(PREFILL_PROMPT, Sampling(temperature=0.0, max_tokens=1))  # prefill, then one sample
    list(gen)
    assert gen.result.prompt_tokens >= 40
    return [(u.file, offset, length) for u, offset, length in reads if isinstance(u, ExpertUnit)]


def test_a_prompts_experts_are_waited_for_matrix_by_matrix_and_stay_cached(moe_model):
    """Where a layer's misses fit the cache, a prompt reads them whole but waits for each routed
    matrix just before its node (the gate computes while up and down arrive): every matrix is
    asked for, the experts stay cached as in decode, and the greedy tokens are stock's."""
    (expected,) = stock_texts(moe_model, [PREFILL_PROMPT], 4)

    engine = expert_engine(moe_model, budget_mib=150)
    try:
        cache = engine.streamer.experts
        deferred: dict[int, set[int]] = {}
        asked: dict[int, set[int]] = {}
        real_defer, real_stage_matrix = cache._defer, cache.stage_matrix

        def defer(layer, missed):
            real_defer(layer, missed)
            deferred[layer] = set(cache._deferred.by_matrix)

        slow = 0.02  # each matrix's wait made long enough to see where its time is counted
        slept = [0.0]

        def stage_matrix(name):
            layer = cache._deferred.layer if cache._deferred is not None else None
            waited = real_stage_matrix(name)
            if waited is not None and layer is not None:
                asked.setdefault(layer, set()).add(cache._matrix_of(layer, name))
                time.sleep(slow)
                slept[0] += slow
                waited += slow
            return waited

        cache._defer, cache.stage_matrix = defer, stage_matrix
        gen = engine.complete(PREFILL_PROMPT, Sampling(temperature=0.0, max_tokens=4))
        list(gen)
        assert gen.result.text == expected
        model = load_model_map(moe_model)
        moe_layers = [i for i, info in enumerate(model.layers) if info.is_moe]
        assert set(deferred) == set(moe_layers), "each MoE layer of the prompt missed experts, waited for by matrix"
        assert asked == deferred, "every matrix's node waited for its own reads"
        assert cache.staged_layers == 0
        assert {key for key in cache.prefill_seen} & cache.resident_keys(), "read whole: cached as usual"
        # A matrix node's wait is streaming work beside the stall, not the cost of asking about nodes.
        streamer = engine.streamer
        assert streamer.eval_observe_s >= streamer.stall_s >= slept[0]
        assert streamer.eval_ask_s < slept[0]
    finally:
        engine.close()


def test_prefill_reads_each_routed_expert_once_when_a_layer_fits(moe_model):
    """A budget whose expert cache holds a whole layer's experts prefills a 40-token prompt as
    one batch: each expert its tokens route to is read once for the prompt, not once per token."""
    engine = expert_engine(moe_model, budget_mib=150)
    try:
        assert engine.n_ubatch == engine.n_batch
        requests = sorted(prefill_expert_reads(engine))
        model = load_model_map(moe_model)
        cache = engine.streamer.experts  # what bench reports: prefill reads against the distinct experts
        per_layer: dict[int, int] = {}
        for layer, _ in cache.prefill_seen:
            per_layer[layer] = per_layer.get(layer, 0) + 1
        assert max(per_layer.values()) > model.n_expert_used  # many tokens, many experts in a layer...
        for (file, offset, length), (next_file, next_offset, _) in zip(requests, requests[1:]):
            assert file != next_file or offset + length <= next_offset  # ...and no byte of them read twice
        # Neighbouring slices of a layer's misses go as one request: fewer requests than slices.
        moe_layer = next(layer for layer, _ in cache.prefill_seen)
        assert len(requests) < len(cache.prefill_seen) * len(model.expert_ranges(moe_layer, 0))
        assert not cache.prefilling and cache.prefill_seen
        # gaps read through between slices are counted as read, apart from the experts' bytes
        assert cache.prefill_read_bytes - cache.prefill_gap_bytes <= len(cache.prefill_seen) * model.bytes_per_expert
    finally:
        engine.close()


def test_prefill_under_a_small_budget_is_cut_to_what_the_cache_holds(moe_model):
    """Below one matrix of each of a layer's experts, a micro-batch is as many tokens as one
    matrix of their experts surely fits in the cache: the cache never holds more than its
    capacity, staged matrices included, and the reply matches the stock run's."""
    (expected,) = stock_texts(moe_model, [PREFILL_PROMPT], 6)

    engine = expert_engine(moe_model, budget_mib=70)
    try:
        cache = engine.streamer.experts
        model = load_model_map(moe_model)
        assert model.n_expert * matrix_footprint(model) > cache.capacity
        assert 1 <= engine.n_ubatch < 40
        assert engine.n_ubatch * model.n_expert_used * matrix_footprint(model) <= cache.capacity
        peak = 0
        real_ensure, real_stage = cache.ensure, cache.stage_matrix

        def ensure(layer, experts):
            nonlocal peak
            waited = real_ensure(layer, experts)
            peak = max(peak, cache.resident_bytes)
            return waited

        def stage_matrix(name):
            nonlocal peak
            waited = real_stage(name)
            peak = max(peak, cache.resident_bytes)
            return waited

        cache.ensure, cache.stage_matrix = ensure, stage_matrix
        gen = engine.complete(PREFILL_PROMPT, Sampling(temperature=0.0, max_tokens=6))
        list(gen)
        assert gen.result.text == expected
        assert cache.staged_layers > 0
        assert 0 < peak <= cache.capacity
    finally:
        engine.close()


def _failed(exc: BaseException | None = None):
    from concurrent.futures import Future

    future = Future()
    if exc is not None:
        future.set_exception(exc)
    return future


@pytest.mark.parametrize("landed_before", [True, False])
def test_a_look_ahead_guess_whose_read_failed_is_read_again_when_routed_to(moe_model, landed_before):
    """A guess is nobody's error: where its read failed (before the layer asked for it, or while
    the layer waited for it) the expert's pages go back and it is read again as a miss, after
    the layer's other misses; the cache's books hold it once."""
    import errno
    import threading
    from concurrent.futures import Future

    model = load_model_map(moe_model)
    layer = next(i for i, info in enumerate(model.layers) if info.is_moe)
    footprint = ExpertUnit(layer, 0, model.expert_ranges(layer, 0)).footprint
    reads, dropped = [], []
    guess = _failed(OSError(errno.EIO, "I/O error") if landed_before else None)

    def read_unit(unit):
        reads.append(("read", unit.expert))
        done = Future()
        done.set_result(unit.length)
        return [done]

    def read_ahead(unit):
        reads.append(("guess", unit.expert))
        return [guess]

    counts = [[0] * model.n_expert for _ in model.layers]
    cache = ExpertCache(model, 8 * footprint, [], counts, read_unit, lambda unit: dropped.append(unit.expert), "lfu", read_ahead=read_ahead)
    cache.prefetch(layer, [5])
    if not landed_before:
        threading.Timer(0.05, lambda: guess.set_exception(OSError(errno.EIO, "I/O error"))).start()
    cache.ensure(layer, [5, 6])
    assert reads == [("guess", 5), ("read", 6), ("read", 5)]
    assert dropped == [5], "the failed guess's pages went back before it was read again"
    both = sum(ExpertUnit(layer, e, model.expert_ranges(layer, e)).footprint for e in (5, 6))
    assert {(layer, 5), (layer, 6)} <= cache.resident_keys() and cache.resident_bytes == both
    assert cache.misses == 2 and cache.hits == 0


def test_a_read_again_that_waited_on_another_failed_guess_goes_round_a_bounded_number_of_times(moe_model):
    """A read again may wait for a shared end page another guess was bringing; where that guess
    fails too, the expert is read once more, and where only guesses keep failing the token stops
    after a few rounds instead of reading for ever."""
    import errno
    from concurrent.futures import Future

    from kimitui.engine.streaming import StreamAbort

    model = load_model_map(moe_model)
    layer = next(i for i, info in enumerate(model.layers) if info.is_moe)
    counts = [[0] * model.n_expert for _ in model.layers]
    footprint = ExpertUnit(layer, 0, model.expert_ranges(layer, 0)).footprint

    def cache_reading(outcomes):
        reads = []

        def read_unit(unit):
            reads.append(unit.expert)
            done = Future()
            outcome = outcomes.pop(0) if outcomes else None
            if outcome is None:
                done.set_result(unit.length)
            else:
                done.set_exception(outcome)
            return [done]

        cache = ExpertCache(
            model, 8 * footprint, [], counts, read_unit, lambda unit: None, "lfu",
            read_ahead=lambda unit: [_failed(OSError(errno.EIO, "I/O error"))], cancel_reads=False,
        )
        cache.prefetch(layer, [5])
        return cache, reads

    cache, reads = cache_reading([StreamAbort("another guess's read failed", guess=True)])
    cache.ensure(layer, [5])
    assert reads == [5, 5] and (layer, 5) in cache.resident_keys()
    always = [StreamAbort("another guess's read failed", guess=True)] * 100
    cache, reads = cache_reading(always)
    with pytest.raises(StreamAbort, match="another guess's read failed"):
        cache.ensure(layer, [5])
    assert len(reads) == ExpertCache.READ_AGAIN_ROUNDS and (layer, 5) not in cache.resident_keys()


def test_a_failed_guess_goes_back_only_once_its_other_reads_are_done(moe_model):
    """A guess is several reads (a slice each, shared end pages): where one failed, its release
    and the read again wait until the others are done too, so no read of the old guess lands on
    pages given back or read anew."""
    import errno
    import threading
    from concurrent.futures import Future

    model = load_model_map(moe_model)
    layer = next(i for i, info in enumerate(model.layers) if info.is_moe)
    events = []
    slow = Future()

    def read_unit(unit):
        events.append("read again")
        done = Future()
        done.set_result(unit.length)
        return [done]

    def land_slowly():
        events.append("last guess read done")
        slow.set_result(0)

    counts = [[0] * model.n_expert for _ in model.layers]
    footprint = ExpertUnit(layer, 0, model.expert_ranges(layer, 0)).footprint
    cache = ExpertCache(
        model, 8 * footprint, [], counts, read_unit, lambda unit: events.append("released"), "lfu",
        read_ahead=lambda unit: [_failed(OSError(errno.EIO, "I/O error")), slow],
    )
    cache.prefetch(layer, [5])
    threading.Timer(0.1, land_slowly).start()
    cache.ensure(layer, [5])
    assert events == ["last guess read done", "released", "read again"]
    assert (layer, 5) in cache.resident_keys()


def test_a_failed_read_again_settles_every_read_before_any_release(moe_model):
    """Where the read again fails too, the token stops; the releases of the expert (in the
    books twice then: the guess and its read again) wait for every read of both."""
    import errno
    import threading
    from concurrent.futures import Future

    from kimitui.engine.streaming import StreamAbort

    model = load_model_map(moe_model)
    layer = next(i for i, info in enumerate(model.layers) if info.is_moe)
    events = []
    slow = Future()

    def read_unit(unit):
        threading.Timer(0.1, lambda: (events.append("last read done"), slow.set_result(0))).start()
        return [_failed(StreamAbort("cannot read expert 5")), slow]

    counts = [[0] * model.n_expert for _ in model.layers]
    footprint = ExpertUnit(layer, 0, model.expert_ranges(layer, 0)).footprint
    cache = ExpertCache(
        model, 8 * footprint, [], counts, read_unit, lambda unit: events.append("released"), "lfu",
        read_ahead=lambda unit: [_failed(OSError(errno.EIO, "I/O error"))],
        cancel_reads=False,  # as in the arena: a read may bring pages others wait for
    )
    cache.prefetch(layer, [5])
    with pytest.raises(StreamAbort, match="cannot read expert 5"):
        cache.ensure(layer, [5])
    assert events[0] == "released" and events[1:] == ["last read done", "released"]
    assert (layer, 5) not in cache.resident_keys() and cache.resident_bytes == 0


def test_a_miss_that_waited_on_a_guess_that_failed_is_read_again_and_its_own_failure_stops_the_token(moe_model):
    """A miss waits for the shared end pages other reads bring: where a guess was bringing one and
    failed, the miss is read again; where the miss's own read failed, the token stops on it."""
    from concurrent.futures import Future

    from kimitui.engine.streaming import StreamAbort

    model = load_model_map(moe_model)
    layer = next(i for i, info in enumerate(model.layers) if info.is_moe)
    failures = {6: [StreamAbort("a guess's read failed", guess=True)], 7: [StreamAbort("cannot read expert 7")] * 2}
    reads = []

    def read_unit(unit):
        reads.append(unit.expert)
        done = Future()
        pending = failures.get(unit.expert)
        if pending:
            done.set_exception(pending.pop())
        else:
            done.set_result(unit.length)
        return [done]

    counts = [[0] * model.n_expert for _ in model.layers]
    footprint = ExpertUnit(layer, 0, model.expert_ranges(layer, 0)).footprint
    cache = ExpertCache(model, 8 * footprint, [], counts, read_unit, lambda unit: None, "lfu")
    cache.ensure(layer, [6])
    assert reads == [6, 6] and (layer, 6) in cache.resident_keys()
    with pytest.raises(StreamAbort, match="cannot read expert 7"):
        cache.ensure(layer, [7])
    assert reads == [6, 6, 7] and (layer, 7) not in cache.resident_keys()


def test_look_ahead_whose_every_read_fails_costs_no_reply(moe_model, monkeypatch):
    """With router look-ahead on, every read on the guess lane fails: the experts it guessed and
    the next token routes to are read again as misses, and the reply gives stock's tokens."""
    import errno
    import threading

    expected = stock_texts(moe_model, [PREFILL_PROMPT], 12)
    engine = expert_engine(moe_model, lookahead=True)
    try:
        streamer, cache = engine.streamer, engine.streamer.experts
        placer = streamer.placer
        if placer is None or not placer.reads_in_place:
            pytest.skip("no arena here (no direct reads)")
        read, failed = placer._read, []

        def failing_on_the_guess_lane(file, views, offset):
            if threading.current_thread().name.startswith("kimitui-guess"):
                failed.append(offset)
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            return read(file, views, offset)

        monkeypatch.setattr(placer, "_read", failing_on_the_guess_lane)
        guessed = set()
        read_ahead = cache._read_ahead
        monkeypatch.setattr(cache, "_read_ahead", lambda unit: (guessed.add((unit.layer, unit.expert)), read_ahead(unit))[1])
        assert not cache.holds_most, "no free-room reads here: every guess is the look-ahead's"
        read_again = []  # routed experts a decoded layer gave back and read again: failed guesses, and misses they tainted
        ensure, forget, routed = cache.ensure, cache._forget, set()

        def watched_ensure(layer, ids):
            ids = list(ids)
            routed.clear()
            routed.update((layer, e) for e in ids)
            return ensure(layer, ids)

        def watched_forget(key):
            if key in routed and not cache.prefilling:
                read_again.append(key)
            forget(key)

        monkeypatch.setattr(cache, "ensure", watched_ensure)
        monkeypatch.setattr(cache, "_forget", watched_forget)
        gen = engine.complete(PREFILL_PROMPT, Sampling(temperature=0.0, max_tokens=12))
        list(gen)
        assert gen.result.error is None and gen.result.text == expected[0]
        assert failed and set(read_again) & guessed, "a guess whose read failed was routed to and read again"
    finally:
        engine.close()


def test_an_expert_read_ahead_and_evicted_is_released_only_after_its_read(moe_model):
    """Evicting an expert whose look-ahead read is still running waits for that read: released
    first, its pages would land afterwards and stay in memory, counted nowhere."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    model = load_model_map(moe_model)
    layer = next(i for i, info in enumerate(model.layers) if info.is_moe)
    size = max(ExpertUnit(layer, e, tuple(model.expert_ranges(layer, e))).footprint for e in (3, 5))  # room for one
    counts = [[0] * model.n_expert for _ in range(model.n_layers)]
    gate = threading.Event()
    events: list[str] = []
    pool = ThreadPoolExecutor(1)

    def slow_read(unit):
        def read():
            gate.wait(5)
            events.append(f"read {unit.expert}")
        return [pool.submit(read)]

    def drop(unit):
        events.append(f"drop {unit.expert}")

    cache = ExpertCache(model, size, [], counts, lambda unit: [], drop, "lru", read_ahead=slow_read)
    cache.prefetch(layer, [3])  # its read is still waiting on the gate
    threading.Timer(0.2, gate.set).start()
    cache.ensure(layer, [5])  # no room: 3 goes, after its read
    assert events == ["read 3", "drop 3"]
    assert cache.resident_bytes <= cache.capacity
    pool.shutdown()


def _arena_flags(engine: Engine, ranges) -> list[tuple[str, int]]:
    """(VmFlags, AnonHugePages kB) of each area of this process over the whole pages of ``ranges``
    of the model (their partial end pages are their neighbours' too)."""
    page = os.sysconf("SC_PAGE_SIZE")
    spans = [(engine.space.at(r.file, -(-r.offset // page) * page), engine.space.at(r.file, r.end // page * page)) for r in ranges]
    out, area, huge = [], None, 0
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                area = (lo, hi) if any(lo < b and a < hi for a, b in spans) else None
            elif area is not None and head == "AnonHugePages:":
                huge = int(line.split()[1])
            elif area is not None and head == "VmFlags:":
                out.append((line, huge))
    return out


def test_a_prompt_routing_to_most_experts_reads_its_layers_whole_with_the_stock_tokens(moe_model):
    """A prompt whose chunk routes to most of each layer's experts reads its MoE layers whole
    (pool pieces moved into the arena, a layer ahead of compute) instead of expert by expert: the
    greedy tokens are stock llama.cpp's, every piece goes back after its layer, the arena allows
    no huge pages again (a slice read there later would fault in 2 MiB), the cache has its room
    back, only the experts decode cached stay in memory (their bytes right), and the next reply
    does it again with the same tokens."""
    from kimitui.engine.memory import pagemap_resident_bytes

    prompts = [PREFILL_PROMPT, "Seven wizards quietly juggle while the lazy dog sleeps and the quick brown fox " * 3]
    expected = stock_texts(moe_model, prompts, 6)

    engine = arena_engine(moe_model)
    try:
        streamer = engine.streamer
        placer, cache = streamer.placer, streamer.experts
        model = load_model_map(moe_model)
        moe_layers = [i for i, info in enumerate(model.layers) if info.is_moe]
        assert sorted(streamer._whole_ranges) == moe_layers and not cache.holds_most  # few experts fit
        capacity = cache.capacity
        whole: list[int] = []
        routed_whole = streamer._routed_whole
        streamer._routed_whole = lambda layer, experts: whole.append(layer) or routed_whole(layer, experts)
        address, page = engine.mappings[0].address, os.sysconf("SC_PAGE_SIZE")
        with open(moe_model, "rb") as f:
            data = f.read()
        layer_ranges = [r for layer in moe_layers for r in streamer._whole_ranges[layer]]
        areas_before = len(_arena_flags(engine, layer_ranges))
        for prompt, text in zip(prompts, expected):
            whole.clear()
            gen = engine.complete(prompt, Sampling(temperature=0.0, max_tokens=6))
            list(gen)
            assert gen.result.text == text
            assert whole == moe_layers  # the prompt's layers, each once; decode read expert by expert
            streamer._dropper.flush()
            assert not streamer._layer_reads and streamer._lent == 0 and cache.capacity == capacity
            assert not cache.whole_layers and not placer._pieces, "every piece back in the pool"
            areas = _arena_flags(engine, layer_ranges)
            assert areas and all(" nh" in flags and huge == 0 for flags, huge in areas)
            assert len(areas) == areas_before, "the pieces' places merged back into the arena's areas"
            assert cache.prefill_read_bytes > cache.prefill_bound_bytes > 0  # read whole: more than the experts used
            assert cache.resident_bytes <= cache.capacity
            # Decode cached experts again, in place; the rest of the layers' pages are given back.
            resident = cache.resident_keys()
            cached_pages = set()
            for (layer, expert) in resident:
                for r in model.expert_ranges(layer, expert):
                    assert ctypes.string_at(address + r.offset, r.length) == data[r.offset : r.end]
                    cached_pages.update(range(r.offset // page * page, r.end, page))
            inner = [(address + -(-r.offset // page) * page, address + r.end // page * page) for r in layer_ranges]
            assert pagemap_resident_bytes(inner) <= len(cached_pages) * page
    finally:
        engine.close()


def test_where_most_experts_fit_a_prompt_reads_into_the_cache_and_decode_starts_with_its_experts(moe_model):
    """Where the cache holds most experts, a prompt's layers are not read whole (each piece went
    back after its layer, and decode read them again): its experts are read once each, into the
    cache, and stay there for decode. Greedy tokens are stock llama.cpp's."""
    expected = stock_texts(moe_model, [PREFILL_PROMPT], 6)
    engine = arena_engine(moe_model, budget_mib=190)
    try:
        streamer, cache = engine.streamer, engine.streamer.experts
        assert streamer._whole_ranges and cache.holds_most
        whole: list[int] = []
        routed_whole = streamer._routed_whole
        streamer._routed_whole = lambda layer, experts: whole.append(layer) or routed_whole(layer, experts)
        gen = engine.complete(PREFILL_PROMPT, Sampling(temperature=0.0, max_tokens=1))
        list(gen)
        assert gen.result.text == expected[0][: len(gen.result.text)]
        assert whole == [], "no layer read whole"
        seen_by_prompt = {key for key in cache.prefill_seen if key not in cache.pinned}
        size = cache.model.layers[next(iter(seen_by_prompt))[0]].expert_bytes
        assert cache.prefill_bound_bytes == len(seen_by_prompt) * size, "one chunk: each expert it used counted once"
        assert cache.prefill_read_bytes - cache.prefill_gap_bytes == cache.prefill_bound_bytes, "each read once (and the gaps between neighbours read through)"
        assert seen_by_prompt <= cache.resident_keys(), "the prompt's experts stay cached"
        assert cache.resident_bytes <= cache.capacity
        gen = engine.complete(PREFILL_PROMPT, Sampling(temperature=0.0, max_tokens=6))
        list(gen)
        assert gen.result.text == expected[0]
    finally:
        engine.close()


def test_a_failed_read_of_a_layer_read_whole_stops_the_reply_with_its_line_and_the_next_one_works(moe_model, monkeypatch):
    """A layer read whole whose read fails ends the reply with the layer and file named; nothing
    of it stays placed, and with the drive back the next reply gives stock llama.cpp's tokens."""
    import errno

    from kimitui.engine.state import EngineError

    (expected,) = stock_texts(moe_model, [PREFILL_PROMPT], 4)

    engine = arena_engine(moe_model)
    try:
        streamer = engine.streamer
        assert not streamer.experts.holds_most  # few experts fit: layers are read whole
        placer = streamer.placer
        layer = sorted(streamer._whole_ranges)[1]
        lo = streamer._whole_ranges[layer][0].offset
        hi = streamer._whole_ranges[layer][-1].end
        read = placer._read

        def failing(file, views, offset):
            if lo <= offset < hi:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            return read(file, views, offset)

        monkeypatch.setattr(placer, "_read", failing)
        gen = engine.complete(PREFILL_PROMPT, Sampling(temperature=0.0, max_tokens=4))
        with pytest.raises(EngineError, match=rf"cannot read the routed experts of layer {layer} from model file moe\.gguf at byte \d+: Input/output error"):
            list(gen)
        assert gen.result.finish_reason == "error"
        monkeypatch.setattr(placer, "_read", read)  # the drive is back
        gen = engine.complete(PREFILL_PROMPT, Sampling(temperature=0.0, max_tokens=4))
        list(gen)
        assert gen.result.text == expected
        streamer._dropper.flush()
        assert not streamer._layer_reads and not placer._pieces
    finally:
        engine.close()


def test_layers_read_whole_for_a_graph_cut_short_go_back_when_the_next_graph_starts(moe_model):
    """A prompt cancelled mid-graph leaves the layers it read ahead whole: the next graph gives
    them back at its start (their room is lent for two layers), and its reply is stock's."""
    (expected,) = stock_texts(moe_model, [PREFILL_PROMPT], 4)

    engine = arena_engine(moe_model)
    try:
        streamer = engine.streamer
        assert not streamer.experts.holds_most  # few experts fit: layers are read whole
        cache = streamer.experts
        cache.prefilling, streamer.chunk_tokens = True, 64  # as a prompt's graph at its first layer
        streamer._read_layers_whole(0)
        left = sorted(streamer._layer_reads)
        assert len(left) == 2 and cache.whole_layers == set(left)
        cache.prefilling = False
        held_at_start: list[int] = []  # layers read whole when the new graph's first layer reads ahead
        read_whole = streamer._read_layers_whole

        def spy(layer):
            if layer == 0:
                held_at_start.append(len(streamer._layer_reads))
            read_whole(layer)

        streamer._read_layers_whole = spy
        gen = engine.complete(PREFILL_PROMPT, Sampling(temperature=0.0, max_tokens=4))
        list(gen)
        assert gen.result.text == expected
        assert held_at_start and held_at_start[0] == 0  # given back before it read two more
        streamer._dropper.flush()
        assert not streamer._layer_reads and not streamer.placer._pieces and streamer._lent == 0
    finally:
        engine.close()


def test_spare_pages_hold_no_more_than_was_lent_and_earmarked():
    """The spare pages fault in what the cache lends them, give each read what it takes (pages
    already faulted in), free what the cache takes back at once, and keep earmarked pages from
    that until ``settle``; what they hold never passes what was lent and earmarked."""
    from kimitui.engine.direct import Libc, SparePages
    from kimitui.engine.memory import pagemap_resident_bytes

    spare, run = SparePages(Libc()), SparePages.RUN

    def bounded() -> bool:
        return spare.held <= spare.allowed + spare.earmarked

    spare.allow(4 * run)
    spare.fill()
    assert spare.held == 4 * run and bounded()
    spare.earmark(2 * run)
    assert (spare.allowed, spare.earmarked) == (2 * run, 2 * run)
    spare.free(2 * run)  # the cache's room back: earmarked pages stay for their reads
    assert spare.held == 2 * run and spare.allowed == 0 and bounded()
    taken = spare.take(3 * run)  # more than is held: what there is
    assert sum(size for _, size in taken) == 2 * run and spare.held == 0 and spare.earmarked == 0
    assert pagemap_resident_bytes([(address, address + size) for address, size in taken]) == 2 * run
    for address, size in taken:
        spare._libc.munmap(address, size)
    spare.allow(3 * run)
    spare.fill()
    spare.earmark(run)
    for address, size in spare.take(run // 2):  # a read took half of its earmark
        spare._libc.munmap(address, size)
    spare.settle()  # its layer is done: the other half goes
    assert spare.earmarked == 0 and spare.held == spare.allowed == 2 * run
    spare.close()
    assert spare.held == spare.allowed == 0


def test_misses_land_on_spare_pages_within_the_cache_with_the_stock_tokens(moe_model, monkeypatch):
    """Once a prompt is evaluated the cache lends its free room to pages faulted in ahead, and a
    decoded token's misses have them moved under their reads: the greedy tokens are stock
    llama.cpp's, the cache's experts and the spare never pass its capacity, the spare never holds
    more than it was given, and the next prompt takes the room back."""
    from kimitui.engine.direct import DirectPlacer
    from kimitui.engine.memory import pagemap_resident_bytes

    page = os.sysconf("SC_PAGE_SIZE")
    monkeypatch.setattr(DirectPlacer, "spare_from", page)  # this model's slices are small
    monkeypatch.setattr(ExpertCache, "SPARE_STEP", 1 * MIB)
    prompts = [PREFILL_PROMPT, "Seven wizards quietly juggle while the lazy dog sleeps"]
    expected = stock_texts(moe_model, prompts, 12)

    engine = arena_engine(moe_model)
    try:
        streamer = engine.streamer
        placer, cache = streamer.placer, streamer.experts
        spare = placer.spare
        moved, broken = [0], []
        take = spare.take
        routed = [
            (engine.space.at(r.file, -(-r.offset // page) * page), engine.space.at(r.file, r.end // page * page))
            for layer in sorted(streamer._whole_ranges) for r in streamer._whole_ranges[layer]
        ]

        def counted(length):
            with spare._changed:  # one view of the spare: reads and the fill change it meanwhile
                if spare.held + spare._filling > spare.allowed + spare.earmarked or spare.earmarked > spare.held:
                    broken.append(("spare", spare.held, spare._filling, spare.allowed, spare.earmarked))
            runs = take(length)
            moved[0] += sum(size for _, size in runs)
            return runs

        monkeypatch.setattr(spare, "take", counted)
        ensure = cache.ensure

        def checked(layer, experts):
            waited = ensure(layer, experts)
            if cache.prefilling:
                return waited
            streamer._dropper.flush()  # evictions' pages gone, as a read that needs their room waits for
            with spare._changed:
                allowed, held, filling = spare.allowed, spare.held, spare._filling
            # The memory, not the books: the routed tensors' resident pages (the cache's experts,
            # the pinned ones' pages left out) and the spare's, within the cache's capacity.
            memory = pagemap_resident_bytes(routed) + held + filling
            if cache.resident_bytes + allowed > cache.capacity or memory > cache.capacity:
                broken.append(("cache", cache.resident_bytes, allowed, held, memory, cache.capacity))
            return waited

        monkeypatch.setattr(cache, "ensure", checked)
        for prompt, text in zip(prompts, expected):
            gen = engine.complete(prompt, Sampling(temperature=0.0, max_tokens=12))
            list(gen)
            assert gen.result.text == text
            assert spare.allowed > 0, "the free room lent once the prompt was evaluated"
        assert moved[0] > 0, "decoded misses took spare pages"
        assert not broken
        cache.begin_prefill()
        assert spare.allowed == spare.held == 0
    finally:
        engine.close()


def test_a_model_of_small_slices_keeps_no_spare_pages(moe_model):
    """Where every expert slice is under DirectPlacer.spare_from no read would take spare pages:
    the cache is given none to fault in."""
    engine = arena_engine(moe_model)
    try:
        streamer = engine.streamer
        assert load_model_map(moe_model).expert_slice_bytes < streamer.placer.spare_from
        assert streamer.experts._spare is None
        run(engine, 4)
        assert streamer.spare_bytes == 0
    finally:
        engine.close()


def test_decoding_reads_the_free_room_full_most_used_first_where_most_experts_fit(moe_model):
    """Where the cache holds most experts, a decoded token's idle link reads experts not cached
    into its free room (``ExpertCache.warm``), the most used first: nothing is evicted for them,
    the cache never passes its capacity, each is counted as read ahead, and the greedy tokens are
    stock llama.cpp's."""
    expected = stock_texts(moe_model, [PREFILL_PROMPT], 16)
    engine = expert_engine(moe_model, budget_mib=190)
    try:
        cache = engine.streamer.experts
        assert 4 * cache.capacity >= 3 * cache._unpinned_bytes, "most experts fit at this budget"
        issued: list[tuple[int, int]] = []
        counts_then: list[list[int]] = []
        evicted_for_it, over, not_oldest = [], [], []
        warm, evict, read_ahead = cache.warm, cache._evict, cache._read_ahead
        warming = [False]

        def watched_warm():
            if cache._warm_order is None:
                counts_then[:] = [list(c) for c in cache.counts]
            before = len(issued)
            warming[0] = True
            try:
                warm()
            finally:
                warming[0] = False
            if cache.resident_bytes > cache.capacity:
                over.append(cache.resident_bytes)
            guesses = set(issued[before:])
            if set(list(cache._resident)[:len(guesses)]) != guesses:
                not_oldest.append(guesses)

        def watched_evict(key):
            if warming[0]:
                evicted_for_it.append(key)
            return evict(key)

        def watched_read_ahead(unit):
            if warming[0]:
                issued.append((unit.layer, unit.expert))
            return read_ahead(unit)

        cache.warm, cache._evict, cache._read_ahead = watched_warm, watched_evict, watched_read_ahead
        gen = engine.complete(PREFILL_PROMPT, Sampling(temperature=0.0, max_tokens=16))
        list(gen)
        assert gen.result.text == expected[0]
        assert issued, "the free room was read into"
        assert cache.prefetch_issued == len(issued)
        assert not evicted_for_it and not over
        ranks = [counts_then[layer][e] for layer, e in issued]
        assert ranks == sorted(ranks, reverse=True), "the most used first"
        assert not not_oldest, "a guess is older than any expert used (LRU's first victim)"
        for _key, _length, futures in cache._warming:
            for f in futures:
                f.result()
        cache._settle_warming()
        assert not cache._warming and not cache._inflight, "reads that landed are no longer under way"
        spare = engine.streamer.placer.spare if engine.streamer.placer is not None else None
        assert spare is None or spare.allowed == spare.held == 0, "the room went to experts, not to pages faulted in ahead"
    finally:
        engine.close()


@pytest.mark.parametrize("budget_mib,depth", [(170, 2), (190, 0)])
def test_nothing_is_read_ahead_into_free_room_where_few_experts_fit_or_read_ahead_is_off(moe_model, budget_mib, depth):
    """A cache that holds few experts would only guess (the README's MoE example stalled longer
    for it), and a prefetch depth of 0 reads nothing it was not asked for."""
    engine = Engine(moe_model, n_ctx=256, budget=budget_mib * MIB, stream_settings=StreamSettings(prefetch_depth=depth))
    engine.load()
    engine.pin()
    try:
        cache = engine.streamer.experts
        assert (4 * cache.capacity < 3 * cache._unpinned_bytes) == (budget_mib == 170)
        list(engine.complete(PREFILL_PROMPT, Sampling(temperature=0.0, max_tokens=8)))
        assert cache.capacity - cache.resident_bytes >= cache._smallest_expert, "free room was left"
        assert cache.prefetch_issued == 0
    finally:
        engine.close()


def test_a_warm_read_that_failed_is_forgotten_and_read_again_when_routed_to(moe_model, monkeypatch):
    """A read into the free room is a guess: where it fails the expert leaves the books and its
    pages go back, and the token that routes to it reads it as a miss, with stock tokens."""
    import errno
    import threading

    expected = stock_texts(moe_model, [PREFILL_PROMPT], 12)
    engine = arena_engine(moe_model, budget_mib=190)
    try:
        cache, placer = engine.streamer.experts, engine.streamer.placer
        read, failed = placer._read, []

        def failing_once_on_the_guess_lane(file, views, offset):
            if not failed and threading.current_thread().name.startswith("kimitui-guess"):
                failed.append(offset)
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            return read(file, views, offset)

        monkeypatch.setattr(placer, "_read", failing_once_on_the_guess_lane)
        forgotten = []
        forget = cache._forget
        monkeypatch.setattr(cache, "_forget", lambda key: (forgotten.append(key), forget(key)))
        gen = engine.complete(PREFILL_PROMPT, Sampling(temperature=0.0, max_tokens=12))
        list(gen)
        assert gen.result.error is None and gen.result.text == expected[0]
        assert failed and forgotten, "the failed guess left the books"
    finally:
        engine.close()
