"""Speculative decoding: drafts from the conversation verified in one pass give the tokens of
plain decoding (a real dense model streamed under a budget; a Kimi K3 whose recurrent state must
take rejected drafts back), read fewer bytes where the text repeats, and are counted."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from helpers import with_added_tokens
from kimitui.engine import speculation
from kimitui.engine.generation import Sampling
from kimitui.engine.session import Engine
from kimitui.engine.speculation import PROBE_AFTER, Acceptance, DraftPlanner, Speculation, lookup
from kimitui.engine.state import EngineError
from kimitui.model import synth

MIB = 2**20
# A task that copies: the reply repeats text the prompt holds, so lookups find it.
TEXT = (
    "The ferry left the harbour a little after six, when the fog had begun to lift from the water and "
    "the gulls were already quarrelling over the fishing boats. Maria stood at the rail with her coat "
    "buttoned to the chin and watched the town shrink behind her."
)
COPY_PROMPT = f"Repeat this text exactly:\n\n{TEXT}\n\nRepeated text:\n\n{TEXT[:40]}"


def test_lookup_drafts_what_followed_the_longest_earlier_ngram():
    assert lookup([1, 2, 3, 4, 5, 9, 1, 2, 3], 4) == ([4, 5, 9, 1], 3)
    assert lookup([7, 1, 2, 8, 1, 2], 2) == ([8, 1], 2)  # the latest occurrence
    assert lookup([1, 2, 3, 9, 2, 3], 3) == ([9, 2, 3], 2)  # a shorter n-gram where the longest has no earlier match
    assert lookup([1, 2, 3, 9, 3], 3) == ([9, 3], 1)  # down to one token
    assert lookup([1, 2, 3, 4], 4) == ([], 0) and lookup([5], 3) == ([], 0)  # nothing repeats; too short
    assert lookup([1, 2, 3, 1, 2], 0) == ([], 0)


def test_the_planner_drafts_where_a_pass_costs_the_trunk_and_not_where_each_token_costs_as_much():
    planner = DraftPlanner(max_drafts=8)
    assert planner.drafts(trunk_bytes=0, token_bytes=0, available=8) == 0  # nothing streams: drafts save no read
    # A dense streamed model, half the drafts kept so far: a few drafts (each costs some compute).
    assert 0 < planner.drafts(trunk_bytes=100, token_bytes=0, available=8) < 8
    assert planner.drafts(trunk_bytes=100, token_bytes=0, available=1) == 1
    # Each token reads as much again as the trunk (K3's experts at scale), half kept: plain is best.
    assert planner.drafts(trunk_bytes=100, token_bytes=100, available=8) == 0
    for _ in range(PROBE_AFTER - 2):
        assert planner.drafts(trunk_bytes=100, token_bytes=100, available=8) == 0
    assert planner.drafts(trunk_bytes=100, token_bytes=100, available=8) == 1  # acceptance measured again
    for _ in range(40):
        planner.drafts(trunk_bytes=100, token_bytes=0, available=8)
        planner.observe(drafted=8, kept=8)
    assert planner.drafts(trunk_bytes=100, token_bytes=0, available=8) == 8  # copying: as many as allowed
    assert 0 < planner.drafts(trunk_bytes=100, token_bytes=100, available=8) <= 8  # now drafting pays even so
    for _ in range(200):  # passes of the same kind (the last drafts() was of it) that kept nothing
        planner.observe(drafted=4, kept=0)
    assert planner.drafts(trunk_bytes=100, token_bytes=10, available=8) == 0


def test_the_planner_learns_apart_what_drafts_after_one_matching_token_and_after_more_are_worth():
    planner = DraftPlanner(max_drafts=8)
    for _ in range(60):  # after one matching token drafts are seldom kept; after more, runs are copied whole
        planner.drafts(trunk_bytes=100, token_bytes=0, available=8, match=1)
        planner.observe(drafted=1, kept=0)
        planner.drafts(trunk_bytes=100, token_bytes=0, available=8, match=3)
        planner.observe(drafted=8, kept=8)
    assert planner.drafts(trunk_bytes=100, token_bytes=0, available=8, match=1) == 0
    assert planner.drafts(trunk_bytes=100, token_bytes=0, available=8, match=4) == 8
    # Half the passes copy a run of 8, half keep nothing: a pass of 8 drafts emits 5 tokens on
    # average and one of a single draft 1.5. One chance per draft, as if independent (8 kept in
    # 9 tried: 0.89), would say 6.0 and 1.9.
    runs = Acceptance()
    for _ in range(60):
        runs.observe(drafted=8, kept=0)
        runs.observe(drafted=8, kept=8)
    assert abs(runs.expected_tokens(8) - 5.0) < 0.3 and abs(runs.expected_tokens(1) - 1.5) < 0.1
    # Until a run has been seen, a draft after a kept one counts as likely as the first.
    fresh = Acceptance()
    for _ in range(60):
        fresh.observe(drafted=1, kept=1)
    assert fresh.expected_tokens(2) > 1 + 0.9 + 0.8


def test_drafts_stop_at_the_end_of_the_context_and_only_those_made_count():
    """generate() drops drafts past the context's last cell: they are never made, so never counted
    as drafted (nor as rejected)."""
    streamed = iter(range(0, 10_000, 100))  # each pass streams 100 bytes of trunk
    tokens = [1, 2, 3, 4, 5, 6, 1, 2, 3]
    speculation = Speculation(DraftPlanner(max_drafts=8), lambda: (next(streamed), 0), n_ctx=len(tokens) + 2)
    assert speculation(np.asarray(tokens[:-1])).tolist() == []  # closes the prompt: no pass measured yet
    speculation.token_yielded()
    # lookup offers 4, 5, 6, 1, 2, 3; two cells are left
    assert speculation(np.asarray(tokens)).tolist() == [4, 5]
    speculation.token_yielded()  # the pass kept neither draft
    assert speculation(np.asarray(tokens + [9])).tolist() == []  # one cell left, nothing to look up
    assert speculation.stats.drafted == 2 and speculation.stats.accepted == 0
    assert speculation(np.asarray(tokens + [9, 9])).tolist() == []  # the context is full


def _reply(engine: Engine, prompt: str, tokens: int):
    gen = engine.complete(prompt, Sampling(temperature=0.0, max_tokens=tokens))
    ids = [event.token_id for event in gen if event.token_id >= 0]
    return ids, gen.result


def _with_and_without_drafts(engine: Engine, prompt: str, tokens: int, follow_up: str | None = None):
    """The same engine's replies without drafts, then with them, each from a fresh context: the
    context was made with speculation on, so both compute attention alike (its Q8_0 cache)."""
    out = {}
    for mode in ("off", "lookup"):
        engine.speculate = mode
        engine.llm.reset()
        before = engine.streamer.counters()["bytes_needed"]
        ids, result = _reply(engine, prompt, tokens)
        spent = engine.streamer.counters()["bytes_needed"] - before
        # A second turn goes on from the context the first left: drafts past the reply's end were taken back.
        again = _reply(engine, follow_up, 12)[0] if follow_up else None
        out[mode] = ids, result, spent, again
    return out["off"], out["lookup"]


def test_a_streamed_dense_model_copies_in_fewer_passes_and_bytes_with_the_same_tokens(model_path):
    engine = Engine(model_path, n_ctx=1024, budget=60 * MIB, speculate="lookup")  # 100 MiB: its trunk streams
    engine.load()
    engine.pin()
    try:
        assert engine.streamer is not None
        (plain, plain_result, plain_bytes, plain_next), (drafted, result, drafted_bytes, drafted_next) = (
            _with_and_without_drafts(engine, COPY_PROMPT, 40, COPY_PROMPT + " the gulls")
        )
    finally:
        engine.close()
    assert drafted == plain and drafted_next == plain_next
    assert plain_result.speculation is None
    stats = result.speculation
    assert stats.accepted > 0 and stats.passes < len(drafted) - 1 and stats.tokens_per_pass > 1.5
    assert stats.emitted == len(drafted) - 1  # every decode pass counted, the prompt's apart
    assert 0 < stats.acceptance <= 1
    assert drafted_bytes < plain_bytes / 1.5


# Long enough that the prompt holds more than 256 tokens: llama.cpp then attends over 512 cells
# (it pads to 256), where ggml-cpu's flash attention over an F16 cache splits a lone token's
# attention over the threads.
LONG_TEXT = " ".join([
    "The ferry left the harbour a little after six, when the fog had begun to lift from the water and",
    "the gulls were already quarrelling over the fishing boats. Maria stood at the rail with her coat",
    "buttoned to the chin and watched the town shrink behind her: the church with its green copper roof,",
    "the row of painted houses along the quay, the crane that had not moved in twenty years. Her brother",
    "had promised to meet her on the other side, though he had promised many things before and kept few",
    "of them. The crossing took three hours in good weather and five in bad, and the captain, a thin man",
    "with a grey beard and a voice like gravel, said it would be bad today. By nine the wind had turned",
    "and the waves came in long grey rows from the west. Most of the passengers went below to the cabin,",
    "where a stove burned and a woman sold tea in thick white cups, but Maria stayed outside. She had",
    "brought a letter she meant to read again, the one that had come in March with no return address and",
    "a postmark she could not make out, and she held it in her pocket with one hand while the other held",
    "the rail. The island, when it finally rose out of the rain, was smaller than she remembered and",
    "darker, a long low shape with a single light burning at its northern end, and on the pier, to her",
    "surprise, stood her brother, waving both arms as if she might otherwise sail straight past him.",
])


def test_the_cache_for_drafts_is_q8_0_unless_a_head_is_not_a_whole_number_of_its_blocks():
    from kimitui.engine import kv_cache

    heads_of_64 = {"llama.attention.head_count": 9, "llama.embedding_length": 576}
    assert kv_cache.for_drafts(heads_of_64, "llama") is kv_cache.Q8_0
    heads_of_80 = {"phi2.attention.head_count": 32, "phi2.embedding_length": 2560}  # llama.cpp refuses Q8_0 there
    assert kv_cache.for_drafts(heads_of_80, "phi2") is kv_cache.BF16
    mla = {"deepseek2.attention.head_count": 96, "deepseek2.embedding_length": 7168,
           "deepseek2.attention.key_length": 576, "deepseek2.attention.value_length": 512}
    assert kv_cache.for_drafts(mla, "deepseek2") is kv_cache.Q8_0
    assert kv_cache.Q8_0.llama_params() == {"flash_attn": True, "type_k": 8, "type_v": 8}
    assert kv_cache.PLAIN.llama_params() == {"flash_attn": False}


@pytest.mark.parametrize("cache", ["Q8_0", "BF16"])
def test_past_256_tokens_a_reply_with_drafts_is_plain_decodings_and_stock_llama_cpps(model_path, cache, monkeypatch):
    """The context speculation makes computes a batched token's attention as a lone one's at any
    length: past 256 tokens the reply with drafts equals the one without, and stock
    llama-cpp-python's greedy reply with the same cache; with the BF16 cache too, which a model
    whose heads Q8_0 cannot cache gets."""
    from helpers import stock_llama
    from kimitui.engine import kv_cache

    made = getattr(kv_cache, cache)
    monkeypatch.setattr(kv_cache, "for_drafts", lambda kv, arch: made)
    prompt = f"Repeat this text exactly:\n\n{LONG_TEXT}\n\nRepeated text:\n\n{LONG_TEXT[:40]}"
    engine = Engine(model_path, n_ctx=1024, budget=60 * MIB, speculate="lookup")
    engine.load()
    engine.pin()
    try:
        assert engine.streamer is not None
        assert engine.kv_cache is made
        prompt_tokens = engine.tokenize(prompt)
        assert len(prompt_tokens) > 300
        (plain, *_), (drafted, result, *_) = _with_and_without_drafts(engine, prompt, 48)
        threads = engine.n_threads
    finally:
        engine.close()
    assert drafted == plain and len(plain) == 48
    assert result.speculation.accepted > 8  # most of the reply came from drafts checked past 256 tokens
    stock = stock_llama(model_path, n_ctx=1024, n_threads=threads, n_threads_batch=threads, **made.llama_params())
    expected = []
    for token in stock.generate(prompt_tokens, temp=0.0):
        expected.append(token)
        if len(expected) == len(plain):
            break
    stock.close()
    assert plain == expected


def test_quality_measures_what_speculations_cache_costs(model_path, capsys):
    from kimitui.benchmarks.quality import BUILT_IN_TEXT, compare, drafts_cache
    from kimitui.cli import main

    cached = compare(model_path, model_path, BUILT_IN_TEXT, n_ctx=160, variant_cache=drafts_cache(model_path))
    assert 0.0 < cached.kl_mean < 0.05 and cached.top1_agreement > 0.8  # rounding, not another model
    assert main(["quality", "--model", str(model_path), "--speculation-cache", "--n-ctx", "160"]) == 0
    assert "in speculation's context (its KV cache q8_0 with flash attention)" in capsys.readouterr().out


def test_a_model_that_fits_never_drafts(model_path):
    from kimitui.engine import kv_cache

    engine = Engine(model_path, n_ctx=1024, speculate="lookup", draft_model=str(model_path))
    engine.load()
    try:
        assert engine.streamer is None and engine.rollback_snapshots == 0
        assert engine.kv_cache is kv_cache.PLAIN  # no drafts: llama-cpp-python's own cache
        assert engine._draft_model is None  # nor a draft model's file and context beside it
        ids, result = _reply(engine, COPY_PROMPT, 16)
        assert result.speculation is None and engine.metrics.drafts is None
    finally:
        engine.close()


def test_with_a_context_shift_nothing_is_drafted_and_the_drafts_cost_nothing(model_path):
    """A reply that may shift is decoded a token at a time: the context keeps llama-cpp-python's
    cache (not the drafts' Q8_0), no draft model is loaded, a note says why, and the reply is
    the one without speculation."""
    from kimitui.engine import kv_cache

    plain = Engine(model_path, n_ctx=1024, budget=60 * MIB, context_shift=True)
    plain.load()
    plain.pin()
    try:
        expected = _reply(plain, COPY_PROMPT, 16)[0]
    finally:
        plain.close()
    engine = Engine(model_path, n_ctx=1024, budget=60 * MIB, speculate="lookup", draft_model=str(model_path), context_shift=True)
    engine.load()
    engine.pin()
    try:
        assert engine.streamer is not None and engine.context_shift
        assert engine.kv_cache is kv_cache.PLAIN and engine._draft_model is None and engine.rollback_snapshots == 0
        assert any(note.startswith("speculation drafts nothing while context shift is on") for note in engine.notices())
        ids, result = _reply(engine, COPY_PROMPT, 16)
        assert ids == expected and result.speculation is None
    finally:
        engine.close()


@pytest.fixture(scope="module")
def k3_model(tmp_path_factory) -> Path:
    spec = synth.plan_like("kimi-k3", None, 0.02, "q4_1", synth.default_tokenizer(), synth.Cut(layers=4))
    out = tmp_path_factory.mktemp("k3") / "k3.gguf"
    return synth.write_model(spec, out, seed=3, progress=False).paths[0]


@pytest.mark.parametrize("budget_mib, words", [(10, 13), (26, 320)])
def test_k3_takes_rejected_drafts_back_out_of_its_recurrent_state(k3_model, budget_mib, words, monkeypatch):
    """Synthetic weights repeat nothing, so the drafts come from an oracle that knows stock
    llama.cpp's reply and gets every third pass's second draft wrong: accepted and rejected
    drafts both pass through K3's KDA state, streamed with one snapshot (a micro-batch of 3) and
    with seven, the latter past 256 tokens, where its MLA layers attend over 512 cells."""
    prompt = " ".join(("one two three four five six seven eight nine ten".split() * 40)[:words])
    engine = Engine(k3_model, n_ctx=512, budget=budget_mib * MIB, speculate="lookup")
    engine.load()
    engine.pin()
    engine.speculate = "off"  # the same context's replies without drafts first
    expected = _reply(engine, prompt, 20)[0]
    expected_next = _reply(engine, prompt + " four", 8)[0]
    engine.speculate = "lookup"
    engine.llm.reset()
    reference = {"tokens": expected, "start": 0}
    passes = [0]

    def oracle(tokens, count, **_):
        at = len(tokens) - reference["start"]
        follow = list(reference["tokens"][at : at + count])
        passes[0] += 1
        if passes[0] % 3 == 0 and len(follow) > 1:
            follow[1] += 1
        return follow, 2

    monkeypatch.setattr(speculation, "lookup", oracle)
    monkeypatch.setattr(DraftPlanner, "drafts", lambda self, trunk, token, available, match=0: min(self.max_drafts, available))
    try:
        assert engine.streamer is not None
        assert engine.rollback_snapshots == {10: 1, 26: 7}[budget_mib]
        reference["start"] = len(engine.tokenize(prompt))
        ids, result = _reply(engine, prompt, 20)
        assert ids == expected
        stats = result.speculation
        assert stats.drafted > stats.accepted > 0  # drafts kept and drafts taken back
        reference.update(tokens=expected_next, start=len(engine.tokenize(prompt + " four")))
        assert _reply(engine, prompt + " four", 8)[0] == expected_next
    finally:
        engine.close()


def test_a_draft_model_with_the_same_vocabulary_drafts_and_the_tokens_stay(model_path):
    """The embedded model drafts for itself: every draft it makes is the model's own greedy
    choice, so nearly all are kept; the reply is plain decoding's."""
    engine = Engine(model_path, n_ctx=1024, budget=60 * MIB, speculate="lookup", draft_model=str(model_path))
    engine.load()
    engine.pin()
    try:
        (plain, *_), (ids, result, *_) = _with_and_without_drafts(engine, "Once upon a time, an old sailor", 24)
        assert ids == plain
        stats = result.speculation
        # The last pass's drafts past the reply's 24 tokens count as drafted, never as kept:
        # besides those, at most one draft is rejected.
        assert stats.drafted > 0 and stats.tokens_per_pass > 2
        assert stats.drafted - stats.accepted <= engine.draft_max + 1
    finally:
        engine.close()


def test_a_draft_model_with_another_vocabulary_is_refused_in_one_line(model_path, tmp_path):
    spec = synth.plan_dense(120 * MIB, "q4_1", with_added_tokens(synth.default_tokenizer(), 64))
    other = synth.write_model(spec, tmp_path / "other.gguf", seed=2, progress=False).paths[0]
    engine = Engine(model_path, n_ctx=512, budget=60 * MIB, speculate="lookup", draft_model=str(other))
    with pytest.raises(EngineError) as caught:
        engine.load()
    message = str(caught.value)
    assert message.startswith("draft model other.gguf: its vocabulary is not ") and "49216 tokens against 49152" in message
    assert "\n" not in message
    engine.close()


def test_a_model_without_a_recurrent_state_keeps_its_drafts_when_memory_is_short(model_path, monkeypatch):
    """Copies of a recurrent state cost a model without one nothing: where its context fits
    only at a smaller micro-batch, the drafts a pass carries stay, and no note speaks of them."""
    import kimitui.engine.memory as memory
    from kimitui.engine import kv_cache
    from kimitui.engine.budget import MIN_UBATCH, PROCESS_RESERVE, working_estimate
    from kimitui.model.gguf_map import load_model_map

    model = load_model_map(model_path)
    context = working_estimate(model, 4096, MIN_UBATCH, value_bytes=kv_cache.Q8_0.value_bytes)
    monkeypatch.setattr(memory, "available_memory", lambda: 60 * MIB + PROCESS_RESERVE + context + 4096)
    engine = Engine(model_path, n_ctx=4096, budget=60 * MIB, speculate="lookup")
    engine.load()
    try:
        assert engine.n_ctx == 4096 and engine.ubatch_cap is not None  # memory is short
        assert engine.draft_cap is None and engine.draft_note is None and engine.rollback_snapshots == engine.draft_max
    finally:
        engine.close()


def test_k3s_tokens_checked_in_one_pass_have_a_lone_tokens_logits_past_256_tokens(k3_model):
    """Synthetic weights leave no near ties for rounding to flip, so K3 is checked where the
    rounding is: after a 320-token prompt (its MLA layers attend over 512 cells), four tokens
    evaluated in one batch, as a drafted pass is, have to the bit the logits each has evaluated
    alone (with an F16 cache they differ by up to 0.07)."""
    import llama_cpp

    engine = Engine(k3_model, n_ctx=512, budget=26 * MIB, speculate="lookup")
    engine.load()
    engine.pin()
    try:
        llm = engine.llm
        prompt = engine.tokenize(" ".join(("one two three four five six seven eight nine ten".split() * 40)[:320]))
        assert len(prompt) > 256
        drafted = engine.tokenize(" alpha beta gamma delta")[-4:]
        n_vocab = llm.n_vocab()

        def logits(tokens: list[int], n_past: int) -> np.ndarray:
            llm._batch.set_batch(batch=tokens, n_past=n_past, logits_all=True)
            llm._ctx.decode(llm._batch)
            rows = [llama_cpp.llama_get_logits_ith(llm._ctx.ctx, i) for i in range(len(tokens))]
            return np.array([np.ctypeslib.as_array(row, shape=(n_vocab,)) for row in rows])

        def after_prompt() -> None:
            llm.reset()
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llm._ctx.ctx), True)
            llm.eval(prompt)

        after_prompt()
        in_one_pass = logits(drafted, len(prompt))
        after_prompt()
        alone = np.concatenate([logits([token], len(prompt) + i) for i, token in enumerate(drafted)])
    finally:
        engine.close()
    assert np.array_equal(in_one_pass, alone)


