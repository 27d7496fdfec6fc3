"""`kimitui shard MODEL OUTDIR`: rewrite a GGUF as a llama.cpp split set cut at layer boundaries.

Files of `name-0000N-of-0000M.gguf` with llama.cpp's split.* keys (split.no counts from 0;
split.count; split.tensors.count, which llama.cpp checks against the tensors it found), all
metadata in the first file, as `gguf-split` writes them: plain llama.cpp loads the set from
its first file. Unlike `gguf-split`, no file cuts a layer in two, so the unit a streaming
engine caches is a whole number of files; `--trunk-first` puts what every token needs
(embeddings, attention, norms, routers, shared experts, output) in the first files and the
routed experts after, so the trunk can live on fast internal storage.

Tensor bytes are copied with large reads a chunk ahead of the writes and checksummed on the
way (bounded memory); files are written under `OUTDIR/.kimitui-shard.partial/` and renamed
into place only when all are on disk, the first file and the manifest last.
"""

from __future__ import annotations

import argparse
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

from kimitui.errors import UserError
from kimitui.model.bulkio import CHUNK_BYTES, Progress, read_ahead
from kimitui.model.gguf_map import _SPLIT_RE, ROUTED_EXPERTS, ModelMap, TensorInfo, _open_reader, load_model_map, split_name
from kimitui.model.manifest import (
    CHECKSUMS,
    DEFAULT_CHECKSUM,
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    ends_digest,
    new_hash,
    write_manifest,
)
from kimitui.units import format_bytes, format_rate, size_option

DEFAULT_FILE_SIZE = "2GiB"
MIN_FILE_SIZE = 1024**2
MAX_FILES = 65535  # split.count is a uint16 in llama.cpp
PARTIAL_DIR = ".kimitui-shard.partial"


