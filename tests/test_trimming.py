"""Expert trimming (opt-in, lossy): which routes a rule skips, the engine reading only what is
left on a real synthetic MoE, `kimitui quality` measuring the cost, the status bar saying it is on."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fakes import FakeEngine, fake_app
from kimitui.benchmarks.quality import compare
from kimitui.cli import main
from kimitui.engine.experts import ExpertUnit
from kimitui.engine.generation import Sampling
from kimitui.engine.session import Engine
from kimitui.engine.streaming import StreamSettings
from kimitui.engine.trimming import RouteTrimmer, TrimRule, choose_skips, row_skips, shares
from kimitui.model import synth
from kimitui.model.gguf_map import load_model_map
from kimitui.tui.widgets.status import StatusBar

MIB = 2**20
NONE_RESIDENT = np.zeros((1, 4), dtype=bool)


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("moe") / "moe.gguf"
    spec = synth.plan_moe(200 * MIB, "q4_1", synth.default_tokenizer())
    return synth.write_model(spec, out, seed=11, progress=False).paths[0]


def test_a_token_skips_its_light_misses_and_never_its_first_choice_or_a_resident_expert():
    s = shares(np.array([[0.05, 0.5, 0.3, 0.15]]), softmax=False)
    assert np.allclose(s, [[0.05, 0.5, 0.3, 0.15]])
    assert choose_skips(s, NONE_RESIDENT, TrimRule(below=0.1)).tolist() == [[True, False, False, False]]
    resident = np.array([[True, False, False, False]])
    assert not choose_skips(s, resident, TrimRule(below=0.1)).any()
    # Cumulative 0.7: 0.5 then 0.3 reach it; the 0.15 and the 0.05 after them are skipped.
    assert choose_skips(s, NONE_RESIDENT, TrimRule(cumulative=0.7)).tolist() == [[True, False, False, True]]
    # A rule that would skip everything keeps the first choice.
    assert choose_skips(s, NONE_RESIDENT, TrimRule(below=0.5, cumulative=0.05)).tolist() == [[True, False, True, True]]
    # Off: nothing; a row whose weights do not sum above 0: nothing.
    assert not choose_skips(s, NONE_RESIDENT, TrimRule()).any()
    assert not choose_skips(shares(np.zeros((1, 4)), softmax=False), NONE_RESIDENT, TrimRule(below=0.4)).any()
    # Softmax-weighted routers (gpt-oss) gather logits: shares are their softmax.
    assert np.allclose(shares(np.array([[0.0, np.log(3.0)]]), softmax=True), [[0.25, 0.75]])


@pytest.mark.parametrize("softmax", [False, True])
def test_a_decoded_tokens_routing_is_judged_as_a_batchs_row_is(softmax):
    """A lone token's rows take a plain-Python path (numpy's per-call cost would dominate): it
    skips exactly what the batch path skips."""
    rng = np.random.default_rng(7)
    rules = [TrimRule(below=0.1), TrimRule(cumulative=0.6), TrimRule(below=0.05, cumulative=0.8), TrimRule(below=0.3)]
    for _ in range(300):
        k = int(rng.integers(2, 17))
        weights = rng.normal(0, 2, k) if softmax else rng.exponential(1.0, k) ** 2
        resident = rng.random(k) < 0.4
        for rule in rules:
            expected = choose_skips(shares(weights[None, :], softmax), resident[None, :], rule)[0].tolist()
            assert row_skips(weights.tolist(), resident.tolist(), rule, softmax) == expected


def test_a_skipped_route_points_at_the_tokens_first_choice_with_no_weight():
    one = np.array([[7, 3, 9, 1]], dtype=np.int32)
    one_weights = np.array([[0.1, 0.6, 0.25, 0.05]], dtype=np.float32)
    lone = RouteTrimmer(TrimRule(below=0.15))
    assert lone.trim(one, one_weights, lambda experts: [e == 8 for e in experts]) == {3, 9}  # a decoded token's path
    assert one.tolist() == [[3, 3, 9, 3]] and one_weights.tolist()[0] == pytest.approx([0.0, 0.6, 0.25, 0.0])
    assert (lone.routes, lone.routes_skipped, lone.experts_skipped) == (4, 2, 2)
    ids = np.array([[7, 3, 9, 1], [2, 4, 6, 8]], dtype=np.int32)
    weights = np.array([[0.1, 0.6, 0.25, 0.05], [0.4, 0.3, 0.2, 0.1]], dtype=np.float32)
    trimmer = RouteTrimmer(TrimRule(below=0.15))
    kept = trimmer.trim(ids, weights, lambda experts: [e == 8 for e in experts])  # expert 8 is in memory
    assert ids.tolist() == [[3, 3, 9, 3], [2, 4, 6, 8]]
    assert weights.tolist()[0] == pytest.approx([0.0, 0.6, 0.25, 0.0]) and weights[1].tolist() == pytest.approx([0.4, 0.3, 0.2, 0.1])
    assert kept == {2, 3, 4, 6, 8, 9}
    assert (trimmer.routes, trimmer.routes_skipped, trimmer.experts_skipped) == (8, 2, 2)
    softmaxed = RouteTrimmer(TrimRule(below=0.15), softmax_weighted=True)
    logits = np.array([[0.0, 3.0]], dtype=np.float32)
    softmaxed.trim(np.array([[5, 6]], dtype=np.int32), logits, lambda experts: np.zeros(len(experts), dtype=bool))
    assert logits[0, 0] == -np.inf  # the softmax after gathering gives it no weight


def _run(engine: Engine, tokens: int = 12) -> str:
    gen = engine.complete("Once upon a time", Sampling(temperature=0.0, max_tokens=tokens))
    list(gen)
    return gen.result.text


def _streamed(path: Path, rule: TrimRule) -> Engine:
    settings = StreamSettings(expert_trim_below=rule.below, expert_trim_cumulative=rule.cumulative)
    engine = Engine(path, n_ctx=256, budget=100 * MIB, stream_settings=settings)
    engine.load()
    engine.pin()
    return engine


def test_the_engine_reads_only_the_experts_trimming_leaves_and_fewer_bytes(moe_model):
    stock = Engine(moe_model, n_ctx=256, fast_load=False)
    stock.load()
    expected = _run(stock)
    stock.close()

    def streamed_run(rule: TrimRule):
        engine = _streamed(moe_model, rule)
        try:
            kept: set[tuple[int, int]] = set()
            original = engine.streamer.on_experts

            def spy(layer, ids):
                kept.update((layer, e) for e in ids)
                original(layer, ids)

            engine.streamer.on_experts = spy
            reads: list = []
            engine.streamer.on_read = lambda unit, offset, length, start, seconds: reads.append(unit)
            text = _run(engine)
            return text, engine.streamer.counters(), kept, {(u.layer, u.expert) for u in reads if isinstance(u, ExpertUnit)}, engine
        finally:
            engine.close()

    def forget_heatmap(engine: Engine) -> None:
        engine.heatmap_path(load_model_map(moe_model)).unlink(missing_ok=True)  # each run starts with no hot experts

    # A rule that skips nothing leaves llama.cpp's routing alone: stock greedy tokens.
    text, counters, _, _, engine = streamed_run(TrimRule(below=1e-9))
    forget_heatmap(engine)
    assert text == expected
    assert counters["expert_routes"] > 0 and counters["expert_routes_skipped"] == 0
    untrimmed_bytes = counters["expert_bytes_needed"]

    text, counters, kept, read, engine = streamed_run(TrimRule(below=0.2))
    forget_heatmap(engine)
    assert counters["expert_routes_skipped"] > 0 and counters["experts_skipped"] > 0
    assert read and read <= kept  # nothing the trimmed routing does not use is read
    assert counters["expert_bytes_needed"] < untrimmed_bytes
    assert engine.lossy_setting() == "trim <20%"
    shown = engine.metrics.streaming
    assert shown.expert_routes_skipped == counters["expert_routes_skipped"] and shown.expert_routes == counters["expert_routes"]


def test_quality_measures_trimming_with_every_expert_a_miss(moe_model, capsys):
    same = compare(moe_model, moe_model, "Once upon a time there was a cat who lived by the sea.", n_ctx=64, trim=TrimRule(below=1e-9))
    assert same.kl_mean == 0.0 and same.top1_agreement == 1.0 and same.routes_skipped == 0.0
    trimmed = compare(moe_model, moe_model, "Once upon a time there was a cat who lived by the sea.", n_ctx=64, trim=TrimRule(cumulative=0.5))
    assert trimmed.kl_mean > 0.0 and 0.0 < trimmed.routes_skipped < 1.0
    assert main(["quality", "--model", str(moe_model), "--trim-cumulative", "0.5", "--n-ctx", "64"]) == 0
    out = capsys.readouterr().out
    assert "with expert trim >50%, every routed expert counted as a miss" in out and "of the routes skipped" in out


def test_quality_refuses_trimming_a_dense_model_and_a_rule_out_of_range(model_path, moe_model, capsys):
    assert main(["quality", "--model", str(model_path)]) == 2
    assert "give --variant FILE, --trim-below / --trim-cumulative to measure expert trimming, or --speculation-cache" in capsys.readouterr().err
    assert main(["quality", "--model", str(model_path), "--trim-below", "0.05"]) == 2
    assert "no routed experts" in capsys.readouterr().err
    assert main(["quality", "--model", str(moe_model), "--trim-below", "0.9"]) == 2
    assert "--trim-below 0.9: give 0..0.5" in capsys.readouterr().err


async def test_the_status_bar_says_while_trimming_is_on():
    engine = FakeEngine()
    engine.lossy = "trim <5%"
    app = fake_app(engine)
    async with app.run_test(size=(120, 40)) as pilot:
        for _ in range(100):
            await pilot.pause(0.05)
            if app.main.ready:
                break
        assert "trim <5%" in str(app.query_one(StatusBar).render())
    plain = fake_app(FakeEngine())
    async with plain.run_test(size=(120, 40)) as pilot:
        await pilot.pause(0.2)
        assert "trim" not in str(plain.query_one(StatusBar).render())


def test_trimming_is_tuned_live_from_the_strip(moe_model):
    from kimitui.tui.widgets.tuning import ROWS

    below = next(r for r in ROWS if r.field == "expert_trim_below")
    past = next(r for r in ROWS if r.field == "expert_trim_cumulative")
    assert (below.step(0.0, True), below.step(0.07, True), below.step(0.07, False), below.step(0.0, False)) == (0.02, 0.1, 0.05, 0.0)
    assert (past.step(1.0, False), past.step(0.5, False)) == (0.9, 0.5)
    assert (below.show(0.0), below.show(0.05), past.show(1.0), past.show(0.7)) == ("off", "5%", "off", "70%")

    engine = _streamed(moe_model, TrimRule())
    try:
        assert engine.lossy_setting() is None and engine.tuning().expert_trim_cumulative == 1.0
        assert engine.retune(expert_trim_cumulative=0.5) == "applies from the next token"
        assert engine.lossy_setting() == "trim >50%"
        _run(engine, tokens=4)
        assert engine.streamer.trimmer is not None and engine.streamer.counters()["expert_routes_skipped"] > 0
        engine.retune(expert_trim_cumulative=1.0)
        _run(engine, tokens=2)
        assert engine.streamer.trimmer is None and engine.lossy_setting() is None
    finally:
        engine.close()
