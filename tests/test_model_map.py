"""The model map: every tensor's bytes, layer and role; shards; expert slices; inspect."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
from gguf import GGUFReader

from kimitui.cli import main
from kimitui.errors import UserError
from kimitui.model import default_model_path, read_model_info, synth
from kimitui.model.gguf_map import (
    ATTENTION,
    DENSE_FFN,
    EMBEDDING,
    NORM,
    OTHER,
    OUTPUT,
    ROUTED_EXPERTS,
    ROUTER,
    SHARED_EXPERTS,
    classify,
    load_model_map,
    merge_ranges,
    ByteRange,
)

MIB = 1024**2


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("maps")
    tok = synth.default_tokenizer()
    dense = synth.plan_dense(100 * MIB, "q4_1", tok)
    moe = synth.plan_moe(100 * MIB, "q4_1", tok)
    return {
        "dense": synth.write_model(dense, root / "dense.gguf", progress=False).paths[0],
        "moe": synth.write_model(moe, root / "moe.gguf", progress=False).paths[0],
        "split": synth.write_model(dense, root / "split.gguf", split_size=40 * MIB, progress=False).paths,
    }


@pytest.fixture(scope="module")
def dense(files):
    return load_model_map(files["dense"], shard_size=4 * MIB)


@pytest.fixture(scope="module")
def moe(files):
    return load_model_map(files["moe"], shard_size=4 * MIB)


@pytest.mark.parametrize(
    "name, expected",
    [
        ("token_embd.weight", (None, EMBEDDING)),
        ("output.weight", (None, OUTPUT)),
        ("output_norm.weight", (None, NORM)),
        ("rope_freqs.weight", (None, OTHER)),
        ("blk.0.attn_q_a_norm.weight", (0, NORM)),
        ("blk.3.attn_kv_a_mqa.weight", (3, ATTENTION)),
        ("blk.3.attn_k_b.weight", (3, ATTENTION)),
        ("blk.12.ffn_gate.weight", (12, DENSE_FFN)),
        ("blk.12.ffn_down_exps.weight", (12, ROUTED_EXPERTS)),
        ("blk.12.ffn_gate_up_exps.weight", (12, ROUTED_EXPERTS)),
        ("blk.12.ffn_up_shexp.weight", (12, SHARED_EXPERTS)),
        ("blk.12.ffn_gate_inp_shexp.weight", (12, SHARED_EXPERTS)),
        ("blk.12.ffn_gate_inp.weight", (12, ROUTER)),
        ("blk.12.exp_probs_b.bias", (12, ROUTER)),
        ("blk.60.ffn_norm.weight", (60, NORM)),
        ("blk.61.nextn.eh_proj.weight", (61, OTHER)),
    ],
)
def test_classify_llama_cpp_names(name, expected):
    assert classify(name) == expected


def test_sizes_add_up_to_the_files_tensor_bytes(files, dense, moe):
    for path, m in ((files["dense"], dense), (files["moe"], moe)):
        info = read_model_info(path)  # the foundation's independent count
        assert m.tensor_bytes == info.tensor_bytes
        assert sum(s.tensor_bytes for s in m.shards) == m.tensor_bytes
        assert sum(layer.n_bytes for layer in m.layers) + m.nonlayer_bytes == m.tensor_bytes
        assert m.trunk_bytes + m.routed_bytes == m.tensor_bytes
        reader = GGUFReader(str(path))
        assert [(t.name, int(t.data_offset), int(t.n_bytes)) for t in reader.tensors] == [
            (t.name, t.offset, t.n_bytes) for t in m.tensors
        ]


def test_roles_and_layers_of_a_dense_model(dense):
    assert dense.architecture == "llama" and dense.n_layers == 8 and not dense.is_moe
    assert {t.role for t in dense.tensors} == {EMBEDDING, OUTPUT, NORM, ATTENTION, DENSE_FFN}
    assert dense.trunk_bytes == dense.tensor_bytes and dense.bytes_per_expert == 0
    names = {t.name for t in dense.layer_tensors(5)}
    assert "blk.5.ffn_up.weight" in names and all(n.startswith("blk.5.") for n in names)


@pytest.mark.parametrize("which", ["dense", "moe"])
@pytest.mark.parametrize("shard_size", [4 * MIB, 64 * MIB])
def test_shards_are_contiguous_tensor_runs_inside_one_layer(request, which, shard_size):
    m = request.getfixturevalue(which).regroup(shard_size)
    covered = []
    for s in m.shards:
        ts = [m.tensors[i] for i in s.tensors]
        assert {t.layer for t in ts} == {s.layer}
        assert {t.file for t in ts} == {s.file}
        assert {t.role == ROUTED_EXPERTS for t in ts} == {s.routed}
        assert s.offset == ts[0].offset and s.offset + s.length == ts[-1].offset + ts[-1].n_bytes
        assert s.length <= shard_size or len(ts) == 1
        # no tensor outside the shard lies inside its range
        assert not [t for t in m.tensors if t.index not in s.tensors and s.offset <= t.offset < s.offset + s.length]
        covered += s.tensors
    assert sorted(covered) == list(range(len(m.tensors)))
    assert all(set(layer.shards) == {s.index for s in m.shards if s.layer == layer.index} for layer in m.layers)


def test_smaller_shard_size_means_more_shards(dense):
    assert len(dense.regroup(4 * MIB).shards) > len(dense.regroup(64 * MIB).shards)
    with pytest.raises(UserError, match="outside"):
        dense.regroup(1 * MIB)


def test_layer_ranges_hold_exactly_the_layer(moe):
    for layer in (0, 4):
        ranges = moe.layer_ranges(layer)
        inside = [
            t for t in moe.tensors if any(r.offset <= t.offset and t.offset + t.n_bytes <= r.end for r in ranges)
        ]
        assert {t.layer for t in inside} == {layer}
        assert sum(t.n_bytes for t in inside) == moe.layers[layer].n_bytes
        trunk = moe.layer_ranges(layer, experts=False)
        assert sum(r.length for r in trunk) >= moe.layers[layer].trunk_bytes
    with pytest.raises(IndexError):
        moe.layer_ranges(moe.n_layers)
    nonlayer = moe.nonlayer_ranges()
    assert sum(r.length for r in nonlayer) >= moe.nonlayer_bytes
    for name in ("token_embd.weight", "output_norm.weight", "output.weight"):
        t = moe.tensor(name)
        assert any(r.offset <= t.offset and t.offset + t.n_bytes <= r.end for r in nonlayer)


def test_expert_slices_match_the_gguf_packages_view(files, moe):
    layer = moe.layers[3]
    assert layer.is_moe and layer.n_expert == 64 and moe.n_expert_used == 6 and moe.n_expert_shared == 2
    assert not moe.layers[0].is_moe  # the leading dense layer
    routed = [t for t in moe.layer_tensors(3) if t.role == ROUTED_EXPERTS]
    assert len(routed) == 3 and layer.expert_bytes == sum(t.n_bytes // 64 for t in routed)
    tensors = {t.name: t for t in GGUFReader(str(files["moe"])).tensors}
    with open(files["moe"], "rb") as fh:
        for expert in (0, 17, 63):
            ranges = moe.expert_ranges(3, expert)
            assert len(ranges) == 3
            for t, r in zip(routed, ranges):
                fh.seek(r.offset)
                # the gguf package's numpy view: the outermost axis is the expert
                assert fh.read(r.length) == np.asarray(tensors[t.name].data)[expert].tobytes()
    slices = sorted((r.offset, r.end) for e in range(64) for r in moe.expert_ranges(3, e))
    assert all(a[1] == b[0] for a, b in zip(slices, slices[1:]))  # tile the tensors, no overlap
    with pytest.raises(IndexError):
        moe.expert_ranges(0, 0)


def test_active_bytes_and_read_bytes_per_token(moe, dense):
    table = moe.tensor("token_embd.weight")
    row = table.n_bytes // table.shape[1]
    moe_layers = sum(1 for layer in moe.layers if layer.is_moe)
    expected = moe.trunk_bytes - table.n_bytes + row + 6 * moe.bytes_per_expert * moe_layers
    assert moe.active_bytes_per_token == expected
    assert moe.read_bytes_per_token(0) == expected
    assert moe.read_bytes_per_token(moe.tensor_bytes) == 0
    every_token = moe.trunk_bytes - table.n_bytes
    assert moe.read_bytes_per_token(every_token) == expected - every_token
    budgets = np.linspace(0, moe.tensor_bytes, 40).astype(int)
    reads = [moe.read_bytes_per_token(int(b)) for b in budgets]
    assert all(a >= b for a, b in zip(reads, reads[1:]))
    assert moe.tok_s_floor(1e9, 0) == pytest.approx(1e9 / expected)
    assert moe.tok_s_floor(1e9, moe.tensor_bytes) is None
    # dense: pinning 40 MiB saves 40 MiB per token
    assert dense.read_bytes_per_token(0) - dense.read_bytes_per_token(40 * MIB) == 40 * MIB


def test_tied_embeddings_are_read_whole():
    m = load_model_map(default_model_path())  # SmolLM2: no output.weight, token_embd is the output matrix
    assert OUTPUT not in {t.role for t in m.tensors}
    assert m.active_bytes_per_token == m.tensor_bytes
    table = m.tensor("token_embd.weight").n_bytes
    assert m.read_bytes_per_token(table) == m.tensor_bytes - table


def test_merge_ranges_bridges_alignment_padding_only():
    ranges = [ByteRange(0, 100, 10), ByteRange(0, 0, 90), ByteRange(0, 141, 5), ByteRange(0, 178, 2), ByteRange(1, 0, 5)]
    merged = merge_ranges(ranges, gap=32)  # 31 bytes of padding bridge, 32 do not
    assert merged == [ByteRange(0, 0, 146), ByteRange(0, 178, 2), ByteRange(1, 0, 5)]
    assert merge_ranges(ranges[:2]) == [ByteRange(0, 0, 90), ByteRange(0, 100, 10)]


def test_split_set_found_from_any_member(files, dense):
    paths = files["split"]
    assert len(paths) == 3
    for member in (paths[0], paths[2]):
        m = load_model_map(member, shard_size=4 * MIB)
        assert m.files == tuple(paths)
        assert [t.name for t in m.tensors] == [t.name for t in dense.tensors]
        assert m.tensor_bytes == dense.tensor_bytes
        assert {t.file for t in m.tensors} == {0, 1, 2}
        for t in m.tensors:
            assert t.offset + t.n_bytes <= m.file_sizes[t.file]
        assert all(len({m.tensors[i].file for i in s.tensors}) == 1 for s in m.shards)


def test_missing_split_file_is_one_clear_line(files, tmp_path):
    for p in files["split"][:2]:
        shutil.copy(p, tmp_path / p.name)
    with pytest.raises(UserError) as err:
        load_model_map(tmp_path / files["split"][0].name)
    message = str(err.value)
    assert "split-00003-of-00003.gguf is missing" in message and "\n" not in message


def test_truncated_file_names_file_and_tensor(files, tmp_path):
    cut = tmp_path / "cut.gguf"
    data = files["dense"].read_bytes()
    cut.write_bytes(data[: len(data) - 3 * MIB])
    with pytest.raises(UserError, match=r"cut\.gguf: tensor output\.weight ends at byte \d+ but the file has \d+ bytes"):
        load_model_map(cut)
    cut.write_bytes(data[:4096])  # inside the vocabulary
    with pytest.raises(UserError, match="corrupt or truncated GGUF header"):
        load_model_map(cut)
    cut.write_bytes(b"PK\x03\x04" + data[4:1000])
    with pytest.raises(UserError, match="not a GGUF file"):
        load_model_map(cut)
    with pytest.raises(UserError, match="not found"):
        load_model_map(tmp_path / "nope.gguf")


def test_a_tensor_offset_out_of_place_is_named_before_llama_cpp(files, tmp_path):
    """llama.cpp wants every tensor right after the one before it (aligned); a header that says
    otherwise is one line here, not a failed load inside llama.cpp."""
    from gguf import GGUFReader

    reader = GGUFReader(files["dense"])
    field = reader.tensors[1].field
    at = field.parts[-1].ctypes.data - reader.data.ctypes.data  # the tensor's data offset, in the file
    moved = int(field.parts[-1][0]) + 32
    name = bytes(field.parts[1]).decode()
    data = bytearray(files["dense"].read_bytes())
    del reader, field
    data[at : at + 8] = moved.to_bytes(8, "little")
    bad = tmp_path / "moved.gguf"
    bad.write_bytes(data)
    with pytest.raises(UserError, match=rf"moved\.gguf: tensor {re.escape(name)} starts at data offset {moved}, but the tensors before it end at \d+"):
        load_model_map(bad)


def test_inspect_json_agrees_with_the_map(files, moe, capsys):
    assert main(["inspect", str(files["moe"]), "--json", "--budget", "20MiB", "--bandwidth", "500MB/s", "--shard-size", "4MiB"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["architecture"] == "deepseek2" and report["n_layers"] == moe.n_layers
    assert report["trunk_bytes"] == moe.trunk_bytes and report["bytes_per_expert"] == moe.bytes_per_expert
    assert report["active_bytes_per_token"] == moe.active_bytes_per_token
    assert report["n_shards"] == len(moe.shards) == len(report["shards"])
    read = moe.read_bytes_per_token(20 * MIB)
    assert report["read_bytes_per_token"] == read
    assert report["tok_s_floor"] == pytest.approx(500e6 / read)


def test_inspect_table_is_compact(files, capsys):
    assert main(["inspect", str(files["moe"]), "--budget", "0"]) == 0
    out = capsys.readouterr().out
    assert "64 experts, 6 used per token, 2 shared" in out and "tok/s at" in out
    assert "1-9 " in out  # identical MoE layers collapse into one row
    assert len(out.splitlines()) < 15


@pytest.mark.parametrize(
    "flags, message",
    [(["--bandwidth", "fast"], "--bandwidth"), (["--shard-size", "2GiB"], "outside"), (["--budget", "-1"], "--budget")],
)
def test_inspect_mistakes_exit_2(files, capsys, flags, message):
    assert main(["inspect", str(files["dense"]), *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_inspect_into_a_closed_pipe_is_quiet(files):
    """`kimitui inspect M | head -1`: the reader leaves early; no traceback, no error."""
    import subprocess
    import sys

    import os

    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first write: that write breaks the pipe
    proc = subprocess.run([sys.executable, "-m", "kimitui", "inspect", str(files["dense"]), "--json"],
                          stdout=write_end, stderr=subprocess.PIPE, timeout=60)
    os.close(write_end)
    assert proc.returncode == 0 and proc.stderr == b"", proc.stderr.decode()
