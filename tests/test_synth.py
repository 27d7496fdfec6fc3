"""Synthetic models: sized as asked, valid for llama.cpp, streamed to disk, never half-written."""

from __future__ import annotations

import hashlib
import math
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader
from helpers import stock_llama

from kimitui.cli import main
from kimitui.errors import UserError
from kimitui.model import bulkio, default_model_path, synth
from kimitui.model.synth import archs, sizing
from kimitui.model.synth.blocks import _BLOCK_DTYPES, _STD_PER_SCALE, Filler
from kimitui.units import parse_size

MIB = 1024**2


@lru_cache(maxsize=None)
def read(path: Path) -> GGUFReader:
    """Parsing the 49k-token vocabulary takes seconds: once per file."""
    return GGUFReader(str(path))


def greedy_tokens(path: Path, n: int = 6) -> list[int]:
    """Load with llama-cpp-python, check the prompt's logits are finite, decode n tokens greedily."""
    llm = stock_llama(path, n_ctx=256, n_threads=1, logits_all=True)
    try:
        prompt = llm.tokenize(b"The capital of France is")
        llm.eval(prompt)
        assert np.isfinite(llm.scores[: llm.n_tokens]).all()
        out = []
        for _ in range(n):
            logits = llm.scores[llm.n_tokens - 1]
            assert np.isfinite(logits).all() and logits.std() > 0
            out.append(int(np.argmax(logits)))
            llm.eval([out[-1]])
        return out
    finally:
        llm.close()


@pytest.fixture(scope="module")
def tok():
    return synth.default_tokenizer()


@pytest.fixture(scope="module")
def models(tmp_path_factory, tok):
    """One small model of each kind, written once for the module."""
    root = tmp_path_factory.mktemp("synth")
    specs = {
        "dense": synth.plan_dense(100 * MIB, "q4_1", tok),
        "moe": synth.plan_moe(100 * MIB, "q4_1", tok),
        "kimi": synth.plan_like("kimi-k2", 100 * MIB, None, "q4_1", tok),
    }
    out = {}
    for name, spec in specs.items():
        result = synth.write_model(spec, root / f"{name}.gguf", seed=1, progress=False)
        out[name] = (spec, result)
    return out


@pytest.mark.parametrize("size", ["100MiB", "700MiB", "8GiB", "120GiB", "600GiB"])
def test_plans_land_within_one_percent_in_llama_like_shapes(size, tok):
    target = parse_size(size)
    dense = synth.plan_dense(target, "q4_1", tok)
    moe = synth.plan_moe(target, "q4_1", tok)
    for spec in (dense, moe):
        assert abs(spec.file_bytes() - target) <= 0.01 * target, spec.description
    n_embd = dense.kv_value("llama.embedding_length")
    assert 2 <= dense.kv_value("llama.feed_forward_length") / n_embd <= 4
    assert n_embd % dense.kv_value("llama.attention.head_count") == 0
    # llama.cpp reads a 26/27-layer deepseek2 as a "lite" model without q_lora: never emit one
    assert moe.kv_value("deepseek2.block_count") not in sizing.DEEPSEEK2_LITE_LAYERS


@pytest.mark.parametrize("size", ["100MiB", "2GiB", "64GiB", "500GiB"])
def test_kimi_like_keeps_counts_and_shrinks_widths(size, tok):
    target = parse_size(size)
    spec = synth.plan_like("kimi-k2", target, None, "q4_1", tok)
    assert abs(spec.file_bytes() - target) <= sizing.SIZE_TOLERANCE * target
    kv = spec.kv_value
    assert (kv("deepseek2.block_count"), kv("deepseek2.expert_count"), kv("deepseek2.expert_used_count")) == (61, 384, 8)
    assert (kv("deepseek2.expert_shared_count"), kv("deepseek2.leading_dense_block_count")) == (1, 1)
    assert kv("deepseek2.embedding_length") < archs.KIMI_K2["n_embd"]


def test_scale_one_is_kimi_k2_shape(tok):
    spec = synth.plan_like("kimi-k2", None, 1.0, "q4_1", tok)
    assert spec.kv_value("deepseek2.embedding_length") == 7168
    assert spec.kv_value("deepseek2.expert_feed_forward_length") == 2048
    assert spec.kv_value("deepseek2.attention.head_count") == 64
    # ~1.03T parameters at Q4_1's 5 bits per weight
    assert 550 * 1024**3 < spec.file_bytes() < 650 * 1024**3


def test_written_files_match_the_plan_byte_for_byte(models):
    for spec, result in models.values():
        assert result.paths[0].stat().st_size == spec.file_bytes()
        reader = read(result.paths[0])
        assert [t.name for t in reader.tensors] == [t.name for t in spec.tensors]
        assert [t.n_bytes for t in reader.tensors] == [t.n_bytes for t in spec.tensors]


