"""Kimi K3 as the pinned llama.cpp loads it: the synth writes it, stock llama.cpp runs it, and the
streaming engine gives the same greedy tokens under a budget far below its size, with the budget
holding, a context that fits, and the KDA recurrent state carried across chat turns."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from kimitui.engine.addressing import Windows
from kimitui.engine.budget import budget_shortfall, minimum_budget, plan_memory
from kimitui.engine.generation import Sampling
from kimitui.engine.session import Engine
from kimitui.engine.state import EngineError
from kimitui.model import synth
from kimitui.model.gguf_map import load_model_map
from kimitui.model.synth.archs import K3_LAYOUTS

from helpers import count_decodes, peak_while

MIB = 2**20
PROMPT = "The quick brown fox jumps over the lazy dog while seven wizards quietly juggle"


@pytest.fixture(scope="module")
def k3_model(tmp_path_factory) -> Path:
    """4 layers (1 dense, then 3 MoE; 3 KDA and 1 MLA), all 896 experts, 16 used, widths cut to
    a fiftieth: 28 MiB, so a budget of a third of it streams."""
    spec = synth.plan_like("kimi-k3", None, 0.02, "q4_1", synth.default_tokenizer(), synth.Cut(layers=4))
    out = tmp_path_factory.mktemp("k3") / "k3.gguf"
    return synth.write_model(spec, out, seed=3, progress=False).paths[0]


@pytest.fixture(scope="module")
def k3_paged(tmp_path_factory) -> Path:
    """The same cut at three fiftieths of the widths (210 MiB): an expert's slices span pages,
    so whether each leaves memory when evicted is visible page by page."""
    spec = synth.plan_like("kimi-k3", None, 0.06, "q4_1", synth.default_tokenizer(), synth.Cut(layers=4))
    out = tmp_path_factory.mktemp("k3p") / "k3p.gguf"
    return synth.write_model(spec, out, seed=5, progress=False).paths[0]


def stock_reply(path: Path, prompt=PROMPT, tokens: int = 16) -> list[int]:
    engine = Engine(path, n_ctx=256, fast_load=False)
    engine.load()
    try:
        return reply_tokens(engine, prompt, tokens)
    finally:
        engine.close()


def reply_tokens(engine: Engine, prompt=PROMPT, tokens: int = 16) -> list[int]:
    gen = engine.complete(prompt, Sampling(temperature=0.0, max_tokens=tokens))
    return [event.token_id for event in gen if event.token_id >= 0]


def streamed_engine(path: Path, budget: int) -> Engine:
    engine = Engine(path, n_ctx=256, budget=budget)
    engine.load()
    engine.pin()
    assert engine.streamer is not None and engine.streamer.experts is not None
    return engine


def test_synth_writes_the_kimi_k3_architecture(k3_model):
    from gguf import GGMLQuantizationType, GGUFReader

    reader = GGUFReader(str(k3_model))
    fields = {k: f.contents() for k, f in reader.fields.items() if k.startswith("kimi-k3.")}
    assert reader.fields["general.architecture"].contents() == "kimi-k3"
    assert fields["kimi-k3.attention.head_count_kv"] == [0, 0, 0, 1]  # 3 KDA layers, then MLA
    assert fields["kimi-k3.expert_count"] == 896 and fields["kimi-k3.expert_used_count"] == 16
    for key in ("expert_latent_length", "kda.head_dim", "ssm.conv_kernel", "kda.gate_lower_bound",
                "activation.situ_beta", "activation.situ_linear_beta", "attn_res.block_size",
                "key_length_mla", "value_length_mla"):
        assert any(k.endswith(key) for k in fields), key
    tensors = {t.name: t for t in reader.tensors}
    latent = fields["kimi-k3.expert_latent_length"]
    gate = tensors["blk.1.ffn_gate_exps.weight"]
    assert gate.tensor_type == GGMLQuantizationType.MXFP4
    assert list(gate.shape) == [latent, fields["kimi-k3.expert_feed_forward_length"], 896]
    for name in ("blk.1.ffn_routed_down.weight", "blk.1.ffn_routed_up.weight", "blk.1.ffn_gate_shexp.weight",
                 "blk.0.ssm_conv1d_q.weight", "blk.0.ssm_g.weight", "blk.0.ssm_a", "blk.3.attn_gate.weight",
                 "blk.3.attn_k_b.weight", "blk.2.attn_res_score.weight", "output_res_score.weight"):
        assert name in tensors, name


def test_full_scale_dry_run_prints_the_real_figures(capsys):
    from kimitui.cli import main

    assert main(["synth", "/tmp/never-written.gguf", "--like", "kimi-k3", "--scale", "1", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "93 layers (69 KDA, 24 MLA" in out and "896 experts (16 used, 2 shared)" in out and "96 heads" in out
    assert "17,547,264 B" in out  # one MXFP4 expert at latent 3584, n_ff 3072
    assert "1.4 TiB" in out  # ~1.56 TB


def test_full_scale_k3_has_the_public_byte_totals():
    """The real K3's trunk (every layer tensor but the routed experts, BF16) is about 108.8 GB
    and its 82,432 routed experts 17,547,264 B each (the public config; kimi-k3-in-c, colibri)."""
    spec = synth.plan_like("kimi-k3", None, 1.0, None, synth.default_tokenizer())
    sizes = {t.name: t.n_bytes for t in spec.tensors}
    experts = sum(n for name, n in sizes.items() if "_exps." in name)
    trunk = sum(n for name, n in sizes.items() if name.startswith("blk.")) - experts
    assert experts == 92 * 896 * 17_547_264
    assert abs(trunk / 108.8e9 - 1) < 0.02, trunk
    shared = [t for t in spec.tensors if t.name == "blk.1.ffn_up_shexp.weight"][0]
    assert shared.shape == (7168, 2 * 3072)  # two shared experts, fused as llama.cpp loads them


@pytest.mark.parametrize("layout", ["ud-q2_k_xl", "ud-iq1_m"])
def test_published_layouts_have_the_downloads_types_and_sizes(layout):
    """The smaller published sets: trunk Q8_0, routed experts in i-quants, within 2% of the
    set's size (the 49k vocabulary, where K3's is 164k, costs about 2 GB of embeddings and head)."""
    from gguf import GGMLQuantizationType as T

    trunk, gate_up, down, _, published = K3_LAYOUTS[layout]
    spec = synth.plan_like("kimi-k3", None, 1.0, None, synth.default_tokenizer(), layout=layout)
    types = {t.name: t.qtype for t in spec.tensors}
    assert types["blk.1.ffn_gate_exps.weight"] == types["blk.1.ffn_up_exps.weight"] == gate_up
    assert types["blk.1.ffn_down_exps.weight"] == down
    for name in ("blk.1.attn_output.weight", "blk.3.attn_kv_a_mqa.weight", "blk.1.ffn_up_shexp.weight", "output.weight", "token_embd.weight"):
        assert types[name] == T.Q8_0, name
    assert types["blk.1.ffn_gate_inp.weight"] == T.F32  # routers stay as they are
    assert abs(spec.file_bytes() / published - 1) < 0.02


def test_stock_and_streamed_k3_agree_on_an_i_quant_layout(tmp_path):
    """Stock llama.cpp runs the i-quant layout (rows of whole 256-weight blocks, widths rounded
    to them) with finite, varied logits, and the streamed engine gives its greedy tokens."""
    import numpy as np

    spec = synth.plan_like("kimi-k3", None, 0.02, None, synth.default_tokenizer(), synth.Cut(layers=3), layout="ud-iq1_m")
    path = synth.write_model(spec, tmp_path / "iq.gguf", seed=4, progress=False).paths[0]
    engine = Engine(path, n_ctx=256, fast_load=False)
    engine.load()
    try:
        expected = reply_tokens(engine, tokens=10)
        assert np.isfinite(np.array(engine.llm.scores[: engine.llm.n_tokens])).all()
        assert len(set(expected)) > 3
    finally:
        engine.close()
    model = load_model_map(path)
    streamed = streamed_engine(path, minimum_budget(model) + 2 * MIB)
    try:
        assert reply_tokens(streamed, tokens=10) == expected
    finally:
        streamed.close()


def test_a_real_width_slice_keeps_the_expert_size(tmp_path):
    spec = synth.plan_like("kimi-k3", None, 1.0, None, synth.default_tokenizer(), synth.Cut(layers=2, experts=4))
    experts = [t for t in spec.tensors if t.name.startswith("blk.1.") and "_exps." in t.name]
    assert sum(t.n_bytes for t in experts) // 4 == 17_547_264


def test_stock_llama_cpp_decodes_finite_varied_logits(k3_model):
    import numpy as np

    engine = Engine(k3_model, n_ctx=256, fast_load=False)
    engine.load()
    try:
        tokens = reply_tokens(engine, tokens=12)
        scores = np.array(engine.llm.scores[: engine.llm.n_tokens])
        assert np.isfinite(scores).all()
        assert len(set(tokens)) > 3
    finally:
        engine.close()


def test_streamed_k3_gives_the_stock_greedy_tokens(k3_model):
    """A budget a third of the model: every layer start and router choice of K3's graph is seen
    (layer 0 starts at its "inp_embd" node), experts are read, not faulted in."""
    expected = stock_reply(k3_model)
    model = load_model_map(k3_model)
    engine = streamed_engine(k3_model, minimum_budget(model) + 2 * MIB)
    try:
        starts: list[int] = []
        chosen: set[int] = set()
        streamer = engine.streamer
        real_start, real_experts = streamer.on_layer_start, streamer.on_experts

        def on_layer_start(layer):
            starts.append(layer)
            return real_start(layer)

        def on_experts(layer, experts):
            chosen.update(experts)
            return real_experts(layer, experts)

        streamer.on_layer_start, streamer.on_experts = on_layer_start, on_experts
        assert reply_tokens(engine) == expected
        assert set(starts) == set(range(model.n_layers + 1))  # 0..3 and the output stage
        assert chosen and max(chosen) < 896 and max(chosen) > 448  # ids over all 896 experts
        counters = streamer.counters()
        assert counters["expert_misses"] > 0 and counters["bytes_read"] > 0
    finally:
        engine.close()


def test_moe_working_set_is_one_tokens_experts_not_a_whole_layer(k3_model):
    model = load_model_map(k3_model)
    whole_layer = max(layer.n_bytes for layer in model.layers)
    largest_trunk = max(layer.trunk_bytes if layer.is_moe else layer.n_bytes for layer in model.layers)
    from kimitui.engine.budget import expert_footprint

    one_token = model.n_expert_used * expert_footprint(model)  # its slices in whole pages
    assert model.bytes_per_expert <= expert_footprint(model) <= model.bytes_per_expert + 6 * 4096
    need = minimum_budget(model)
    assert need == model.nonlayer_bytes + largest_trunk + one_token + 16 * MIB
    assert need < model.nonlayer_bytes + whole_layer + 16 * MIB
    assert budget_shortfall(model, need) is None
    line = budget_shortfall(model, need - 1)
    assert "minimum working set of k3.gguf" in line and "routed experts one token uses" in line
    for budget in (need, need + 4 * MIB, 3 * need):
        plan = plan_memory(model, budget, prefetch_depth=2, n_batch=512)
        assert plan.expert_bytes >= one_token
        assert plan.pinned_bytes + plan.window_bytes + plan.expert_bytes <= budget
        assert plan.ubatch * model.n_expert_used * model.bytes_per_expert <= plan.expert_bytes - plan.hot_expert_bytes \
            or plan.ubatch == 512


@pytest.mark.parametrize("extra_mib", [2, 40])
def test_the_budget_holds_the_models_resident_pages(k3_paged, extra_mib):
    """Sampled all through a reply, the model's resident pages (file-backed and anonymous) stay
    within the budget: prefill micro-batches fit the expert cache, evicted experts leave, and
    the greedy tokens are stock llama.cpp's."""
    expected = stock_reply(k3_paged, PROMPT * 2, tokens=12)
    model = load_model_map(k3_paged)
    budget = minimum_budget(model) + extra_mib * MIB
    engine = streamed_engine(k3_paged, budget)
    try:
        source = engine.metrics.model_resident_source
        assert source is not None and source() is not None
        peak, tokens = peak_while(source, lambda: reply_tokens(engine, PROMPT * 2, tokens=12))
        assert tokens == expected
        assert model.n_expert_used * model.bytes_per_expert < peak <= budget
    finally:
        engine.close()


