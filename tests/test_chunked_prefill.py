"""A prompt whose experts do not fit the budget is still evaluated in large chunks: each routed
matrix of a layer is read for the chunk's experts just before llama.cpp computes it and given
back after, with stock llama.cpp's greedy tokens, the budget holding and the reads bounded."""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from concurrent.futures import Future
from pathlib import Path

import pytest

from kimitui.engine.budget import matrix_footprint, minimum_budget, plan_memory
from kimitui.engine.experts import ExpertCache, StagingError
from kimitui.engine.generation import Sampling
from kimitui.engine.memory import pagemap_resident_bytes
from kimitui.engine.session import Engine
from kimitui.model import synth
from kimitui.model.gguf_map import ROUTED_EXPERTS, load_model_map

from helpers import peak_while

MIB = 2**20
HUGE_PAGE = 2 * MIB
MADV_NOHUGEPAGE = 15
PROMPT = "The quick brown fox jumps over the lazy dog while seven wizards quietly juggle " * 2


@pytest.fixture(scope="module")
def k3_48(tmp_path_factory) -> Path:
    """Kimi K3's graph cut to 4 layers and 48 experts (16 used) at three fiftieths of its widths:
    a 32-token prompt routes to nearly all 48 of a layer, three times what the budget caches."""
    spec = synth.plan_like("kimi-k3", None, 0.06, "q4_1", synth.default_tokenizer(), synth.Cut(layers=4, experts=48))
    out = tmp_path_factory.mktemp("k3c") / "k3c.gguf"
    return synth.write_model(spec, out, seed=11, progress=False).paths[0]


def reply(engine: Engine, tokens: int = 8) -> list[int]:
    gen = engine.complete(PROMPT, Sampling(temperature=0.0, max_tokens=tokens))
    return [event.token_id for event in gen if event.token_id >= 0]


def engine_for(path: Path, budget: int | None = None, n_batch: int = 512) -> Engine:
    engine = Engine(path, n_ctx=256, budget=budget, n_batch=n_batch, fast_load=budget is not None)
    engine.load()
    if budget is not None:
        engine.pin()
        assert engine.streamer is not None and engine.streamer.experts is not None
    return engine


def test_the_plan_prefills_whole_batches_where_one_matrix_of_every_expert_fits(k3_48):
    model = load_model_map(k3_48)
    budget = minimum_budget(model) + 2 * MIB
    plan = plan_memory(model, budget, prefetch_depth=2, n_batch=512)
    cache = plan.expert_bytes - plan.hot_expert_bytes
    assert cache < model.n_expert * model.bytes_per_expert  # the layer's experts do not fit whole
    assert cache >= model.n_expert * matrix_footprint(model)  # one matrix of each of them does
    assert plan.ubatch == 512


@pytest.fixture(scope="module")
def stock_tokens(k3_48) -> list[int]:
    stock = engine_for(k3_48)
    try:
        return reply(stock)
    finally:
        stock.close()


def test_chunked_prefill_gives_stock_and_one_token_greedy_tokens_within_the_budget(k3_48, stock_tokens):
    expected = stock_tokens
    model = load_model_map(k3_48)
    budget = minimum_budget(model) + 2 * MIB

    one_token = engine_for(k3_48, budget, n_batch=1)
    try:
        assert one_token.n_ubatch == 1
        assert reply(one_token) == expected
        one_token_read = one_token.streamer.experts.prefill_read_bytes
        assert one_token.streamer.experts.staged_layers == 0  # one token's experts always fit
    finally:
        one_token.close()

    engine = engine_for(k3_48, budget)
    try:
        assert engine.n_ubatch == 512
        source = engine.metrics.model_resident_source
        peak, tokens = peak_while(source, lambda: reply(engine))
        assert tokens == expected
        experts = engine.streamer.experts
        n_moe = sum(layer.is_moe for layer in model.layers)
        assert experts.staged_layers >= n_moe  # the prompt's one chunk, every MoE layer staged
        # Each distinct expert of the chunk is read at most once, and far less than one token at a time reads.
        assert 0 < experts.prefill_read_bytes - experts.prefill_gap_bytes <= experts.prefill_bound_bytes
        assert experts.prefill_bound_bytes <= n_moe * model.n_expert * model.bytes_per_expert
        assert experts.prefill_read_bytes * 2 < one_token_read
        assert peak <= budget
        assert engine.streamer.error is None
        assert reply(engine) == expected  # and again, from what the first reply left cached
    finally:
        engine.close()