def test_a_recurrent_context_refuses_to_go_back_past_the_drafted_pass(k3_model):
    """llama.cpp's snapshots hold the last micro-batch's states only: any other partial removal
    on K3 is refused (the caller evaluates afresh), as before it kept snapshots."""
    engine = Engine(k3_model, n_ctx=256, budget=26 * MIB, speculate="lookup")
    engine.load()
    engine.pin()
    try:
        llm = engine.llm
        llm.eval(engine.tokenize("one two three four five six"))
        n = llm.n_tokens
        assert llm._ctx.kv_cache_seq_rm(-1, n - 2, -1) is False  # the prompt's state: no snapshot of it
        assert llm._ctx.kv_cache_seq_rm(-1, n, -1)  # nothing past the end: nothing taken back
        guard = engine._rollback_guard
        guard.allow_after(n - 3)  # as while a drafted pass of these tokens is checked
        assert llm._ctx.kv_cache_seq_rm(-1, n - 2, -1)
        guard.allow_after(None)
    finally:
        engine.close()


async def test_the_latency_panel_shows_tokens_per_pass_and_drafts_kept():
    from dataclasses import replace

    from fakes import fake_app, recorded_snapshots
    from kimitui.engine.metrics import DraftCounts
    from kimitui.tui.widgets.panels import LatencyPanel

    snapshots = recorded_snapshots()
    snapshots[-1] = replace(snapshots[-1], drafts=DraftCounts(passes=10, drafted=32, accepted=24, emitted=34))
    app = fake_app(snapshots=snapshots)
    async with app.run_test(size=(120, 40)) as pilot:
        for _ in range(100):
            await pilot.pause(0.05)
            if app.main.ready:
                break
        app.main.sampler.play()
        await pilot.pause(0.2)
        assert "3.4 tok/pass, 75% drafts kept" in str(app.query_one(LatencyPanel).body.render())