def fitting(k3_model) -> tuple[int, int, int]:
    """(budget, weights, room for a 1024-token context beside them) of the K3 cut: the budget a
    little above its minimum, the weights it pins at most, and the memory for those plus llama.cpp's
    cache and buffers at 1024 tokens, not 2048, at the prefill micro-batch the budget plans."""
    from kimitui.engine.budget import PROCESS_RESERVE, working_estimate

    model = load_model_map(k3_model)
    budget = minimum_budget(model) + 2 * MIB
    ubatch = plan_memory(model, budget, 2, 512).ubatch
    weights = min(budget, model.tensor_bytes)
    room = weights + PROCESS_RESERVE + working_estimate(model, 1024, ubatch)
    assert room + 4096 < weights + PROCESS_RESERVE + working_estimate(model, 2048, ubatch)
    return budget, weights, room


def test_the_default_context_shrinks_to_what_fits(k3_model, monkeypatch):
    import kimitui.engine.memory as memory

    budget, _, room = fitting(k3_model)
    monkeypatch.setattr(memory, "available_memory", lambda: room + 4096)
    engine = Engine(k3_model, n_ctx=65536, budget=budget)
    engine.load()
    try:
        assert engine.n_ctx == 1024 and engine.llm.n_ctx() == 1024
        assert "context 1024 tokens instead of 65536" in engine.fit_note
        assert reply_tokens(engine, tokens=4)
    finally:
        engine.close()