def test_tokenizer_is_the_default_models(models):
    source = read(default_model_path())
    spec, result = models["moe"]
    copy = read(result.paths[0])
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.chat_template", "tokenizer.ggml.eos_token_id"):
        assert copy.fields[key].contents() == source.fields[key].contents()
    assert copy.fields["deepseek2.vocab_size"].contents() == 49152


def test_weights_are_valid_blocks_with_sane_scales(models):
    spec, result = models["dense"]
    reader = read(result.paths[0])
    t = next(t for t in reader.tensors if t.name == "blk.3.ffn_down.weight")
    blocks = np.asarray(t.data).reshape(-1).view(_BLOCK_DTYPES[t.tensor_type])
    d = blocks["d"].astype(np.float32)
    assert np.isfinite(d).all() and (d > 0).all()
    fan_in = int(t.shape[0])
    # dequantized std ~ 1/sqrt(fan-in), within the pool's half-octave rounding
    std = float(np.sqrt(np.mean((d * _STD_PER_SCALE[t.tensor_type]) ** 2)))
    assert 0.6 / math.sqrt(fan_in) < std < 1.7 / math.sqrt(fan_in)
    np.testing.assert_allclose(blocks["m"].astype(np.float32), -7.5 * d, rtol=2e-3)


@pytest.mark.parametrize("kind", ["dense", "moe", "kimi"])
def test_llama_cpp_loads_and_generates(models, kind):
    spec, result = models[kind]
    tokens = greedy_tokens(result.paths[0])
    assert len(tokens) == 6 and all(0 <= t < 49152 for t in tokens)


def test_moe_is_deepseek2_with_mla_and_sigmoid_router(models):
    spec, result = models["kimi"]
    reader = read(result.paths[0])
    assert reader.fields["general.architecture"].contents() == "deepseek2"
    names = {t.name for t in reader.tensors}
    assert {"blk.1.attn_k_b.weight", "blk.1.attn_v_b.weight", "blk.1.exp_probs_b.bias", "blk.0.ffn_gate.weight"} <= names
    assert "blk.0.ffn_gate_exps.weight" not in names  # the leading dense layer
    assert reader.fields["deepseek2.expert_gating_func"].contents() == 2


def test_router_makes_a_skewed_but_varying_hot_set(models):
    """Route Gaussian (RMS-normed) inputs through the file's own router and bias, as
    llama.cpp's sigmoid + exp_probs_b top-k does."""
    spec, result = models["kimi"]
    reader = read(result.paths[0])
    tensors = {t.name: t for t in reader.tensors}
    rng = np.random.default_rng(0)
    hot_sets = []
    for layer in (1, 30, 60):
        w = np.asarray(tensors[f"blk.{layer}.ffn_gate_inp.weight"].data, dtype=np.float64)  # (n_expert, n_embd)
        bias = np.asarray(tensors[f"blk.{layer}.exp_probs_b.bias"].data, dtype=np.float64)
        x = rng.normal(size=(2000, w.shape[1]))
        score = 1 / (1 + np.exp(-(x @ w.T))) + bias
        picks = np.argpartition(-score, 8, axis=1)[:, :8]
        counts = np.sort(np.bincount(picks.ravel(), minlength=384))[::-1]
        top_tenth = counts[:38].sum() / counts.sum()
        assert 0.35 < top_tenth < 0.9  # uniform would be 0.1; a fixed set 1.0
        assert len({tuple(sorted(p)) for p in picks}) > 1500  # tokens still differ
        hot_sets.append(set(np.argsort(bias)[-8:]))
    assert hot_sets[0] != hot_sets[1] != hot_sets[2]  # each layer has its own hot experts


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path, tok):
    spec = synth.plan_dense(100 * MIB, "q8_0", tok)

    def digest(seed: int, name: str) -> str:
        path = synth.write_model(spec, tmp_path / name, seed=seed, progress=False).paths[0]
        return hashlib.sha256(path.read_bytes()).hexdigest()

    first = digest(7, "a.gguf")
    assert digest(7, "b.gguf") == first
    assert digest(8, "c.gguf") != first