@pytest.fixture(scope="module")
def k3_large_slices(tmp_path_factory) -> Path:
    """Kimi K3's graph cut to one dense and one MoE layer of 24 experts at three fifths of its
    widths: slices of 2.02 MiB, a huge page or more, as at full size (no arena)."""
    spec = synth.plan_like("kimi-k3", None, 0.6, "q4_1", synth.default_tokenizer(), synth.Cut(layers=2, experts=24))
    out = tmp_path_factory.mktemp("k3l") / "k3l.gguf"
    return synth.write_model(spec, out, seed=11, progress=False).paths[0]


@pytest.fixture(scope="module")
def large_slices_stock(k3_large_slices) -> list[int]:
    stock = engine_for(k3_large_slices)
    try:
        return reply(stock, tokens=4)
    finally:
        stock.close()


def test_staged_slices_of_a_huge_page_or_more_page_in_under_compute_with_the_stock_tokens(k3_large_slices, large_slices_stock):
    """A staged matrix's slices are paged into the file mapping in compute order while its node
    computes, and given back behind it, the budget holding; what the page-ins' faults mapped
    about them is given back when the stage ends."""
    model = load_model_map(k3_large_slices)
    budget = minimum_budget(model) + 2 * MIB
    engine = engine_for(k3_large_slices, budget)
    try:
        placer = engine.streamer.placer
        assert placer is not None and not placer.reads_in_place
        peak, tokens = peak_while(engine.metrics.model_resident_source, lambda: reply(engine, tokens=4))
        assert tokens == large_slices_stock
        experts = engine.streamer.experts
        assert experts.staged_layers >= 1
        assert 0 < experts.prefill_read_bytes <= experts.prefill_bound_bytes
        # the staged slices and the trunk the prompt streams, both paged in (so more than the slices)
        assert engine.streamer.paged_in_bytes > experts.prefill_read_bytes
        assert peak <= budget
        assert engine.streamer.error is None
        assert reply(engine, tokens=4) == large_slices_stock
    finally:
        engine.close()


def test_a_prompts_pinned_layers_lend_the_streamed_trunks_room_to_the_stages_with_the_stock_tokens(tmp_path):
    """Where nothing is read ahead and a prompt's layer keeps its trunk pinned, the streamed
    trunk's room (the read pool's) is the expert cache's until a layer whose trunk streams
    starts: here the first MoE layer's experts fit it whole, and the cache is back to its own
    room (its coldest experts evicted) before the trunk streams again; the model's pages stay
    within the budget, and the greedy tokens are stock llama.cpp's."""
    spec = synth.plan_like("kimi-k3", None, 0.6, "q4_1", synth.default_tokenizer(), synth.Cut(layers=4, experts=24))
    path = synth.write_model(spec, tmp_path / "k3l4.gguf", seed=11, progress=False).paths[0]
    stock = engine_for(path)
    try:
        expected = reply(stock, tokens=4)
    finally:
        stock.close()
    model = load_model_map(path)
    budget = minimum_budget(model) + 300 * MIB  # layers 0-1's trunk pinned, 2-3's streamed
    engine = engine_for(path, budget)
    try:
        streamer, experts = engine.streamer, engine.streamer.experts
        capacity = experts.capacity
        lent: list[int] = []
        lend = streamer._lend_idle_window

        def lend_idle_window(layer):
            lend(layer)
            lent.append(streamer._window_lent)

        streamer._lend_idle_window = lend_idle_window
        peak, tokens = peak_while(engine.metrics.model_resident_source, lambda: reply(engine, tokens=4))
        assert streamer.settings.prefetch_depth == 0 and any(lent), "the plan at this budget lends the window"
        assert tokens == expected
        assert peak <= budget
        assert streamer._window_lent == 0 and experts.capacity == capacity and experts.resident_bytes <= capacity
        assert reply(engine, tokens=4) == expected
    finally:
        engine.close()