def test_bench_speculate_compares_the_same_tokens_with_and_without_drafts(model_path, capsys, tmp_path):
    from kimitui.cli import main

    report = tmp_path / "spec.json"
    assert main(["bench-speculate", "--model", str(model_path), "--budget", "60MiB", "--tokens", "24", "--rounds", "1",
                 "--task", "copy", "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert "same tokens: yes" in out and "tokens per pass" in out and "drafts kept" in out
    import json

    figures = json.loads(report.read_text())
    copy = figures["tasks"]["copy"]
    assert figures["streams"] and copy["same_tokens"]
    assert copy["lookup"]["tokens_per_pass"] > 1 and copy["lookup"]["decode_bytes_per_token"] < copy["off"]["decode_bytes_per_token"]


def test_logprobs_grammar_sampling_and_stops_are_those_of_plain_decoding(model_path):
    """Each token is sampled once, by the reply's own sampler chain, from its pass's logits: the
    log-probabilities, a grammar's state, a seeded sampler's draws and the stop strings see what
    they see without drafts."""
    text = "The ferry left the harbour a little after six, when the fog had begun to lift from the water."
    prompt = f"Repeat: {text}\nAgain: {text}\nAgain:"
    kinds = {
        "logprobs": Sampling(temperature=0.0, max_tokens=30, n_probs=2),
        "grammar": Sampling(temperature=0.0, max_tokens=30, grammar="root ::= [a-zA-Z ,.]+"),
        "sampled": Sampling(temperature=0.8, seed=42, max_tokens=30),
        "stop": Sampling(temperature=0.0, max_tokens=30, stop=("water",)),
    }
    engine = Engine(model_path, n_ctx=1024, budget=60 * MIB, speculate="lookup")
    engine.load()
    engine.pin()
    try:
        replies = {}
        for mode in ("off", "lookup"):
            engine.speculate = mode
            for kind, sampling in kinds.items():
                engine.llm.reset()
                gen = engine.complete(prompt, sampling)
                events = [(e.token_id, e.text, e.logprob, e.top) for e in gen]
                replies[mode, kind] = events, gen.result.finish_reason, gen.result.speculation
        for kind in kinds:
            (plain, plain_end, _), (drafted, drafted_end, stats) = replies["off", kind], replies["lookup", kind]
            assert drafted == plain and drafted_end == plain_end, kind
            assert stats.accepted > 0, kind
    finally:
        engine.close()


def test_a_recurrent_state_is_known_before_the_load_from_the_models_keys(k3_model, model_path):
    """Where a context shift is asked, the cache is chosen before llama.cpp says whether the
    model can shift: a model keeping a recurrent state (K3's KDA; Mamba's ssm.*, RWKV's wkv.*,
    LFM2's shortconv.* keys) cannot, and keeps its drafts."""
    from dataclasses import replace

    from kimitui.engine.llama_glue import keeps_recurrent_state
    from kimitui.model.gguf_map import load_model_map

    assert keeps_recurrent_state(load_model_map(k3_model))
    dense = load_model_map(model_path)
    assert not keeps_recurrent_state(dense)
    for key in ("ssm.conv_kernel", "wkv.head_size", "shortconv.l_cache"):
        assert keeps_recurrent_state(replace(dense, hparams={**dense.hparams, f"{dense.architecture}.{key}": 4}))
