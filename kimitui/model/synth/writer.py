"""Writing a synthetic model: one GGUF or a llama.cpp split set, streamed through a
`.partial` directory and renamed into place only once every byte is on disk."""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
from gguf import GGUFWriter

from kimitui.errors import UserError
from kimitui.model.bulkio import Progress
from kimitui.model.gguf_map import split_name
from kimitui.model.synth.blocks import Filler
from kimitui.model.synth.spec import Fill, ModelSpec, TensorSpec, pad
from kimitui.units import format_bytes


@dataclass(frozen=True)
class WriteResult:
    paths: tuple[Path, ...]
    n_bytes: int  # all files together
    seconds: float  # writing and fsync, header included

    @property
    def rate(self) -> float:
        return self.n_bytes / max(self.seconds, 1e-9)


def split_names(out: Path, n_files: int) -> list[Path]:
    """The files of a set of `n_files` named after `out`: `out` itself, or OUT-0000N-of-0000M.gguf."""
    if n_files == 1:
        return [out]
    stem = out.name[: -len(".gguf")] if out.name.endswith(".gguf") else out.name
    return [out.with_name(split_name(stem, i, n_files)) for i in range(1, n_files + 1)]


def write_model(
    spec: ModelSpec,
    out: Path,
    *,
    seed: int = 0,
    split_size: int | None = None,
    force: bool = False,
    progress: bool = True,
    sparse: bool = False,
    whole_layers: bool = True,
) -> WriteResult:
    """Write `spec` to `out` (or a split set next to it) through a `.partial` directory,
    renamed into place only once every byte is on disk. `sparse`: the weight matrices are file
    holes (they read back as zeros and take no disk); headers, norms, routers and their biases
    hold data, so the file has the real model's shape and size at the cost of its small tensors.
    A split set keeps each layer in one file unless ``whole_layers`` is False (cut between any
    two tensors, as sets made with llama.cpp's gguf-split are)."""
    total = sum(t.n_bytes for t in spec.tensors if not _hole(t, sparse))  # bytes written
    writer = _header_writer(spec, split_size, whole_layers)
    finals = split_names(out, len(writer.tensors))
    _check_room(out, finals, force, total + spec.file_bytes() - sum(t.n_bytes for t in spec.tensors))

    tmp_dir = out.with_name(out.name + ".partial")
    if tmp_dir.exists():
        shutil.rmtree(tmp_dir)  # left by an interrupted run: ours by name
    tmp_dir.mkdir()
    start = time.monotonic()
    bar = Progress("synth", total) if progress else None
    filler = Filler(np.random.default_rng(seed))
    by_name = {t.name: t for t in spec.tensors}
    try:
        writer.write_header_to_file(tmp_dir / out.name)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        assert writer.fout is not None
        temps = [Path(f.name) for f in writer.fout]
        for fout, tensors in zip(writer.fout, writer.tensors):
            _write_data(fout, [by_name[name] for name in tensors], filler, bar, sparse)
            fout.flush()
            os.fsync(fout.fileno())
        writer.close()
        if bar:
            bar.close()
        # the first file last: llama.cpp opens a set through it, so its presence means done
        for tmp, final in list(zip(temps, finals))[1:] + [(temps[0], finals[0])]:
            os.replace(tmp, final)
        tmp_dir.rmdir()
    except BaseException:
        writer.close()
        if bar:
            bar.close()
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    seconds = time.monotonic() - start
    return WriteResult(tuple(finals), sum(p.stat().st_size for p in finals), seconds)


def _header_writer(spec: ModelSpec, split_size: int | None, whole_layers: bool) -> GGUFWriter:
    """A GGUFWriter holding the spec's keys and tensor infos, one file per entry of its
    `tensors` (a set when the model is larger than `split_size`)."""
    splitting = split_size is not None and sum(t.n_bytes for t in spec.tensors) > split_size
    writer = GGUFWriter(None, spec.arch)
    for key, value, vtype in spec.kv:
        if key != "general.architecture":  # GGUFWriter writes that one itself
            writer.add_key_value(key, value, vtype)
    for key, value, vtype, sub in spec.tokenizer.fields:
        writer.add_key_value(key, value, vtype, sub_type=sub)
    starts = _file_starts(spec.tensors, split_size, whole_layers) if splitting else set()
    for t in spec.tensors:
        if t.name in starts:
            writer.tensors.append({})  # the next file of the set: GGUFWriter writes one per dict
        # GGUFWriter takes numpy (outermost-first) order and writes it reversed
        writer.add_tensor_info(t.name, tuple(reversed(t.shape)), np.dtype(np.float32), t.n_bytes, raw_dtype=t.qtype)
    return writer


def _check_room(out: Path, finals: list[Path], force: bool, needs: int) -> None:
    """UserError unless the files may be (re)placed and their drive has `needs` bytes free."""
    existing = [p for p in finals if p.exists()]
    for p in existing:
        if p.is_dir():
            raise UserError(f"{p} is a directory; name a file")
    if existing and not force:
        raise UserError(f"{existing[0]} exists (use --force to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out.parent).free
    if free < needs:
        raise UserError(f"{out.parent}: {format_bytes(free)} free, the model needs {format_bytes(needs)}")


def _layer_of(name: str) -> int | None:
    return int(name.split(".")[1]) if name.startswith("blk.") else None


def _file_starts(tensors: tuple[TensorSpec, ...], split_size: int, whole_layers: bool) -> set[str]:
    """The tensors that begin a new file of a split set, as many units per file as fit in
    ``split_size`` (a unit larger than that gets a file of its own). With ``whole_layers`` a unit
    is a layer, or the run of non-layer tensors before the first layer (embeddings) or after the
    last (output norm and head), so no layer straddles two files; else each tensor is one, as
    llama.cpp's gguf-split cuts."""
    units: list[tuple[str, int]] = []  # (first tensor, bytes)
    key = object()
    for t in tensors:
        unit = (_layer_of(t.name), t.name) if not whole_layers else (_layer_of(t.name), None)
        if unit != key:
            units.append((t.name, 0))
            key = unit
        units[-1] = (units[-1][0], units[-1][1] + t.n_bytes)
    starts, in_file = set(), 0
    for first, n_bytes in units:
        if in_file and in_file + n_bytes > split_size:
            starts.add(first)
            in_file = 0
        in_file += n_bytes
    return starts


def _hole(t: TensorSpec, sparse: bool) -> bool:
    """Whether ``--sparse`` leaves this tensor as a file hole: the weight matrices, but not the
    embeddings and the output head, which make each token's hidden state (and so its routing,
    in every layer) and the next greedy token differ; with them zero every token would route
    alike and the caches would hit as no real model lets them."""
    return sparse and t.fill == Fill.WEIGHT and t.name != "output.weight"


def _write_data(fout: BinaryIO, tensors: list[TensorSpec], filler: Filler, bar: Progress | None, sparse: bool) -> None:
    fout.write(bytes(pad(fout.tell()) - fout.tell()))
    for t in tensors:
        if _hole(t, sparse):
            fout.seek(pad(t.n_bytes), os.SEEK_CUR)
            continue
        for piece in filler.pieces(t):
            fout.write(piece)
            if bar:
                bar.add(len(piece))
        fout.write(bytes(pad(t.n_bytes) - t.n_bytes))
    fout.truncate(fout.tell())  # a hole at the end still makes the file its full size