def test_a_staged_layers_first_matrix_pages_in_from_the_layer_before_with_the_stock_tokens(k3_large_slices, large_slices_stock):
    """A prompt whose chunk will route to most of the next MoE layer's experts starts paging in
    that layer's first matrix when the layer before starts (here the dense first layer), not
    after the router; the stage then computes on those reads, with the stock tokens and the
    budget held."""
    model = load_model_map(k3_large_slices)
    budget = minimum_budget(model) + 2 * MIB
    engine = engine_for(k3_large_slices, budget)
    try:
        experts = engine.streamer.experts
        started: list[tuple[int, int]] = []  # (layer the early read is for, the layer starting)
        taken: list[bool] = []
        read_first, take = experts.read_first_matrices, experts._take_early

        def read_first_matrices(layer, n_tokens, room=None):
            before = experts._early
            read_first(layer, n_tokens, room)
            if experts._early is not None and experts._early is not before:
                started.append((experts._early.layer, layer))

        def take_early(stage):
            early = experts._early
            take(stage)
            taken.append(early is not None and early.layer == stage.layer and all(stage.reads.get(m) for m in early.reads))

        experts.read_first_matrices, experts._take_early = read_first_matrices, take_early
        peak, tokens = peak_while(engine.metrics.model_resident_source, lambda: reply(engine, tokens=4))
        assert tokens == large_slices_stock
        moe = next(i for i, info in enumerate(model.layers) if info.is_moe)
        assert (moe, 0) in started, "read from the dense layer's start"
        assert taken and all(taken), "each staged layer computed its first matrix on the early reads"
        # every early read was handed to a stage or given back, and counted out again
        assert experts._early is None and experts._stage is None
        assert experts.resident_bytes == sum(unit.footprint for unit in experts._resident.values())
        assert peak <= budget
        assert engine.streamer.error is None
        assert reply(engine, tokens=4) == large_slices_stock
    finally:
        engine.close()


