"""Shards on disk: layer-aligned split sets that plain llama.cpp loads, their manifest and
`verify`, sets spread over directories (model.paths), and every bad file named in one line."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType
from helpers import stock_llama

from kimitui.cli import main, resolve_model
from kimitui.config import load_settings
from kimitui.errors import UserError
from kimitui.model import synth
from kimitui.model.gguf_map import ROUTED_EXPERTS, _open_reader, load_model_map
from kimitui.engine.inspect_cmd import file_layout, render
from kimitui.model.manifest import MANIFEST_NAME, read_manifest
from kimitui.model.placement import assemble_split_set
from kimitui.model.shard import PARTIAL_DIR, shard_model

MIB = 1024**2
FILE_SIZE = 16 * MIB
SPLIT_KEYS = {"split.no", "split.count", "split.tensors.count"}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """A dense model as a split set that cuts layers (synth's size-based split, as gguf-split
    does) and an MoE model as one file: both kinds of source."""
    root = tmp_path_factory.mktemp("sources")
    tok = synth.default_tokenizer()
    dense = synth.write_model(synth.plan_dense(100 * MIB, "q4_1", tok), root / "dense.gguf", split_size=40 * MIB, progress=False, whole_layers=False)
    moe = synth.write_model(synth.plan_moe(120 * MIB, "q4_1", tok), root / "moe.gguf", progress=False)
    return {"dense": dense.paths[0], "moe": moe.paths[0]}


@pytest.fixture(scope="module")
def sharded(sources, tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded")
    dense = shard_model(sources["dense"], root / "dense", file_size=FILE_SIZE)
    moe = shard_model(sources["moe"], root / "moe", file_size=FILE_SIZE, trunk_first=True)
    return {
        "dense": [dense.directory / f.name for f in dense.files],
        "moe": [moe.directory / f.name for f in moe.files],
    }


def completion(path: Path) -> tuple[str, int]:
    llm = stock_llama(path, n_ctx=256)
    try:
        out = llm.create_completion("The capital of France is", max_tokens=8, temperature=0)
        return out["choices"][0]["text"], out["usage"]["completion_tokens"]
    finally:
        llm.close()


@lru_cache(maxsize=None)
def mapped(path: Path):
    """Parsing the 49k-token vocabulary takes seconds: once per file."""
    return load_model_map(path)


@lru_cache(maxsize=None)
def fields(path: Path) -> dict:
    reader = _open_reader(path)
    return {k: (f.types, f.contents()) for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def copy_set(files: list[Path], where: Path) -> list[Path]:
    where.mkdir()
    for f in files + [files[0].parent / MANIFEST_NAME]:
        shutil.copy(f, where / f.name)
    return [where / f.name for f in files]


# --- the split set itself ------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_plain_llama_cpp_loads_the_set_and_says_the_same(kind, sources, sharded):
    original = completion(sources[kind])
    assert original[1] == 8  # eight real tokens, not an early stop that anything would match
    assert completion(sharded[kind][0]) == original


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_same_tensors_same_bytes_same_metadata(kind, sources, sharded):
    before, after = mapped(sources[kind]), mapped(sharded[kind][0])
    assert len(after.files) == len(sharded[kind]) > 3
    assert sorted((t.name, t.shape, t.ggml_type) for t in before.tensors) == sorted(
        (t.name, t.shape, t.ggml_type) for t in after.tensors
    )
    maps = {}

    def data(m, t):
        path = m.files[t.file]
        if path not in maps:
            maps[path] = np.memmap(path, mode="r")
        return maps[path][t.offset : t.offset + t.n_bytes]

    for t in after.tensors:
        assert np.array_equal(data(after, t), data(before, before.tensor(t.name))), t.name

    # every key of the source in the first file, as llama.cpp's gguf-split writes it; the
    # other files carry only what llama.cpp reads from them
    source_fields = {k: v for k, v in fields(before.files[0]).items() if k not in SPLIT_KEYS}
    count = len(after.files)
    for number, path in enumerate(after.files):
        got = fields(path)
        assert got.pop("split.no") == ([GGUFValueType.UINT16], number)
        assert got.pop("split.count") == ([GGUFValueType.UINT16], count)
        assert got.pop("split.tensors.count") == ([GGUFValueType.INT32], len(before.tensors))
        if number == 0:
            assert got == source_fields
            assert "tokenizer.chat_template" in got
        else:
            assert set(got) == {"general.architecture"}


def test_no_file_cuts_a_layer(sharded):
    m = mapped(sharded["dense"][0])
    files_of_layer: dict = {}
    for t in m.tensors:
        files_of_layer.setdefault(t.layer, set()).add(t.file)
    assert all(len(f) == 1 for f in files_of_layer.values()), files_of_layer
    # files fill up to the size; one bigger than it holds a single layer (or the non-layer tensors)
    for index, size in enumerate(m.file_sizes):
        layers = {t.layer for t in m.tensors if t.file == index}
        assert size <= FILE_SIZE + MIB or len(layers) == 1
    assert sum(1 for s in m.file_sizes if s < FILE_SIZE // 2) <= 2  # packed, not one file per layer


def test_trunk_first_puts_the_trunk_in_files_of_its_own(sharded):
    m = mapped(sharded["moe"][0])
    routed_files = {t.file for t in m.tensors if t.role == ROUTED_EXPERTS}
    trunk_files = {t.file for t in m.tensors if t.role != ROUTED_EXPERTS}
    assert trunk_files.isdisjoint(routed_files)
    assert max(trunk_files) < min(routed_files)  # the trunk comes first
    assert {t.role for t in m.tensors if t.file in trunk_files} >= {"embedding", "attention", "norm", "router", "shared_experts", "output"}
    parts: dict = {}
    for t in m.tensors:
        parts.setdefault((t.layer, t.role == ROUTED_EXPERTS), set()).add(t.file)
    assert all(len(f) == 1 for f in parts.values()), parts
    assert m.is_moe and len(routed_files) > 1


def test_inspect_shows_which_layers_and_experts_each_file_holds(sources, sharded, capsys):
    assert main(["inspect", str(sharded["moe"][0]), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    layout = report["file_layout"]
    assert report["cut_layers"] == [] and len(layout) == len(sharded["moe"])
    assert "token_embd.weight" in layout[0]["nonlayer"]
    expert_files = [f for f in layout if f["expert_layers"]]
    assert all(not f["trunk_layers"] and f["n_expert"] == report["n_expert"] for f in expert_files)
    held = sorted(layer for f in expert_files for layer in f["expert_layers"])
    assert held == [layer["index"] for layer in report["layers"] if layer["n_expert"]]

    text = render(report)
    assert f"files    {len(layout)}, no layer cut across files" in text
    assert f"{sharded['moe'][-1].name}" in text and f"({report['n_expert']} experts)" in text

    # The shard directory itself names the model, as `verify DIR` takes it.
    assert main(["inspect", str(sharded["moe"][0].parent), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["file_layout"] == layout

    # synth's size-based split cuts layers; inspect says which
    _, cuts = file_layout(mapped(sources["dense"]))
    assert cuts and all(len(c["files"]) == 2 for c in cuts)
    assert "layer parts cut across files" in render({**report, "cut_layers": cuts})


# --- manifest and verify -------------------------------------------------------------------


def test_manifest_lists_sizes_and_checksums(sharded):
    manifest = read_manifest(sharded["moe"][0].parent / MANIFEST_NAME)
    assert [f.name for f in manifest.files] == [p.name for p in sharded["moe"]]
    for entry, path in zip(manifest.files, sharded["moe"]):
        assert entry.bytes == path.stat().st_size
        assert entry.checksum == hashlib.new(manifest.checksum, path.read_bytes()).hexdigest()


def test_verify_names_every_missing_or_damaged_file(sharded, tmp_path, capsys):
    files = copy_set(sharded["dense"], tmp_path / "copy")
    assert main(["verify", str(files[0].parent)]) == 0
    assert capsys.readouterr().out.startswith(f"all {len(files)} files good")

    files[1].unlink()
    with files[2].open("r+b") as fh:
        fh.truncate(files[2].stat().st_size - 4096)
    with files[3].open("r+b") as fh:  # same size, one byte changed mid-file
        fh.seek(files[3].stat().st_size // 2)
        byte = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte[0] ^ 0xFF]))
    assert main(["verify", str(files[0].parent)]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 4
    assert files[1].name in lines[0] and "missing" in lines[0]
    assert str(files[2]) in lines[1] and "truncated" in lines[1]
    assert str(files[3]) in lines[2] and "damaged" in lines[2]
    assert lines[3].startswith(f"3 of {len(files)} files bad")


def test_verify_usage_errors_exit_2(tmp_path, capsys):
    assert main(["verify", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kimitui: no kimitui-manifest.json in") and "\n" not in err


# --- loading: bad files named in one line, sets over two directories -----------------------


def one_line_exit_2(argv, capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("kimitui: ")
    return err


def test_load_path_names_a_missing_truncated_or_altered_file(sharded, tmp_path, capsys):
    from kimitui.engine.session import Engine

    files = copy_set(sharded["moe"], tmp_path / "copy")
    first = str(files[0])
    files[-1].rename(tmp_path / "aside.gguf")
    assert files[-1].name in one_line_exit_2(["--model", first], capsys)
    (tmp_path / "aside.gguf").rename(files[-1])

    data = files[3].read_bytes()
    files[3].write_bytes(data[: len(data) - 100_000])  # inside the last tensor
    err = one_line_exit_2(["--model", first], capsys)
    assert str(files[3]) in err and "truncated" in err
    files[3].write_bytes(data[:-10])  # only padding lost: the manifest's size tells
    err = one_line_exit_2(["--model", first], capsys)
    assert str(files[3]) in err and "truncated copy" in err

    files[3].write_bytes(data[:-4096] + bytes(4096))  # a copy that stopped in a preallocated file
    err = one_line_exit_2(["--model", str(files[2])], capsys)  # any file of the set will do
    assert str(files[3]) in err and "differ" in err
    with pytest.raises(UserError, match=files[3].name):  # the engine checks the same way
        Engine(files[0]).load()


def test_set_spread_over_two_directories_loads_via_model_paths(sharded, tmp_path, capsys):
    trunk_dir, ssd = tmp_path / "internal", tmp_path / "ssd"
    files = copy_set(sharded["moe"], trunk_dir)
    ssd.mkdir()
    manifest = read_manifest(trunk_dir / MANIFEST_NAME)
    n_trunk = 2
    for f in files[n_trunk:]:
        f.rename(ssd / f.name)
    config = tmp_path / "config.toml"
    config.write_text(f'[model]\npath = "{files[0]}"\npaths = ["{ssd}"]\n')

    path = resolve_model(load_settings(config, explicit=True))
    cache = Path(os.environ["XDG_CACHE_HOME"])
    assert path.name == files[0].name and cache in path.parents  # symlinks in the user cache
    real = [files[0], files[1]] + [ssd / f.name for f in files[n_trunk:]]
    assert [os.path.realpath(p) for p in sorted(path.parent.iterdir())] == [os.path.realpath(p) for p in real]
    assert completion(path) == completion(sharded["moe"][0])
    assert assemble_split_set(files[0], [ssd]) == path  # reused, not rebuilt

    # inspect finds the set the same way and says where each file really is
    assert main(["inspect", str(files[0]), "--config", str(config), "--json"]) == 0
    layout = json.loads(capsys.readouterr().out)["file_layout"]
    assert [f["file"] for f in layout] == [os.path.realpath(p) for p in real]

    # verify finds the files in model.paths too
    assert main(["verify", str(trunk_dir), "--config", str(config)]) == 0
    assert f"all {len(manifest.files)} files good" in capsys.readouterr().out

    (ssd / files[3].name).unlink()
    (ssd / files[5].name).unlink()
    config.write_text(f'[model]\npath = "{files[0]}"\npaths = ["{ssd}"]\n')
    err = one_line_exit_2(["--config", str(config)], capsys)
    assert f"{files[3].name}, {files[5].name} not found" in err and str(ssd) in err and "line 2" in err


def test_model_paths_must_be_a_list_of_strings(tmp_path, capsys):
    config = tmp_path / "config.toml"
    config.write_text('[model]\npath = ""\npaths = "/mnt/ssd"\n')
    err = one_line_exit_2(["--config", str(config)], capsys)
    assert "line 3: model.paths: expected a list of strings" in err


# --- writing safely ------------------------------------------------------------------------


def test_interrupted_or_failed_run_leaves_nothing_that_looks_complete(sources, sharded, tmp_path, monkeypatch, capsys):
    import errno

    from kimitui.model import bulkio

    class Stop(bulkio.Progress):
        error: BaseException

        def add(self, n: int) -> None:
            super().add(n)
            if self.done > self.total // 2:
                raise self.error

    monkeypatch.setattr("kimitui.model.shard.Progress", Stop)
    # a full disk: one line, and nothing left behind
    Stop.error = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    err = one_line_exit_2(["shard", str(sources["moe"]), str(tmp_path / "new")], capsys)
    assert "No space left on device" in err and "partial files removed" in err
    assert list((tmp_path / "new").iterdir()) == []
    # ctrl+c over an existing set with --force: the old set stays whole until the new one is
    Stop.error = KeyboardInterrupt()
    files = copy_set(sharded["moe"], tmp_path / "old")
    with pytest.raises(KeyboardInterrupt):
        shard_model(sources["moe"], files[0].parent, file_size=4 * FILE_SIZE, force=True)
    assert sorted(p.name for p in files[0].parent.iterdir()) == sorted([f.name for f in files] + [MANIFEST_NAME])
    assert main(["verify", str(files[0].parent)]) == 0


def test_refuses_to_overwrite_without_force(sources, sharded, tmp_path, capsys):
    files = copy_set(sharded["moe"], tmp_path / "out")
    out = str(files[0].parent)
    err = one_line_exit_2(["shard", str(sources["moe"]), out], capsys)
    assert "already in" in err and "--force" in err
    (files[0].parent / PARTIAL_DIR).mkdir()  # as a killed run leaves it
    assert main(["shard", str(sources["moe"]), out, "--shard-size", "64MiB", "--force"]) == 0
    assert "wrote" in capsys.readouterr().out
    new = sorted(p.name for p in files[0].parent.iterdir())
    listed = [f.name for f in read_manifest(files[0].parent / MANIFEST_NAME).files]
    assert new == sorted(listed + [MANIFEST_NAME])  # the old set is gone, not mixed in
    assert not {f.name for f in files} & set(new)  # another file count: other names
    assert main(["verify", out]) == 0


async def test_disk_panel_shows_each_drive_of_a_spread_set():
    from dataclasses import replace

    from textual.app import App

    from kimitui.engine.metrics import EngineMetrics, Sampler
    from kimitui.tui.widgets.panels import DiskPanel

    snap = Sampler(EngineMetrics()).sample()
    spread = replace(snap, disk_name="nvme0n1", disk_rates={"nvme0n1": 2.5e9, "sda": 3.1e8})

    class Host(App):
        def compose(self):
            yield DiskPanel()

    async with Host().run_test() as pilot:
        panel = pilot.app.query_one(DiskPanel)
        panel.render_snapshot(spread)
        lines = str(panel.body.content).splitlines()
    assert lines[-2:] == ["nvme0n1 2500.0 MB/s", "sda 310.0 MB/s"]
    assert max(len(line) for line in lines) <= 21  # fits a phone-wide panel


def test_custom_alignment_and_raw_metadata_survive(tmp_path):
    """Keys of every kind, strings that are not UTF-8, and a non-default alignment, which
    llama.cpp reads from each file of a set."""
    from gguf import GGUFWriter

    src = tmp_path / "odd.gguf"
    writer = GGUFWriter(str(src), "llama")
    writer.add_custom_alignment(64)
    writer.add_key_value("odd.bytes", b"\xff\xfe not utf-8", GGUFValueType.STRING)
    writer.add_array("odd.names", ["a", "bc", "déf"])
    writer.add_array("odd.floats", [0.5, -1.25, 3.0])
    writer.add_bool("odd.flag", True)
    writer.add_uint64("odd.big", 2**40 + 7)
    rng = np.random.default_rng(0)
    names = ["token_embd.weight", "blk.0.attn_q.weight", "blk.0.ffn_up.weight", "blk.1.attn_q.weight", "output.weight"]
    for name in names:
        writer.add_tensor(name, rng.standard_normal((300, 333)).astype(np.float32))  # 399,600 bytes: not a multiple of 64
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    result = shard_model(src, tmp_path / "out", file_size=1024**2)
    paths = [result.directory / f.name for f in result.files]
    assert len(paths) == 3  # non-layer tensors, then a layer per file: 800 KB + 400 KB would pass 1 MiB
    before, after = GGUFReader(str(src)), [GGUFReader(str(p)) for p in paths]
    raw = {k: [bytes(part) for part in f.parts] for k, f in before.fields.items() if k.startswith("odd.")}
    assert raw == {k: [bytes(part) for part in f.parts] for k, f in after[0].fields.items() if k.startswith("odd.")}
    got = {}
    for reader in after:
        assert reader.fields["general.alignment"].contents() == 64
        for t in reader.tensors:
            assert t.data_offset % 64 == 0
            got[t.name] = np.array(t.data)
    assert sorted(got) == sorted(names)
    for t in before.tensors:
        assert np.array_equal(got[t.name], t.data)



def test_a_directory_of_several_models_is_one_line(tmp_path, capsys):
    for name in ("a.gguf", "b-00001-of-00002.gguf", "b-00002-of-00002.gguf"):
        (tmp_path / name).write_bytes(b"")
    line = one_line_exit_2(["inspect", str(tmp_path)], capsys)
    assert "is a directory with 2 models (a.gguf, b-00001-of-00002.gguf)" in line


def test_a_manifest_that_lists_no_files_is_damaged(sharded, tmp_path, capsys):
    source = json.loads((sharded["dense"][0].parent / MANIFEST_NAME).read_text())
    (tmp_path / MANIFEST_NAME).write_text(json.dumps({**source, "files": []}))
    line = one_line_exit_2(["inspect", str(tmp_path)], capsys)
    assert "damaged manifest" in line and "it lists no files" in line
