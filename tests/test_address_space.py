"""The bounded address space (engine/addressing.py): models larger than the address space the
process may take load, stream and give stock llama.cpp's greedy tokens, with `ulimit -v` as
the stand-in for iOS's 63 GiB ceiling."""

from __future__ import annotations

from pathlib import Path

import pytest

from kimitui.engine.addressing import PHANTOM_BASE, Windows, plan_windows
from kimitui.engine.generation import Sampling
from kimitui.engine.platform import HUGE_ALIGN
from kimitui.engine.session import Engine
from kimitui.engine.settings import StreamSettings
from kimitui.engine.state import EngineError
from kimitui.model import synth
from kimitui.model.gguf_map import load_model_map

from helpers import under_limit

GIB = 2**30
MIB = 2**20
PROMPT = "The capital of France"

def stock_tokens(path: Path, prompt: str, n: int) -> list[int]:
    engine = Engine(path, n_ctx=128, fast_load=False)
    engine.load()
    try:
        return [e.token_id for e in engine.complete(prompt, Sampling(temperature=0.0, max_tokens=n)) if e.token_id >= 0]
    finally:
        engine.close()


@pytest.fixture(scope="module")
def dense2(tmp_path_factory) -> Path:
    """A 2 GiB dense model of random weights: 26 layers of 72 MiB, 195 MiB outside the layers."""
    spec = synth.plan_dense(2 * GIB, "q4_1", synth.default_tokenizer())
    out = tmp_path_factory.mktemp("dense2") / "dense2.gguf"
    return synth.write_model(spec, out, seed=7, progress=False).paths[0]


@pytest.fixture(scope="module")
def dense2_stock(dense2) -> list[int]:
    tokens = stock_tokens(dense2, PROMPT, 4)
    assert len(set(tokens)) > 2  # random weights: a reply from zeros read in their place would not match
    return tokens


# -- the plan ------------------------------------------------------------------------------------


def test_each_run_keeps_its_offset_modulo_2_mib_and_slots_hold_the_largest_layer(dense2):
    model = load_model_map(dense2)
    plan = plan_windows(model, GIB, 450 * MIB)
    assert 2 <= plan.n_slots < model.n_layers and plan.total_bytes <= GIB
    for run in plan.fixed + tuple(r for layer in plan.layers for r in layer):
        assert run.place % HUGE_ALIGN == run.lo % HUGE_ALIGN
    assert plan.slot_bytes >= max(layer.n_bytes for layer in model.layers)
    with pytest.raises(EngineError, match=r"windows need .* two layers of .* may be taken"):
        plan_windows(model, plan.fixed_bytes + plan.slot_bytes, 450 * MIB)  # not two layers, whatever the budget


def test_every_tensor_byte_has_one_place_and_layers_that_share_a_slot_share_addresses(dense2, tmp_path):
    import os

    model = load_model_map(dense2)
    plan = plan_windows(model, GIB, 450 * MIB)
    fd = os.open(dense2, os.O_RDONLY)
    windows = Windows(plan, {0: fd}, {0: PHANTOM_BASE})
    try:
        n = windows.n_slots
        first, again = model.layer_tensors(0)[0], model.layer_tensors(n)[0]
        slot = windows.region + plan.fixed_bytes  # slot 0
        for t in (first, again):  # layer n reuses layer 0's slot
            assert slot <= windows.at(0, t.offset) < slot + plan.slot_bytes
        lo, hi = windows.spans()[0]
        for t in model.tensors:
            assert lo <= windows.at(0, t.offset) and windows.at(0, t.offset) + t.n_bytes <= hi
        # A claimed slot reads the layer's own bytes from the file.
        windows.claim(n)
        t = model.layer_tensors(n)[0]
        import ctypes

        assert ctypes.string_at(windows.at(0, t.offset), 64) == os.pread(fd, 64, t.offset)
    finally:
        windows.close()
        os.close(fd)


# -- the engine ------------------------------------------------------------------------------------