def test_a_staged_layers_sweep_gives_back_every_file_page_of_its_routed_tensors_but_the_kept_experts(k3_large_slices):
    """A page-in's faults map the cached pages about it too (fault-around), which its own
    release leaves: the stage's end gives back all of the layer's but the kept experts'."""
    model = load_model_map(k3_large_slices)
    engine = engine_for(k3_large_slices, minimum_budget(model) + 2 * MIB)
    try:
        streamer, page = engine.streamer, os.sysconf("SC_PAGE_SIZE")
        layer = next(i for i, info in enumerate(model.layers) if info.is_moe)
        kept, stray = 3, 7
        assert (layer, kept) not in streamer.experts.resident_keys() | streamer.experts.pinned

        def resident(expert: int) -> int:
            return sum(
                pagemap_resident_bytes([(engine.space.at(r.file, r.offset // page * page), engine.space.at(r.file, r.end))])
                for r in model.expert_ranges(layer, expert)
            )

        # Small pages only: where the page cache holds a 2 MiB folio the kernel may map it whole,
        # and giving back part of such a mapping unmaps all of it (file pages fault in again),
        # which would take the pages this test expects to stay.
        routed = model.routed_tensors(layer)
        lo = min(engine.space.at(t.file, t.offset) for t in routed) // HUGE_PAGE * HUGE_PAGE
        hi = -(-max(engine.space.at(t.file, t.offset + t.n_bytes) for t in routed) // HUGE_PAGE) * HUGE_PAGE
        libc = ctypes.CDLL(None, use_errno=True)
        # ENOMEM: the rounded range passes the mapping's end; the mapped part took the advice.
        if libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), MADV_NOHUGEPAGE) != 0:
            assert ctypes.get_errno() == errno.ENOMEM, os.strerror(ctypes.get_errno())
        for expert in (kept, stray):  # mapped from the page cache, as fault-around leaves them
            for r in model.expert_ranges(layer, expert):
                assert streamer.io.populate(streamer.fds[r.file], streamer._base(r.file, r.offset), r.offset, r.length)
        assert resident(stray) >= model.bytes_per_expert
        # A shared end page a slice still holds may be a placed copy it counts on: left alone.
        held = next(r for r in model.expert_ranges(layer, stray) if r.offset % page)
        edge = held.offset // page * page
        dropped: list[tuple[int, int]] = []
        real_drop = streamer.io.drop

        def drop(fd, mapping_address, offset, length):
            dropped.append((offset, offset + length))
            real_drop(fd, mapping_address, offset, length)

        streamer._edge_refs[(held.file, edge)] = 1
        streamer.io.drop = drop
        try:
            streamer._sweep_layer(layer, {kept})
        finally:
            del streamer._edge_refs[(held.file, edge)]
            streamer.io.drop = real_drop
        # What the sweep gives back never holds the held page or a kept expert's.
        spared = [(edge, edge + page)] + [(r.offset, r.end) for r in model.expert_ranges(layer, kept)]
        assert not [(a, b) for a, b in dropped for c, d in spared if a < d and c < b]
        assert resident(stray) == page
        assert pagemap_resident_bytes([(engine.space.at(held.file, edge), engine.space.at(held.file, edge) + page)]) == page
        assert resident(kept) >= model.bytes_per_expert  # a kept expert's pages are never touched
    finally:
        engine.close()


def test_the_next_layers_residual_attention_scores_are_in_memory_when_a_layer_starts(k3_large_slices, large_slices_stock):
    """llama.cpp scores K3's banked stack with layer L+1's attn_res_score inside layer L: with
    the trunk streamed in the whole-file layout (Linux), those pages are read when layer L
    starts, so compute does not fault them in from the file behind every counter's back."""
    model = load_model_map(k3_large_slices)
    engine = engine_for(k3_large_slices, minimum_budget(model) + 2 * MIB)
    try:
        streamer, page = engine.streamer, os.sysconf("SC_PAGE_SIZE")
        assert not engine.space.bounded and streamer._floating.get(1)  # layer 1's shards stream and hold them
        missing: list[tuple[int, int]] = []
        checked = [0]
        real_start = streamer.on_layer_start

        def on_layer_start(layer: int) -> bool:
            go_on = real_start(layer)
            for _shard, file, offset, length, _name in streamer._floating.get(layer + 1, ()):
                checked[0] += 1
                lo = engine.space.at(file, offset) // page * page
                hi = -(-engine.space.at(file, offset + length) // page) * page
                if pagemap_resident_bytes([(lo, hi)]) != hi - lo:
                    missing.append((layer + 1, offset))
            return go_on

        streamer.on_layer_start = on_layer_start
        assert reply(engine, tokens=4) == large_slices_stock
        assert checked[0] and not missing
    finally:
        engine.close()


def fails_in_one_line_then_recovers(path: Path, stock: list[int], failing, message: str) -> None:
    """A reply whose reads fail where ``failing(model, streamer, offset)`` says (the drive fails
    there) ends in ``message``; with the drive back, the next reply gives ``stock``."""
    from kimitui.engine.state import EngineError

    model = load_model_map(path)
    engine = engine_for(path, minimum_budget(model) + 2 * MIB)
    try:
        io = engine.streamer.io
        real_populate = io.populate

        def failing_populate(fd, address, offset, length):
            if failing(model, engine.streamer, offset):
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            return real_populate(fd, address, offset, length)

        io.populate = failing_populate
        gen = engine.complete(PROMPT, Sampling(temperature=0.0, max_tokens=8))
        with pytest.raises(EngineError, match=message):
            list(gen)
        assert gen.result.finish_reason == "error"
        io.populate = real_populate  # the drive is back
        assert reply(engine, tokens=4) == stock
    finally:
        engine.close()


def test_a_failed_read_of_the_next_layers_scores_ends_the_reply_in_one_line_and_the_next_reply_gives_the_stock_tokens(k3_large_slices, large_slices_stock):
    def under_the_scores(model, streamer, offset) -> bool:
        return offset in {at for _shard, _file, at, _length, _name in streamer._floating[1]}

    fails_in_one_line_then_recovers(
        k3_large_slices, large_slices_stock, under_the_scores,
        r"cannot read blk\.1\.(attn|ffn)_res_score\.weight from model file k3l\.gguf at byte \d+: Input/output error",
    )


def test_a_page_in_that_fails_ends_the_reply_in_one_line_and_the_next_reply_gives_the_stock_tokens(k3_large_slices, large_slices_stock):
    def under_a_staged_slice(model, streamer, offset) -> bool:
        return any(t.offset <= offset < t.offset + t.n_bytes for t in model.tensors if t.role == ROUTED_EXPERTS)

    fails_in_one_line_then_recovers(
        k3_large_slices, large_slices_stock, under_a_staged_slice,
        r"cannot read expert \d+ of layer \d+ from model file k3l\.gguf at byte \d+: Input/output error",
    )


def staged_layer_parts(path: Path):
    """The model's map, its first MoE layer and routed tensor names, and a reader whose reads land
    at once, recording what it read (and a list for what is given back)."""
    model = load_model_map(path)
    layer = next(i for i, info in enumerate(model.layers) if info.is_moe)
    names = [t.name.encode() for t in model.layer_tensors(layer) if t.role == ROUTED_EXPERTS]
    reads: list = []

    def read_unit(unit):
        reads.append(unit)
        done = Future()
        done.set_result(None)
        return [done]

    return model, layer, names, read_unit, reads, []


def test_a_staged_layer_holds_one_matrix_at_a_time_and_fails_loudly_when_one_is_skipped(k3_48):
    """The cache's own steps, on the real model's map, with reads that land at once."""
    model, layer, names, read_unit, reads, drops = staged_layer_parts(k3_48)
    capacity = 20 * model.bytes_per_expert  # 20 whole experts, 60 matrices: one matrix of each of 48
    cache = ExpertCache(model, capacity, [], [[0] * model.n_expert for _ in model.layers], read_unit, drops.append)
    cache.ensure(layer, range(model.n_expert_used))  # 16 cached whole
    assert cache.resident_bytes <= capacity and not cache.staging
    cache.ensure(layer, range(model.n_expert))  # 48: staged
    assert cache.staging
    peak = cache.resident_bytes
    for name in names:
        assert cache.stage_matrix(name) is not None
        peak = max(peak, cache.resident_bytes)
        cache.matrix_done(name)
    assert peak <= capacity
    cache.end_stage(strict=True)
    staged = [u for u in reads if u.matrix is not None]
    # each matrix of each staged expert read once, and every staged slice given back
    assert len(staged) == len({(u.expert, u.matrix) for u in staged})
    assert {u.matrix for u in staged} == set(range(len(names)))
    assert sorted((u.expert, u.matrix) for u in drops if u.matrix is not None) == sorted((u.expert, u.matrix) for u in staged)
    assert cache.resident_bytes <= capacity

    cache.ensure(layer, range(model.n_expert))
    cache.stage_matrix(names[0])
    cache.matrix_done(names[0])
    with pytest.raises(StagingError, match=rf"^layer {layer}: llama.cpp computed the routed experts without asking for 2 of their matrices"):
        cache.end_stage(strict=True)
    assert not cache.staging

    small = ExpertCache(model, 10 * model.bytes_per_expert, [], [[0] * model.n_expert for _ in model.layers], read_unit, drops.append)
    small.ensure(layer, range(model.n_expert))
    with pytest.raises(StagingError, match=rf"^layer {layer}: one matrix of the 48 experts this micro-batch routes to takes .*lower model.n_batch or raise the budget$"):
        for name in names:
            small.stage_matrix(name)
            small.matrix_done(name)


def test_a_matrix_paged_in_does_not_hold_its_node_and_a_page_in_that_failed_stops_the_token(k3_48):
    model, layer, names, read_unit, reads, drops = staged_layer_parts(k3_48)
    paged: list[tuple] = []

    def page_in(units):
        out = []
        for unit in units:
            future = Future()
            paged.append((unit, future))
            out.append([future])
        return out

    sweeps: list = []
    cache = ExpertCache(
        model, 20 * model.bytes_per_expert, [], [[0] * model.n_expert for _ in model.layers], read_unit, drops.append,
        page_in_units=page_in, sweep_layer=lambda layer, kept: sweeps.append((layer, kept)),
    )
    cache.ensure(layer, range(model.n_expert))
    assert cache.staging and paged and not [u for u in reads if u.matrix is not None]
    first = paged[0][0].matrix
    name = next(n for n in names if cache._matrix_of(layer, n) == first)
    # Were the node held for its page-ins, they would land only when this timer fires.
    land = threading.Timer(2.0, lambda: [f.set_result(0) for _, f in paged if not f.done()])
    land.start()
    try:
        assert cache.stage_matrix(name) is not None
        assert not any(f.done() for _, f in paged), "the node waited for its page-ins"
    finally:
        land.cancel()
    for _unit, future in paged[:-1]:
        future.set_result(0)
    paged[-1][1].set_exception(OSError("drive removed"))
    with pytest.raises(OSError, match="drive removed"):
        cache.matrix_done(name)
    assert sorted(u.expert for u in drops if u.matrix == first) == list(range(model.n_expert))  # given back all the same
    assert not sweeps
    cache.end_stage(strict=False)
    assert sweeps == [(layer, set())]  # what the page-ins' faults mapped about them goes too


def test_a_matrix_asked_before_the_one_read_ahead_takes_its_room(k3_48):
    """Converted K3 and DeepSeek files store down, gate, up, and llama.cpp's order is learnt only
    from a whole staged layer: where the cache holds one matrix, the matrix llama.cpp asks for
    first gets the room of one read ahead that it has not asked for yet, which is read again."""
    model, layer, names, read_unit, reads, drops = staged_layer_parts(k3_48)
    one_matrix = model.n_expert * matrix_footprint(model)
    cache = ExpertCache(model, one_matrix + model.bytes_per_expert, [], [[0] * model.n_expert for _ in model.layers], read_unit, drops.append)
    cache.ensure(layer, range(model.n_expert))
    assert cache.staging
    first_read = {u.matrix for u in reads}
    asked = [n for n in names if cache._matrix_of(layer, n) not in first_read] + [n for n in names if cache._matrix_of(layer, n) in first_read]
    peak = 0
    for name in asked:
        assert cache.stage_matrix(name) is not None
        peak = max(peak, cache.resident_bytes)
        cache.matrix_done(name)
    cache.end_stage(strict=True)
    assert peak <= cache.capacity
    given_back_unasked = [u for u in drops if u.matrix in first_read]
    assert given_back_unasked and len([u for u in reads if u.matrix in first_read]) > model.n_expert  # read again
    assert cache.resident_bytes <= cache.capacity and not cache.staging


def test_a_read_waiting_for_a_release_that_a_failures_shield_holds_back_gives_up():
    """Compute may be waiting for that read: it must end, not wait for the end of the token."""
    from kimitui.engine.streaming import Dropper

    dropper = Dropper(lambda r: None, lambda message: None)
    try:
        dropper.pause()  # a failure's shield, raised from an I/O thread
        dropper.later("held back", [object()])
        mark = dropper.mark()
        answers: list[bool] = []
        waiter = threading.Thread(target=lambda: answers.append(dropper.wait_released(mark)), daemon=True)
        waiter.start()
        waiter.join(5.0)
        assert answers == [False]
        dropper.resume()
        assert dropper.wait_released(mark)
    finally:
        dropper.close()


def test_a_prompts_trunk_paging_in_gives_back_the_read_pools_idle_buffers(k3_large_slices, large_slices_stock, monkeypatch):
    """The budget counts the pool as the streamed window's memory: a window paged in through the
    file instead must not sit beside the buffers the last token left idle."""
    model = load_model_map(k3_large_slices)
    engine = engine_for(k3_large_slices, minimum_budget(model) + 2 * MIB)
    try:
        placer = engine.streamer.placer
        assert reply(engine, tokens=4) == large_slices_stock
        with placer._lock:
            idle = len(placer._free[True]) + len(placer._free[False])
        assert idle > 0  # the decoded tokens' trunk was read through the pool
        freed: list[int] = []
        real = placer.free_idle_buffers

        def free_idle_buffers() -> None:
            with placer._lock:
                freed.append(len(placer._free[True]) + len(placer._free[False]))
            real()

        monkeypatch.setattr(placer, "free_idle_buffers", free_idle_buffers)
        assert reply(engine, tokens=4) == large_slices_stock
        assert freed and freed[0] == idle  # the next prompt gave them back as its trunk paged in
    finally:
        engine.close()


def test_a_key_given_back_twice_before_its_first_release_runs_is_released_twice():
    """Each read of a slice holds its shared end pages once: an expert read again and given back
    again before its first release ran must give them back twice, or they stay held for good."""
    from kimitui.engine.streaming import Dropper

    released: list[str] = []
    dropper = Dropper(released.append, lambda message: None)
    try:
        dropper.pause()
        dropper.later(("expert", 1, 2, 0), ["first read"])
        dropper.later(("expert", 1, 2, 0), ["second read"])
        dropper.resume()
        dropper.flush()
        assert released == ["first read", "second read"]
    finally:
        dropper.close()