def test_split_set_is_named_like_llama_cpp_and_loads(tmp_path, tok):
    spec = synth.plan_dense(100 * MIB, "q4_1", tok)
    result = synth.write_model(spec, tmp_path / "m.gguf", split_size=40 * MIB, progress=False)
    assert [p.name for p in result.paths] == [f"m-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert all(p.stat().st_size <= 41 * MIB for p in result.paths)
    assert not (tmp_path / "m.gguf").exists()
    assert len(greedy_tokens(result.paths[0], n=2)) == 2


@pytest.mark.parametrize("whole_layers", [True, False])
def test_a_split_set_keeps_each_layer_in_one_file_unless_asked_to_cut_anywhere(tmp_path, tok, whole_layers):
    from kimitui.model.gguf_map import load_model_map

    spec = synth.plan_dense(100 * MIB, "q4_1", tok)
    paths = synth.write_model(spec, tmp_path / "m.gguf", split_size=30 * MIB, progress=False, whole_layers=whole_layers).paths
    model = load_model_map(paths[0])
    straddling = [layer for layer in range(model.n_layers) if len({r.file for r in model.layer_ranges(layer)}) > 1]
    assert len(paths) >= 3
    assert (straddling == []) if whole_layers else straddling  # gguf-split's cut lands inside layers


def test_interrupted_write_leaves_nothing_that_looks_complete(tmp_path, tok, monkeypatch):
    spec = synth.plan_dense(100 * MIB, "q4_1", tok)
    real = Filler.pieces
    written = []

    def pieces(self, t):
        if len(written) > 20:
            raise KeyboardInterrupt
        written.append(t.name)
        return real(self, t)

    monkeypatch.setattr(Filler, "pieces", pieces)
    with pytest.raises(KeyboardInterrupt):
        synth.write_model(spec, tmp_path / "m.gguf", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_existing_output_needs_force(tmp_path, tok):
    spec = synth.plan_dense(100 * MIB, "q4_1", tok)
    out = tmp_path / "m.gguf"
    out.write_bytes(b"precious")
    with pytest.raises(UserError, match="--force"):
        synth.write_model(spec, out, progress=False)
    assert out.read_bytes() == b"precious"
    synth.write_model(spec, out, force=True, progress=False)
    assert out.stat().st_size == spec.file_bytes()


def test_progress_line_only_on_a_terminal(monkeypatch):
    class Tty:
        def __init__(self, tty):
            self.text, self.tty = "", tty

        def isatty(self):
            return self.tty

        def write(self, s):
            self.text += s

        def flush(self):
            pass

    clock = iter(range(100))
    monkeypatch.setattr(bulkio.time, "monotonic", lambda: float(next(clock)))
    for tty in (True, False):
        stream = Tty(tty)
        bar = bulkio.Progress("synth", 1000, stream)
        bar.add(400)
        bar.close()
        assert ("400 B of 1000 B (40%)" in stream.text) is tty


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--size", "8GiB", "--scale", "0.5", "--like", "kimi-k2"], "not both"),
        (["--size", "8GiB", "--scale", "0.5"], "--scale needs --like"),
        (["--arch", "dense", "--like", "kimi-k2", "--size", "1GiB"], "MoE"),
        ([], "--size is required"),
        (["--size", "10MiB"], "cannot shape"),
        (["--size", "lots"], "--size"),
        (["--layers", "4"], "--layers and --experts cut a --like model"),
        (["--like", "kimi-k3", "--experts", "900"], "--experts must be in 1..896"),
        (["--like", "kimi-k2", "--layers", "1"], "--layers must be in 2..61"),
    ],
)
def test_cli_mistakes_are_one_line_exit_2(tmp_path, capsys, argv, message):
    assert main(["synth", str(tmp_path / "x.gguf"), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_cli_dry_run_and_write(tmp_path, capsys):
    out = tmp_path / "x.gguf"
    assert main(["synth", str(out), "--arch", "moe", "--size", "120MiB", "--dry-run"]) == 0
    assert "deepseek2" in capsys.readouterr().out and not out.exists()
    assert main(["synth", str(out), "--size", "100MiB", "--seed", "3"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert abs(out.stat().st_size - 100 * MIB) < MIB


def test_a_kimi_k2_slice_keeps_its_real_widths(tok):
    """--layers/--experts cut K2 as they cut K3: fewer layers and experts, an expert at its real size."""
    spec = synth.plan_like("kimi-k2", None, 1.0, "q4_1", tok, synth.Cut(layers=3, experts=16))
    assert spec.kv_value("deepseek2.block_count") == 3 and spec.kv_value("deepseek2.expert_count") == 16
    assert spec.kv_value("deepseek2.expert_used_count") == 8 and spec.kv_value("deepseek2.embedding_length") == 7168
    experts = [t for t in spec.tensors if t.name.startswith("blk.1.") and "_exps." in t.name]
    assert sum(t.n_bytes for t in experts) // 16 == 3 * 7168 * 2048 // 32 * 20  # Q4_1: 20 bytes per 32 weights


def test_verify_names_a_file_of_a_set_that_is_not_where_its_name_says(tmp_path, tok, capsys):
    from kimitui.cli import main

    spec = synth.plan_dense(100 * MIB, "q4_1", tok)
    paths = synth.write_model(spec, tmp_path / "m.gguf", split_size=40 * MIB, progress=False).paths
    assert main(["verify", str(paths[1])]) == 0
    assert "all 3 files good" in capsys.readouterr().out
    swap = tmp_path / "swap"
    paths[1].rename(swap)
    paths[2].rename(paths[1])
    swap.rename(paths[2])
    assert main(["verify", str(paths[0])]) == 1
    out = capsys.readouterr().out
    assert f"{paths[1]}: its header says split 3 of 3, its name says 2 of 3 (a file from another set?)" in out, out