def _padded(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class OutFile:
    name: str
    tensors: tuple[TensorInfo, ...]

    @property
    def routed(self) -> bool:
        return any(t.role == ROUTED_EXPERTS for t in self.tensors)


def plan_files(m: ModelMap, file_size: int, trunk_first: bool) -> list[tuple[TensorInfo, ...]]:
    """Tensors per output file. The unit never cut is a layer (with `trunk_first`: a layer's
    trunk, and separately its routed experts; non-layer tensors form one unit); units fill a
    file in order up to `file_size` of data, and a unit bigger than that gets a file of its own."""
    units: dict[tuple[bool, int | None], list[TensorInfo]] = {}
    for t in sorted(m.tensors, key=lambda t: (t.file, t.offset)):
        routed = trunk_first and t.role == ROUTED_EXPERTS
        units.setdefault((routed, t.layer), []).append(t)
    # dicts keep first-seen order: the file's own order, all trunk before experts when asked
    ordered = sorted(units.items(), key=lambda kv: kv[0][0]) if trunk_first else list(units.items())
    files: list[tuple[TensorInfo, ...]] = []
    current: list[TensorInfo] = []
    size = 0
    last_kind = False
    for (routed, _), tensors in ordered:
        unit_bytes = sum(_padded(t.n_bytes, m.alignment) for t in tensors)
        if current and (size + unit_bytes > file_size or routed != last_kind):
            files.append(tuple(current))
            current, size = [], 0
        current += tensors
        size += unit_bytes
        last_kind = routed
    if current:
        files.append(tuple(current))
    if len(files) > MAX_FILES:
        raise UserError(f"{len(files)} files would exceed llama.cpp's limit of {MAX_FILES}; choose a larger --shard-size")
    return files


def set_prefix(source: Path) -> str:
    """`name` of `name-0000N-of-0000M.gguf` (any file of a split source) or of `name.gguf`."""
    match = _SPLIT_RE.match(source.name)
    if match:
        return match["prefix"]
    return source.name[: -len(".gguf")] if source.name.endswith(".gguf") else source.name


def existing_sets(directory: Path, prefix: str) -> list[Path]:
    """Files of any split set named `prefix` in `directory`, first files first."""
    found = []
    for p in directory.iterdir():
        match = _SPLIT_RE.match(p.name)
        if match and match["prefix"] == prefix:
            found.append(p)
    return sorted(found, key=lambda p: (int(_SPLIT_RE.match(p.name)["no"]) != 1, p.name))


# --- metadata -------------------------------------------------------------------------------


def _kv_items(first_file: Path) -> tuple[str, int, list[tuple[str, object, object, object]]]:
    """(architecture, alignment, every other key as (key, value, type, sub type)) of a GGUF,
    values raw where that matters: strings as bytes, so any byte sequence survives."""
    from gguf import GGUFValueType, Keys

    reader = _open_reader(first_file, arrays=True)
    regenerated = {
        Keys.General.ARCHITECTURE,  # GGUFWriter writes it itself
        Keys.General.ALIGNMENT,  # written per file where it is not the default
        Keys.Split.LLM_KV_SPLIT_NO,
        Keys.Split.LLM_KV_SPLIT_COUNT,
        Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT,
    }
    arch = ""
    items = []
    for key, f in reader.fields.items():
        if key.startswith("GGUF."):  # the reader's own fields: version and counts
            continue
        if key == Keys.General.ARCHITECTURE:
            arch = bytes(f.parts[-1]).decode("utf-8", errors="replace")
        if key in regenerated:
            continue
        main = f.types[0]
        if main == GGUFValueType.ARRAY:
            if len(f.types) != 2:
                raise UserError(f"{first_file}: key {key} is a nested array, which the gguf package cannot write")
            if not f.data:
                raise UserError(f"{first_file}: key {key} is an empty array, which the gguf package cannot write")
            sub = f.types[1]
            if sub == GGUFValueType.STRING:
                value: object = [bytes(f.parts[i]) for i in f.data]
            else:
                value = f.contents()
            items.append((key, value, main, sub))
        elif main == GGUFValueType.STRING:
            items.append((key, bytes(f.parts[-1]), main, None))
        else:
            items.append((key, f.contents(), main, None))
    return arch, int(reader.alignment), items


# --- writing --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardResult:
    directory: Path
    files: tuple[FileEntry, ...]
    seconds: float
    trunk_files: int  # with --trunk-first: how many files come before the routed experts

    @property
    def n_bytes(self) -> int:
        return sum(f.bytes for f in self.files)

    @property
    def rate(self) -> float:
        return self.n_bytes / max(self.seconds, 1e-9)


@dataclass(frozen=True)
class Zeros:
    """A run of zero bytes in a tensor's data, written as a hole (seeked over) and hashed."""

    n_bytes: int


_ZEROS = bytes(CHUNK_BYTES)


def write_gguf_file(
    path: Path,
    arch: str,
    alignment: int,
    kv: list,
    tensors: Sequence[tuple[str, tuple[int, ...], str, int]],
    number: int,
    count: int,
    n_tensors: int,
    chunks: Iterator[memoryview | Zeros],
    progress: Progress | None,
    algorithm: str,
    hasher: ThreadPoolExecutor,
    split: bool = True,
) -> FileEntry:
    """Write file `number` of a `count`-file set: the header (every key in `kv` in the first
    file only, the split keys where `split`), the infos of `tensors` ((name, ggml shape,
    ggml type name, bytes)) and their data, taken from `chunks` in order. Returns the file's
    manifest entry, its checksum computed on the way."""
    import numpy as np
    from gguf import GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFWriter, Keys

    writer = GGUFWriter(None, arch)
    try:
        if alignment != GGUF_DEFAULT_ALIGNMENT:
            writer.add_custom_alignment(alignment)  # llama.cpp reads it from each file
        if number == 0:
            for key, value, vtype, sub in kv:
                writer.add_key_value(key, value, vtype, sub_type=sub)
        if split:
            writer.add_uint16(Keys.Split.LLM_KV_SPLIT_NO, number)
            writer.add_uint16(Keys.Split.LLM_KV_SPLIT_COUNT, count)
            writer.add_int32(Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT, n_tensors)
        for name, shape, ggml_type, n_bytes in tensors:
            # GGUFWriter takes numpy (outermost-first) order and writes it reversed
            writer.add_tensor_info(
                name, tuple(reversed(shape)), np.dtype(np.float32), n_bytes, raw_dtype=GGMLQuantizationType[ggml_type]
            )
        writer.write_header_to_file(path)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        assert writer.fout is not None
        out = writer.fout[0]
        out.flush()
        digest = new_hash(algorithm)
        with path.open("rb") as fh:  # the header GGUFWriter just wrote, for the checksum
            digest.update(fh.read())

        def pad(n: int) -> None:
            zeros = bytes(_padded(n, alignment) - n)
            out.write(zeros)
            digest.update(zeros)

        pad(out.tell())
        for _name, _shape, _type, n_bytes in tensors:
            left = n_bytes
            while left > 0:
                view = next(chunks)
                if isinstance(view, Zeros):  # a hole in the source stays one: nothing to write
                    n = view.n_bytes
                    for at in range(0, n, len(_ZEROS)):
                        digest.update(memoryview(_ZEROS)[: min(len(_ZEROS), n - at)])
                    out.seek(n, os.SEEK_CUR)
                else:
                    n = len(view)
                    # hash on another core while this one writes (both release the GIL); done
                    # before the next chunk, as the buffer is then reused and the order kept
                    hashed = hasher.submit(digest.update, view)
                    out.write(view)
                    hashed.result()
                left -= n
                if progress is not None:
                    progress.add(n)
            if left:  # a chunk ran past its tensor: what follows would be misplaced
                raise ValueError(f"tensor {_name}: its chunks were {-left} bytes longer than its {n_bytes}")
            pad(n_bytes)
        out.truncate(out.tell())  # a file that ends in a hole still has its full size
    finally:
        writer.close()
    size = path.stat().st_size
    return FileEntry(path.name, size, digest.hexdigest(), ends_digest(path, size, algorithm))


def tensor_entries(tensors: Sequence[TensorInfo]) -> list[tuple[str, tuple[int, ...], str, int]]:
    return [(t.name, t.shape, t.ggml_type, t.n_bytes) for t in tensors]


def shard_model(
    source: Path,
    outdir: Path,
    *,
    file_size: int,
    trunk_first: bool = False,
    force: bool = False,
    algorithm: str = DEFAULT_CHECKSUM,
    progress_stream=None,
) -> ShardResult:
    """Write `source` (a GGUF or any file of a split set) as a layer-aligned split set in
    `outdir`, with its manifest. Raises UserError for anything the user can fix."""
    prefix = set_prefix(source)
    old = _replaced_files(outdir, prefix, file_size, force)
    m = load_model_map(source)
    plan = plan_files(m, file_size, trunk_first)
    count = len(plan)
    out_files = [OutFile(split_name(prefix, i + 1, count), tensors) for i, tensors in enumerate(plan)]
    outdir.mkdir(parents=True, exist_ok=True)
    data_bytes = sum(t.n_bytes for t in m.tensors)
    free = shutil.disk_usage(outdir).free
    if free < data_bytes:
        raise UserError(f"{outdir}: {format_bytes(free)} free, the shards need {format_bytes(data_bytes)}")
    arch, alignment, kv = _kv_items(m.files[0])

    partial = outdir / PARTIAL_DIR
    if partial.exists():
        shutil.rmtree(partial)  # left by an interrupted run: ours by name
    partial.mkdir()
    fds = [os.open(f, os.O_RDONLY) for f in m.files]
    progress = Progress("shard", data_bytes, progress_stream)
    chunks = read_ahead((fds[t.file], t.offset, t.n_bytes) for f in out_files for t in f.tensors)
    hasher = ThreadPoolExecutor(1, thread_name_prefix="kimitui-hash")
    try:
        entries = [
            write_gguf_file(
                partial / f.name, arch, alignment, kv, tensor_entries(f.tensors), i, count, len(m.tensors), chunks,
                progress, algorithm, hasher,
            )
            for i, f in enumerate(out_files)
        ]
        chunks.close()
        # fsync once all are written: the kernel writes back while later files are copied,
        # where a sync per file would stall the copy for each file's writeback
        for f in out_files:
            _fsync(partial / f.name)
        progress.close()
        manifest = Manifest(model=m.name, checksum=algorithm, files=tuple(entries), shard_size=file_size, trunk_first=trunk_first)
        _move_into_place(partial, outdir, [f.name for f in out_files], old, manifest)
    except BaseException as exc:
        chunks.close()
        progress.close()
        shutil.rmtree(partial, ignore_errors=True)
        if isinstance(exc, OSError):  # a full disk, a drive gone: the user's to fix, in one line
            where = f" ({exc.filename})" if exc.filename else ""
            raise UserError(f"shard into {outdir} failed: {exc.strerror or exc}{where}; partial files removed") from None
        raise
    finally:
        hasher.shutdown()
        for fd in fds:
            os.close(fd)
    trunk_files = sum(1 for f in out_files if not f.routed) if trunk_first else 0
    return ShardResult(outdir, tuple(entries), progress.seconds, trunk_files)


def _replaced_files(outdir: Path, prefix: str, file_size: int, force: bool) -> list[Path]:
    """The files of an earlier set named `prefix` in `outdir`, which the new one replaces;
    UserError for a file size below the minimum, an `outdir` that is a file, or an earlier set
    (or manifest) there without `force`."""
    if file_size < MIN_FILE_SIZE:
        raise UserError(f"--shard-size {format_bytes(file_size)} is below the minimum {format_bytes(MIN_FILE_SIZE)}")
    if outdir.exists() and not outdir.is_dir():
        raise UserError(f"{outdir} is not a directory")
    manifest_path = outdir / MANIFEST_NAME
    old = existing_sets(outdir, prefix) if outdir.is_dir() else []
    clash = ([manifest_path] if manifest_path.exists() else []) + old
    if clash and not force:
        more = f" and {len(clash) - 1} more" if len(clash) > 1 else ""
        raise UserError(f"{clash[0]}{more} already in {outdir} (use --force to replace them)")
    return old


def _move_into_place(partial: Path, outdir: Path, names: list[str], old: list[Path], manifest: Manifest) -> None:
    """Replace the old set (`old`, first files first) and manifest with the files written
    under `partial`. Old files go first, the old first file before any other (without it
    llama.cpp cannot open the old set, so a half-replaced set is never loadable); the new
    first file and the manifest come last, so their presence means "complete"."""
    manifest_path = outdir / MANIFEST_NAME
    if manifest_path.exists():
        manifest_path.unlink()
    for p in old:
        p.unlink()
    for name in names[1:] + names[:1]:
        os.replace(partial / name, outdir / name)
    write_manifest(outdir, manifest)
    _fsync(outdir)
    partial.rmdir()


def _fsync(path: Path) -> None:
    """Flush a file to storage; on a directory, make the renames in it durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- command line ---------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", type=Path, help="GGUF file, or any file of a split set")
    parser.add_argument("outdir", type=Path, help="directory for the split files and kimitui-manifest.json")
    parser.add_argument(
        "--shard-size",
        default=DEFAULT_FILE_SIZE,
        help=f"target file size, e.g. 512MiB (default {DEFAULT_FILE_SIZE}); a layer bigger than this gets a file of its own",
    )
    parser.add_argument(
        "--trunk-first", action="store_true", help="embeddings, attention, norms, routers, shared experts and output first, in files of their own"
    )
    parser.add_argument("--checksum", choices=CHECKSUMS, default=DEFAULT_CHECKSUM, help=f"manifest checksum (default {DEFAULT_CHECKSUM})")
    parser.add_argument("--force", action="store_true", help="replace a split set of the same name and its manifest in OUTDIR")


def run(args: argparse.Namespace) -> int:
    file_size = size_option(args.shard_size, "--shard-size")
    if not args.model.exists():
        raise UserError(f"model file not found: {args.model}")
    result = shard_model(
        args.model, args.outdir, file_size=file_size, trunk_first=args.trunk_first, force=args.force, algorithm=args.checksum
    )
    n = len(result.files)
    where = ""
    if args.trunk_first:
        t = result.trunk_files
        where = f"; trunk in files 1-{t}, routed experts in {t + 1}-{n}" if t < n else "; no routed experts: all trunk"
    print(
        f"wrote {n} file{'s' if n > 1 else ''}, {format_bytes(result.n_bytes)}, to {result.directory} in "
        f"{result.seconds:.1f} s ({format_rate(result.rate)}){where}; manifest {MANIFEST_NAME}"
    )
    return 0