def test_a_dense_model_in_a_bound_smaller_than_it_gives_the_stock_greedy_tokens(dense2, dense2_stock):
    engine = Engine(dense2, n_ctx=128, budget=450 * MIB, address_space=GIB)
    engine.load()
    engine.pin()
    try:
        space = engine.space
        assert space.bounded and 2 <= space.n_slots < engine.model_map().n_layers
        assert all(m.phantom and m.address >= PHANTOM_BASE for m in engine.mappings.values())
        tokens = [e.token_id for e in engine.complete(PROMPT, Sampling(temperature=0.0, max_tokens=4)) if e.token_id >= 0]
        assert tokens == dense2_stock
        assert engine.streamer.error is None and space.claims > engine.model_map().n_layers
        # Every weight pointed, then a whole graph ending in the output head found none left: no more asks pay for it.
        assert not engine.pointers.active and engine.pointers.pointed >= len(engine.model_map().tensors)
        # The model's pages stay inside the budget: the store counted once, the windows' pages beside it.
        assert engine.metrics.model_resident_source() <= 450 * MIB
    finally:
        engine.close()


def test_the_next_layers_slot_is_taken_over_beside_compute_with_the_stock_tokens(dense2, dense2_stock, monkeypatch):
    """Mapping a slot again costs the kernel's tear-down of the layer that held it: done on the
    slot lane while the layer before computes, the next layer finds its slot ready."""
    import threading

    claimed_on: list[str] = []
    claim = Windows.claim

    def recorded(self, layer):
        claimed_on.append(threading.current_thread().name)
        claim(self, layer)

    monkeypatch.setattr(Windows, "claim", recorded)
    engine = Engine(dense2, n_ctx=128, budget=450 * MIB, address_space=GIB, stream_settings=StreamSettings(prefetch_depth=0))
    engine.load()
    engine.pin()
    try:
        tokens = [e.token_id for e in engine.complete(PROMPT, Sampling(temperature=0.0, max_tokens=4)) if e.token_id >= 0]
        assert tokens == dense2_stock and engine.streamer.error is None
        on_lane = [name for name in claimed_on if name.startswith("kimitui-slot")]
        # Only a graph's very first layers find their slot untaken: every later claim is the lane's.
        assert len(on_lane) >= len(claimed_on) - engine.space.n_slots and engine.space.claims == len(claimed_on)
    finally:
        engine.close()


def test_under_ulimit_v_smaller_than_the_model_a_dense_model_streams_with_the_stock_tokens(dense2, dense2_stock):
    got = under_limit(dense2, 1900 * MIB, 450 * MIB, PROMPT, 4)
    assert dense2.stat().st_size > got["limit"]
    assert got["bounded"] and got["error"] is None
    assert got["tokens"] == dense2_stock


def test_a_live_budget_change_re_pins_into_a_new_store_and_keeps_the_stock_tokens(dense2, dense2_stock):
    """A re-pin replaces the pinned store: the old one's pages leave every slot (they would stay
    in memory through the memfd otherwise), the next reply takes the slots again."""
    engine = Engine(dense2, n_ctx=128, budget=450 * MIB, address_space=GIB)
    engine.load()
    engine.pin()
    try:
        first = engine.pinned.bytes
        engine.retune(budget=350 * MIB)
        tokens = [e.token_id for e in engine.complete(PROMPT, Sampling(temperature=0.0, max_tokens=4)) if e.token_id >= 0]
        assert tokens == dense2_stock and engine.streamer.error is None
        assert engine.pinned.bytes < first
        assert engine.metrics.model_resident_source() <= 350 * MIB
    finally:
        engine.close()


def test_experts_parked_while_the_windows_are_counted_are_counted_once(dense2, monkeypatch):
    """smaps is read area by area while compute goes on: a cached expert parked meanwhile was
    counted in its slot and again as parked (on the full-size K3, half a GiB over a budget the
    cgroup never saw). The count is taken again when the parked bytes moved during it."""
    from kimitui.engine import memory
    from kimitui.engine.addressing import PinnedStore
    from kimitui.engine.streaming import Streamer

    real, scans, parked = memory.mapped_resident_bytes, [], [0]

    def scanning(spans, **kw):
        found = real(spans, **kw)
        scans.append(found)
        if len(scans) == 1:
            parked[0] += 100 * MIB  # a layer's experts parked mid-scan
        return found

    monkeypatch.setattr(memory, "mapped_resident_bytes", scanning)
    engine = Engine(dense2, n_ctx=128, budget=450 * MIB, address_space=GIB)
    engine.load()
    engine.pin()
    try:
        monkeypatch.setattr(Streamer, "parked_bytes", property(lambda self: parked[0]))
        scans.clear()
        counted = engine.metrics.model_resident_source._read()
        assert len(scans) == 2 and counted == real(engine.space.spans(), shared_name=PinnedStore.NAME) + 100 * MIB
    finally:
        engine.close()