def test_a_chosen_context_that_cannot_fit_is_refused_in_one_line(k3_model, monkeypatch):
    import kimitui.engine.memory as memory

    budget, weights, room = fitting(k3_model)
    monkeypatch.setattr(memory, "available_memory", lambda: room)
    engine = Engine(k3_model, n_ctx=65536, budget=budget, n_ctx_fixed=True)
    with pytest.raises(EngineError, match=r"^context of 65536 tokens needs .* lower --n-ctx \(to 1024 at most\) or --budget$"):
        engine.load()
    monkeypatch.setattr(memory, "available_memory", lambda: weights)
    engine = Engine(k3_model, n_ctx=256, budget=budget)
    with pytest.raises(EngineError, match="lower --budget$"):
        engine.load()
    # With speculation on, where the context would fit without the recurrent state's copies kept
    # for drafts and not even one of them fits beside it, turning speculation off is named too.
    from kimitui.engine import kv_cache
    from kimitui.engine.budget import MIN_UBATCH, PROCESS_RESERVE, state_copy_bytes, working_estimate

    model = load_model_map(k3_model)
    cache = kv_cache.for_drafts(model.hparams, model.architecture)
    ubatch = min(MIN_UBATCH, plan_memory(model, budget, 2, 512).ubatch)  # the smallest the load tries
    bare = weights + PROCESS_RESERVE + working_estimate(model, 256, ubatch, 1, 0, cache.value_bytes)
    copy = state_copy_bytes(model)
    monkeypatch.setattr(memory, "available_memory", lambda: bare + copy // 2)
    engine = Engine(k3_model, n_ctx=256, budget=budget, speculate="lookup", draft_max=8)
    assert engine.rollback_snapshots == 8
    with pytest.raises(EngineError, match=r"lower --budget, or set engine.speculate off "
                                          r"\(the recurrent state's 8 copies kept for drafts: .*\)$"):
        engine.load()


def test_speculation_drafts_fewer_a_pass_before_the_context_shrinks(k3_model, monkeypatch):
    """Each draft a pass may carry keeps a copy of K3's recurrent state: where eight copies
    would not fit beside the budget at the context asked for, fewer drafts are carried and the
    context stays, with a note."""
    import kimitui.engine.memory as memory
    from kimitui.engine import kv_cache
    from kimitui.engine.budget import PROCESS_RESERVE, working_estimate

    budget, weights, _ = fitting(k3_model)
    model = load_model_map(k3_model)
    cache = kv_cache.for_drafts(model.hparams, model.architecture)
    ubatch = plan_memory(model, budget, 2, 512).ubatch  # the micro-batch the load plans, as fitting()'s
    room = weights + PROCESS_RESERVE + working_estimate(model, 1024, ubatch, 1, 3, cache.value_bytes) + 4096
    monkeypatch.setattr(memory, "available_memory", lambda: room)
    engine = Engine(k3_model, n_ctx=1024, budget=budget, speculate="lookup", draft_max=8)
    engine.load()
    try:
        assert engine.draft_cap == 3 and engine.rollback_snapshots == 3 and engine.n_ctx == 1024
        import llama_cpp

        assert llama_cpp.llama_n_rs_seq(engine.llm._ctx.ctx) == 3
        assert "speculation drafts at most 3 a pass, not 8: more copies of" in " ".join(engine.notices())
        assert reply_tokens(engine, tokens=4)
    finally:
        engine.close()


def test_the_kda_state_carries_across_chat_turns(k3_model):
    """Three turns: the same replies as stock llama.cpp on the same conversation, and each later
    turn evaluates only what the conversation added (the recurrent state is kept, not rebuilt)."""

    def converse(engine: Engine) -> tuple[list[str], list[int], list[int]]:
        evaluated = count_decodes(engine)
        messages = [{"role": "user", "content": "Tell me about foxes."}]
        texts, fresh, prompts = [], [], []
        for _ in range(3):
            evaluated.clear()
            gen = engine.chat(messages, Sampling(temperature=0.0, max_tokens=6))
            list(gen)
            texts.append(gen.result.text)
            prompts.append(gen.result.prompt_tokens)
            fresh.append(evaluated[0] if evaluated else 0)  # the prompt's decode: new tokens only
            messages += [{"role": "assistant", "content": gen.result.text}, {"role": "user", "content": "And then?"}]
        return texts, fresh, prompts

    stock = Engine(k3_model, n_ctx=512, fast_load=False)
    stock.load()
    try:
        expected, _, _ = converse(stock)
    finally:
        stock.close()
    model = load_model_map(k3_model)
    engine = Engine(k3_model, n_ctx=512, budget=minimum_budget(model) + 2 * MIB)
    engine.load()
    engine.pin()
    try:
        texts, fresh, prompts = converse(engine)
        assert texts == expected
        assert fresh[0] == prompts[0]
        for turn in (1, 2):  # no more than the turn added: the last reply's tail and the new message
            assert 0 < fresh[turn] <= prompts[turn] - prompts[turn - 1]
    finally:
        engine.close()


def test_k3_routers_are_read_for_look_ahead(k3_model):
    """The router look-ahead reads K3's full-width router (ffn_gate_inp on n_embd) and its bias."""
    from kimitui.engine.experts import RouterPredictor

    model = load_model_map(k3_model)
    engine = streamed_engine(k3_model, minimum_budget(model) + 2 * MIB)
    try:
        predictor = RouterPredictor.from_mapping(model, engine.streamer.space)
        assert predictor is not None and sorted(predictor.routers) == [1, 2, 3]
        weight, bias = predictor.routers[1]
        assert weight.shape == (896, model.hparams["kimi-k3.embedding_length"]) and bias is not None
        assert math.isfinite(float(weight.sum()))
    finally:
        engine.close()


def test_a_split_set_whose_files_end_inside_a_page_streams(tmp_path):
    """Files of a split set end where their last tensor does (padded to 32 bytes, not to a page):
    expert and shard reads rounded out to whole pages stop at the end, with the stock tokens."""
    spec = synth.plan_like("kimi-k3", None, 0.06, "q4_1", synth.default_tokenizer(), synth.Cut(layers=4))
    paths = synth.write_model(spec, tmp_path / "k3s.gguf", seed=9, split_size=40 * MIB, progress=False, whole_layers=False).paths
    model = load_model_map(paths[0])
    ends_in_routed = [
        i for i, size in enumerate(model.file_sizes)
        if size % 4096 and any(t.file == i and t.role == "routed_experts" and t.offset + t.n_bytes == size for t in model.tensors)
    ]
    assert ends_in_routed, "the cut should leave a file ending inside a page with routed experts"
    expected = stock_reply(paths[0], tokens=8)
    engine = streamed_engine(paths[0], minimum_budget(model) + 2 * MIB)
    try:
        assert reply_tokens(engine, tokens=8) == expected
    finally:
        engine.close()


def test_two_slots_keep_each_conversations_kda_state(k3_model):
    """Two conversations taking turns in two slots of a streamed K3: each turn gives the tokens
    stock llama.cpp gives that conversation alone, and evaluates as many prompt tokens as there
    (its KDA state was parked while the other conversation ran, then put back)."""
    openers = {"a": "Tell me about foxes.", "b": "Name three rivers."}

    def turn(engine: Engine, messages: list[dict], slot: int | None, evaluated: list[int], held: list[int]) -> tuple[str, int]:
        """One turn; ``held``: what the conversation's context holds (its last prompt and reply),
        kept as it is and followed by the rest of the rendered prompt, so a turn can reuse it
        whatever the reply's text re-tokenizes to (the chat path's Engine.continuing)."""
        evaluated.clear()
        tokens, stops = engine.chat_prompt(messages)
        if held:
            said = engine.llm.detokenize(held, special=True)
            text = engine.llm.detokenize(tokens, special=True)
            assert text.startswith(said)
            tokens = held + engine.llm.tokenize(text[len(said):], add_bos=False, special=True)
        gen = engine.complete(tokens, Sampling(temperature=0.0, max_tokens=6, stop=stops), slot=slot)
        ids = [e.token_id for e in gen if e.token_id >= 0]
        # The context holds the prompt and every reply token but the last one sampled (an end of
        # generation token, or the one the token limit stopped after).
        held[:] = tokens + (ids[:-1] if gen.result.finish_reason == "length" else ids)
        messages += [{"role": "assistant", "content": gen.result.text}, {"role": "user", "content": "And then?"}]
        return gen.result.text, evaluated[0] if evaluated else 0, len(tokens)  # the prompt's decode: its new tokens

    def counting(engine: Engine) -> list[int]:
        evaluated: list[int] = []
        real_decode = engine.llm._ctx.decode
        engine.llm._ctx.decode = lambda batch: (evaluated.append(batch.batch.n_tokens), real_decode(batch))[1]
        return evaluated

    stock = Engine(k3_model, n_ctx=256, fast_load=False)
    stock.load()
    try:
        evaluated = counting(stock)
        expected = {}
        for name, opener in openers.items():  # each conversation alone, both turns
            messages, held = [{"role": "user", "content": opener}], []
            expected[name] = [turn(stock, messages, None, evaluated, held) for _ in range(2)]
    finally:
        stock.close()
    model = load_model_map(k3_model)
    engine = Engine(k3_model, n_ctx=512, budget=minimum_budget(model) + 2 * MIB, n_slots=2)
    engine.load()
    engine.pin()
    try:
        evaluated = counting(engine)
        conversations = {name: [{"role": "user", "content": opener}] for name, opener in openers.items()}
        helds: dict[str, list[int]] = {name: [] for name in openers}
        got: dict[str, list[tuple[str, int, int]]] = {name: [] for name in openers}
        for _ in range(2):
            for slot, name in enumerate(openers):
                before = len(helds[name])
                got[name].append(turn(engine, conversations[name], slot, evaluated, helds[name]))
                if before:  # the second turn evaluates only what it added: its KDA state came back
                    assert got[name][-1][1] == got[name][-1][2] - before
        assert got == expected
    finally:
        engine.close()


def test_k3_in_two_layer_slots_gives_the_stock_greedy_tokens(k3_paged):
    """The bounded address space (addressing.py) on K3's graph: four layers in two slots, so
    every layer takes over a slot another layer held, and the residual-attention scores (which
    the graph reads before their layer starts) come from the fixed region."""
    expected = stock_reply(k3_paged)
    model = load_model_map(k3_paged)
    engine = Engine(k3_paged, n_ctx=256, budget=minimum_budget(model) + 6 * MIB, address_space=205 * MIB)
    engine.load()
    engine.pin()
    try:
        space = engine.space
        assert space.bounded and space.n_slots == 2 and sum(model.file_sizes) > 205 * MIB
        assert len(space.plan.floating) == 2 * model.n_layers  # attn_res_score and ffn_res_score of each layer
        fixed_end = space.region + space.plan.fixed_bytes
        for run in space.plan.floating:  # their second place, which the graph's pointers get
            real, layer = space.real_address(space.phantoms[run.file] + run.lo)
            assert space.region <= real < fixed_end and layer is None
        assert reply_tokens(engine) == expected
        streamer = engine.streamer
        assert streamer.error is None and space.claims >= 16 * model.n_layers
        counters = streamer.counters()
        assert counters["expert_misses"] > 0
        # Cached experts keep their pages while another layer holds their slot (parked), so the
        # cache still hits across tokens, and the parked pages count as the model's.
        assert counters["expert_hits"] > 0 and streamer.parked_bytes > 0
        assert engine.metrics.model_resident_source() <= engine.budget
    finally:
        engine.close()


def test_k3s_pinned_weights_are_read_from_the_store_and_a_re_pin_keeps_the_stock_tokens(k3_paged, monkeypatch):
    """Weights the pinned store holds whole are pointed at the store itself, not at their
    slot's copy. A budget change replaces the store in the same room while the graph llama.cpp
    keeps for reuse still has views into it (K3 reshapes its recurrent weights): those are
    pointed at their windows before anything points into the new store."""
    expected = stock_reply(k3_paged)
    model = load_model_map(k3_paged)
    budget = minimum_budget(model) + 64 * MIB  # a micro-batch of 512 either side of the change: the context stays
    engine = Engine(k3_paged, n_ctx=256, budget=budget, address_space=205 * MIB)
    engine.load()
    engine.pin()
    try:
        space, pointers = engine.space, engine.pointers
        assert space.bounded and space.n_slots == 2
        assert reply_tokens(engine) == expected
        assert pointers.direct > 0 and not pointers.active
        store = space.store
        for tensor, (file, offset) in pointers._weights.items():  # a weight held whole points into the store
            place = space.direct_at(file, offset)
            if place is not None:
                assert store.address <= place < store.address + store.size
        got = []
        for event in engine.complete(PROMPT, Sampling(temperature=0.0, max_tokens=16)):
            got.append(event.token_id)
            if len(got) == 4:  # mid-reply: the next token reuses the last one's graph
                # The new store lays its pieces out the other way round: a view left pointing
                # into the old one's room would read other bytes there.
                within_runs = Windows.within_runs
                monkeypatch.setattr(Windows, "within_runs", lambda self, ranges: within_runs(self, ranges)[::-1])
                assert "next token" in engine.retune(budget=budget - 8 * MIB)
        assert [t for t in got if t >= 0] == expected and engine.streamer.error is None
        assert pointers.stale_pointed > 0  # the reused graph's views, pointed away from the old store's room
        assert pointers._stale is None and not pointers.active and pointers.direct > 0
        assert reply_tokens(engine) == expected
    finally:
        engine.close()
