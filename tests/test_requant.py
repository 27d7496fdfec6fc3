"""`kimitui requant`, `verify --same-experts-as` and `kimitui quality` on real GGUFs: a K3 split
set with a BF16 trunk rewritten as Q8_0 and Q4_0 (stock llama.cpp and the streaming engine run
the result alike), resumed after an interruption, and the embedded model's own requantization
measured against itself."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from helpers import with_added_tokens
from kimitui.benchmarks.quality import BUILT_IN_TEXT, compare
from kimitui.cli import main
from kimitui.engine.budget import minimum_budget
from kimitui.errors import UserError
from kimitui.model import synth
from kimitui.model.gguf_map import ROUTED_EXPERTS, load_model_map
from kimitui.model.requant import requant_model, requantizes
from kimitui.model.verify_cmd import same_experts, verify

from test_kimi_k3 import reply_tokens, stock_reply, streamed_engine

MIB = 2**20


@pytest.fixture(scope="module")
def k3_bf16(tmp_path_factory) -> Path:
    """K3's 4-layer cut at a fiftieth of its widths with the release's types (BF16 trunk, MXFP4
    experts), split in files of whole layers as published sets are."""
    spec = synth.plan_like("kimi-k3", None, 0.02, "bf16", synth.default_tokenizer(), synth.Cut(layers=4))
    out = tmp_path_factory.mktemp("k3bf16") / "k3.gguf"
    return synth.write_model(spec, out, seed=3, split_size=12 * MIB, progress=False).paths[0]


@pytest.fixture(scope="module")
def k3_q8(k3_bf16, tmp_path_factory) -> Path:
    outdir = tmp_path_factory.mktemp("k3q8")
    requant_model(k3_bf16, outdir, trunk="q8_0", say=lambda line: None)
    return outdir / k3_bf16.name


def test_the_trunk_becomes_q8_0_and_the_experts_stay_byte_for_byte(k3_bf16, k3_q8):
    before, after = load_model_map(k3_bf16), load_model_map(k3_q8)
    assert len(before.files) > 2 and [f.name for f in after.files] == [f.name for f in before.files]
    old = {t.name: t for t in before.tensors}
    rewritten = 0
    for t in after.tensors:
        was = old[t.name]
        assert t.file == was.file and t.shape == was.shape  # each file keeps its tensors
        if t.role == ROUTED_EXPERTS:
            assert t.ggml_type == was.ggml_type == "MXFP4"
        elif requantizes(was):
            assert (was.ggml_type, t.ggml_type) == ("BF16", "Q8_0"), t.name
            rewritten += 1
        else:  # norms, routers, biases, KDA's convolutions and beta stay as they were
            assert t.ggml_type == was.ggml_type and t.n_bytes == was.n_bytes, t.name
    assert rewritten > 20
    assert 0.5 < after.trunk_bytes / before.trunk_bytes < 0.6  # 34 bytes a block of 32 against 64
    assert after.routed_bytes == before.routed_bytes
    result = same_experts(k3_q8, k3_bf16)
    assert not result.problems and result.tensors == 9 and result.n_bytes == before.routed_bytes
    assert not verify(k3_q8.parent, []).problems  # its manifest holds


def test_stock_llama_cpp_and_the_streaming_engine_agree_on_the_requantized_k3(k3_bf16, k3_q8):
    expected = stock_reply(k3_q8, tokens=10)
    assert len(set(expected)) > 3
    assert expected != stock_reply(k3_bf16, tokens=10)  # lossy: the trunk changed
    engine = streamed_engine(k3_q8, minimum_budget(load_model_map(k3_q8)) + 2 * MIB)
    try:
        assert reply_tokens(engine, tokens=10) == expected
    finally:
        engine.close()


def test_q4_0_where_the_rows_divide_into_its_blocks(k3_bf16, tmp_path):
    requant_model(k3_bf16, tmp_path, trunk="q4_0", say=lambda line: None)
    after = load_model_map(tmp_path / k3_bf16.name)
    types = {t.ggml_type for t in after.tensors if requantizes(t)}
    assert "Q4_0" in types and "BF16" not in types
    assert len(set(stock_reply(tmp_path / k3_bf16.name, tokens=8))) > 2


def test_a_flipped_expert_byte_is_named_by_verify(k3_bf16, k3_q8, tmp_path, capsys):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(k3_q8.parent, copy)
    victim = next(t for t in load_model_map(copy / k3_q8.name).tensors if t.role == ROUTED_EXPERTS)
    path = copy / load_model_map(copy / k3_q8.name).files[victim.file].name
    with path.open("r+b") as fh:
        fh.seek(victim.offset + victim.n_bytes // 2)
        byte = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte[0] ^ 0xFF]))
    result = same_experts(copy / k3_q8.name, k3_bf16)
    assert [p.name for p in result.problems] == [victim.name]
    assert main(["verify", str(copy / k3_q8.name), "--same-experts-as", str(k3_bf16)]) == 1
    assert f"{victim.name}: differs from {k3_bf16.name}" in capsys.readouterr().out


def test_an_interrupted_requant_resumes_and_rewrites_a_finished_file_that_changed(k3_bf16, k3_q8, tmp_path, monkeypatch):
    import kimitui.model.requant as requant

    real = requant.write_gguf_file
    calls = []

    def failing_third(path, arch, alignment, kv, infos, number, count, n_tensors, chunks, *rest):
        calls.append(path.name)
        if len(calls) == 3:  # the disk fills up in the middle of the third file

            def filling(inner):
                yield next(inner)
                raise OSError(28, "No space left on device", str(path))

            chunks = filling(chunks)
        return real(path, arch, alignment, kv, infos, number, count, n_tensors, chunks, *rest)

    monkeypatch.setattr(requant, "write_gguf_file", failing_third)
    with pytest.raises(UserError, match="No space left on device.*2 finished files kept.*run the same command again"):
        requant_model(k3_bf16, tmp_path, say=lambda line: None)
    monkeypatch.setattr(requant, "write_gguf_file", real)
    partial = tmp_path / requant.PARTIAL_DIR
    finished = sorted(p.name for p in partial.iterdir() if p.suffix == ".gguf")
    assert len(finished) == 2 and not any(p.name.endswith(".tmp") for p in partial.iterdir())  # the half file went
    with (partial / finished[1]).open("r+b") as fh:  # damaged after it was finished
        fh.seek(-1, os.SEEK_END)
        fh.write(b"\x55")
    said: list[str] = []
    result = requant_model(k3_bf16, tmp_path, say=said.append)
    assert result.resumed == 1
    assert any(finished[1] in line and "writing it again" in line for line in said)
    assert not partial.exists()
    for name in (f.name for f in load_model_map(k3_q8).files):  # the same bytes as one run
        assert (tmp_path / name).read_bytes() == (k3_q8.parent / name).read_bytes(), name


def test_a_sparse_source_gives_a_sparse_copy(tmp_path):
    spec = synth.plan_like("kimi-k3", None, 0.06, "bf16", synth.default_tokenizer(), synth.Cut(layers=4))
    source = synth.write_model(spec, tmp_path / "src" / "k3.gguf", seed=1, progress=False, sparse=True).paths[0]
    requant_model(source, tmp_path / "out", say=lambda line: None)
    out = tmp_path / "out" / source.name
    # Q8_0 of zeros is zeros: the source's holes stay holes (its routers, norms and the
    # embeddings' table hold data), and no byte more is allocated than in the source
    assert out.stat().st_blocks <= source.stat().st_blocks and out.stat().st_blocks * 512 < out.stat().st_size / 3
    result = same_experts(out, source)
    assert not result.problems and result.holes > result.n_bytes / 2  # compared unread where both are holes
    # Q4_0's block of zeros is not zero bytes (its 4-bit values are stored offset by 8): written out
    requant_model(source, tmp_path / "q4", trunk="q4_0", say=lambda line: None)
    q4 = load_model_map(tmp_path / "q4" / source.name)
    matrix = next(t for t in q4.tensors if t.ggml_type == "Q4_0" and t.name.endswith("attn_q.weight"))
    with open(q4.files[matrix.file], "rb") as fh:
        fh.seek(matrix.offset)
        block = fh.read(18)
    assert block[:2] in (b"\x00\x00", b"\x00\x80") and block[2:] == b"\x88" * 16  # scale +-0, every value 8


def test_requant_refuses_in_one_line(k3_bf16, k3_q8, tmp_path, capsys):
    assert main(["requant", str(k3_bf16), str(k3_bf16.parent)]) == 2
    assert "holds the source itself" in capsys.readouterr().err
    assert main(["requant", str(k3_bf16), str(k3_q8.parent)]) == 2
    err = capsys.readouterr().err
    assert "already in" in err and "--force" in err
    assert main(["requant", str(k3_q8), str(tmp_path)]) == 2  # its trunk is Q8_0 already
    err = capsys.readouterr().err
    assert "no trunk matrix to rewrite as Q8_0" in err and len(err.strip().splitlines()) == 1


def test_quality_is_zero_for_a_model_against_itself_and_not_for_its_requantization(model_path, tmp_path):
    same = compare(model_path, model_path, BUILT_IN_TEXT, n_ctx=160)
    assert same.tokens == 159 and same.ppl_model < 1000  # a real model on English prose, far from uniform (49,152)
    assert same.kl_max == 0.0 and same.top1_agreement == 1.0 and same.ppl_model == same.ppl_variant
    requant_model(model_path, tmp_path, trunk="q4_0", say=lambda line: None)
    lossy = compare(model_path, tmp_path / model_path.name, BUILT_IN_TEXT, n_ctx=160)
    assert lossy.kl_mean > 0.0 and lossy.top1_agreement < 1.0 and lossy.ppl_variant != lossy.ppl_model
    assert lossy.ppl_model == same.ppl_model


def test_quality_refuses_models_with_other_vocabularies(model_path, tmp_path, capsys):
    spec = synth.plan_dense(120 * MIB, "q4_1", with_added_tokens(synth.default_tokenizer(), 64))
    other = synth.write_model(spec, tmp_path / "other.gguf", seed=2, progress=False).paths[0]
    assert main(["quality", "--model", str(model_path), "--variant", str(other)]) == 2
    err = capsys.readouterr().err.strip()
    assert "its vocabulary differs from the model's" in err and len(err.splitlines()) == 1


def test_inspect_plans_the_requantized_copy_before_it_is_written(k3_bf16, k3_q8):
    from kimitui.engine.inspect_cmd import engine_plan, trunk_choices

    source = load_model_map(k3_bf16)
    budget = minimum_budget(source) + 4 * MIB
    choices = {c["trunk"]: c for c in trunk_choices(source, budget)}
    assert set(choices) == {None, "q8_0", "q4_0"} and choices[None]["types"] == ["BF16"]
    written = load_model_map(k3_q8)
    plan = engine_plan(written, budget)
    assert choices["q8_0"]["trunk_bytes"] == written.trunk_bytes
    assert choices["q8_0"]["tensor_bytes"] == written.tensor_bytes
    assert choices["q8_0"]["bytes_per_token"] == plan["trunk_bytes_per_token"] + plan["expert_bytes_per_token"]
    assert choices["q4_0"]["bytes_per_token"] < choices["q8_0"]["bytes_per_token"] < choices[None]["bytes_per_token"]
    assert trunk_choices(written, budget)[0]["types"] == ["Q8_0"]


def test_quality_opens_a_split_set_at_any_of_its_files(model_path, tmp_path):
    """The embedded model sharded into a split set: the same weights, so KL 0, whichever file is named."""
    from kimitui.model.shard import shard_model

    shard_model(model_path, tmp_path, file_size=32 * MIB)
    second = sorted(tmp_path.glob("*-00002-of-*.gguf"))[0]
    same = compare(model_path, second, BUILT_IN_TEXT, n_ctx=96)
    assert same.tokens == 95 and same.kl_max == 0.0 and same.top1_agreement == 1.0


def test_a_quantized_trunk_is_rewritten_byte_for_byte_as_llama_quantize_writes_it(model_path, tmp_path):
    """The embedded model (Q4_1) as Q8_0: every matrix requant rewrites holds llama.cpp's own
    llama_model_quantize bytes."""
    import llama_cpp as C

    params = C.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize, params.nthread = C.LLAMA_FTYPE_MOSTLY_Q8_0, True, 2
    reference = tmp_path / "reference.gguf"
    assert C.llama_model_quantize(str(model_path).encode(), str(reference).encode(), C.byref(params)) == 0
    requant_model(model_path, tmp_path / "ours", trunk="q8_0", say=lambda line: None)
    ours, theirs = load_model_map(tmp_path / "ours" / model_path.name), load_model_map(reference)
    by_name = {t.name: t for t in theirs.tensors}
    compared = 0
    with open(ours.files[0], "rb") as a, open(theirs.files[0], "rb") as b:
        for t in ours.tensors:
            other = by_name[t.name]
            if t.ggml_type == other.ggml_type == "Q8_0":
                a.seek(t.offset)
                b.seek(other.offset)
                assert a.read(t.n_bytes) == b.read(other.n_bytes), t.name
                compared += 1
    assert compared > 200


def test_bf16_rows_quantize_as_the_reference_but_for_ties(tmp_path):
    """The SIMD quantizer BF16 sources take: the same scales, every value within one step of
    ggml's reference, and nearly every value identical."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    from kimitui.model.requant import quantize_rows, to_float32

    bf16 = (np.random.default_rng(0).standard_normal(256 * 4096).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    rows = to_float32(bf16.tobytes(), "BF16", 4096)
    with ThreadPoolExecutor(2) as pool:
        fast = np.frombuffer(bytes(quantize_rows(rows, "Q8_0", pool, 2)), np.uint8).reshape(-1, 34)
        exact = np.frombuffer(bytes(quantize_rows(rows, "Q8_0", pool, 2, exact=True)), np.uint8).reshape(-1, 34)
    assert (fast[:, :2] == exact[:, :2]).all()
    steps = np.abs(fast[:, 2:].view(np.int8).astype(int) - exact[:, 2:].view(np.int8).astype(int))
    assert steps.max() <= 1 and steps.mean() < 0.002  # 0.07% of the values here, at (near-)ties
