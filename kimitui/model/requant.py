"""`kimitui requant MODEL OUTDIR`: the same model with a leaner trunk, its routed experts untouched.

Every token of a streamed MoE reads the trunk (attention, shared experts, the latent
projections, dense FFNs, the head) again; Kimi K3 ships it as BF16. This rewrites those matrices
as Q8_0 (or Q4_0, the 4-bit type llama.cpp has fast ARM kernels for) and copies every routed
expert tensor byte for byte (K3's are quantization-aware MXFP4: a re-encode could only add
error), along with what llama.cpp keeps in full precision: norms, routers and their biases,
KDA's convolutions and beta, the residual-attention scores. `kimitui verify OUTDIR
--same-experts-as MODEL` proves the experts identical.

The output keeps the source's files (a split set stays split the same way, each file holding the
same tensors) and gets a kimitui manifest, so `verify` and the load-time check work on it. Files
are written under `OUTDIR/.kimitui-requant.partial/` one at a time; each finished file is
recorded there with its checksum, so an interrupted run resumes at the first file not finished
(a finished file whose size or ends no longer match its record is written again). Holes in a
sparse source stay holes. The matrices are quantized by ggml on every core while the next chunks
are read: BF16, F16 and F32 by ggml-cpu's SIMD row quantizers, already quantized ones by ggml's
reference, byte for byte what llama-quantize writes (see _quantizer).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterator, Sequence

from kimitui.errors import UserError
from kimitui.model.bulkio import CHUNK_BYTES, Progress, is_hole, read_ahead
from kimitui.model.gguf_map import EMBEDDING, NORM, OUTPUT, ROUTED_EXPERTS, ROUTER, ModelMap, TensorInfo, load_model_map, split_names
from kimitui.model.manifest import CHECKSUMS, DEFAULT_CHECKSUM, MANIFEST_NAME, FileEntry, Manifest, ends_digest
from kimitui.model.shard import Zeros, _fsync, _kv_items, _move_into_place, write_gguf_file
from kimitui.units import format_bytes, format_rate

@dataclass(frozen=True)
class TrunkType:
    matrices: str  # the ggml type of the trunk's matrices
    head: str  # of the embeddings and the output head: as llama-quantize does, a 4-bit trunk keeps them at 8
    file_type: str  # the file type llama.cpp reports


# --trunk's choices.
TRUNK_TYPES = {"q8_0": TrunkType("Q8_0", "Q8_0", "MOSTLY_Q8_0"), "q4_0": TrunkType("Q4_0", "Q8_0", "MOSTLY_Q4_0")}
DEFAULT_TRUNK = "q8_0"
PARTIAL_DIR = ".kimitui-requant.partial"
STATE_NAME = "requant-state.json"
# Small tensors llama.cpp's kernels want in full precision (KDA's short convolutions and beta,
# the residual-attention scores), besides norms, routers and biases, which the roles name.
KEPT_IN_FULL = ("ssm_conv1d", "ssm_beta", "res_score")
FLOAT_TYPES = ("F32", "F16", "BF16")


def requantizes(t: TensorInfo) -> bool:
    """Whether `t` is a trunk matrix that requant rewrites (before types and widths are weighed)."""
    return (
        t.name.endswith(".weight")
        and len(t.shape) >= 2
        and t.role not in (ROUTED_EXPERTS, ROUTER, NORM)
        and not any(part in t.name for part in KEPT_IN_FULL)
    )


def _block(type_name: str) -> tuple[int, int]:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]


def _readable(type_name: str) -> bool:
    """Whether the source's values can be had as floats: plain floats, or a type the gguf
    package dequantizes."""
    if type_name in FLOAT_TYPES:
        return True
    from gguf import GGMLQuantizationType
    from gguf.quants import _type_traits

    return GGMLQuantizationType[type_name] in _type_traits


def output_type(t: TensorInfo, trunk: str) -> str:
    """The ggml type `t` gets with `--trunk trunk`: the trunk type's for a trunk matrix whose rows
    divide into its blocks, else its own (copied as it is)."""
    spec = TRUNK_TYPES[trunk]
    target = spec.head if t.role in (OUTPUT, EMBEDDING) else spec.matrices
    if not requantizes(t) or t.ggml_type == target:
        return t.ggml_type
    if t.shape[0] % _block(target)[0] or not _readable(t.ggml_type):
        return t.ggml_type
    return target


def output_bytes(t: TensorInfo, type_name: str) -> int:
    if type_name == t.ggml_type:
        return t.n_bytes
    block, size = _block(type_name)
    rows = t.n_bytes // _row_bytes(t)
    return rows * t.shape[0] // block * size


def requantized_map(m: ModelMap, trunk: str) -> ModelMap:
    """The map `kimitui requant --trunk TRUNK` would write (a TRUNK_TYPES key)."""
    types = {t.index: (output_type(t, trunk), output_bytes(t, output_type(t, trunk))) for t in m.tensors}
    return m.retyped(types)


def _row_bytes(t: TensorInfo) -> int:
    block, size = _block(t.ggml_type)
    return t.shape[0] // block * size


# --- converting ---------------------------------------------------------------------------


class _TypeTraitsCpu(ctypes.Structure):
    # ggml-cpu.h's struct ggml_type_traits_cpu
    _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p), ("vec_dot_type", ctypes.c_int), ("nrows", ctypes.c_int64)]


_FROM_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


@lru_cache(maxsize=None)
def _quantizer(type_name: str, exact: bool):
    """A row quantizer for `type_name`, called as (src, dst, n_rows, n_per_row).

    Exact: ggml's reference (`ggml_quantize_chunk`, what llama-quantize writes), byte for byte.
    Else ggml-cpu's `from_float`, the SIMD routine llama.cpp quantizes activations with (Q8_0:
    about 25x the reference's scalar loop a core here). It takes 127/max where the reference
    takes 1/(max/127) and rounds ties to even, not away from zero, so a value at or next to a
    tie may land one step over: 0.07% of the values of BF16 weights, each as near the one as the
    other. Values dequantized from another grid sit on ties often (the embedded Q4_1 model's
    perplexity rose 1.42% this way against llama-quantize's 0.87%), so those take the exact one."""
    from gguf import GGMLQuantizationType

    kind = int(GGMLQuantizationType[type_name])
    try:
        from llama_cpp._ggml import libggml, libggml_base_path

        if exact:
            chunk = libggml.ggml_quantize_chunk
            chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
            chunk.restype = ctypes.c_size_t
            return lambda src, dst, n_rows, n_per_row: chunk(kind, src, dst, 0, n_rows, n_per_row, None)
        found = next(iter(sorted(libggml_base_path.glob("libggml-cpu*"))), None)
        if found is None:
            raise OSError(f"no libggml-cpu in {libggml_base_path}")
        cpu = ctypes.CDLL(str(found))
        cpu.ggml_get_type_traits_cpu  # noqa: B018 - an AttributeError here, not at the first call
    except (ImportError, OSError, AttributeError) as exc:
        raise UserError(f"requant needs ggml's quantizers from llama-cpp-python, which this install lacks ({exc})") from None
    cpu.ggml_cpu_init.restype = None
    cpu.ggml_cpu_init()
    cpu.ggml_get_type_traits_cpu.restype = ctypes.POINTER(_TypeTraitsCpu)
    cpu.ggml_get_type_traits_cpu.argtypes = [ctypes.c_int]
    traits = cpu.ggml_get_type_traits_cpu(kind).contents
    if not traits.from_float:
        raise UserError(f"this llama.cpp cannot quantize to {type_name}")
    from_float = _FROM_FLOAT(traits.from_float)
    return lambda src, dst, n_rows, n_per_row: from_float(src, dst, n_rows * n_per_row)


def to_float32(raw, type_name: str, n_per_row: int):
    """The values of whole rows of `type_name` as a C-contiguous float32 array of rows."""
    import numpy as np

    if type_name == "F32":
        values = np.frombuffer(raw, np.float32)
    elif type_name == "F16":
        values = np.frombuffer(raw, np.float16).astype(np.float32)
    elif type_name == "BF16":
        values = (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
    else:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        packed = np.frombuffer(raw, np.uint8).reshape(-1, _row_bytes_of(type_name, n_per_row))
        values = dequantize(packed, GGMLQuantizationType[type_name])
    return np.ascontiguousarray(values, np.float32).reshape(-1, n_per_row)


def _row_bytes_of(type_name: str, n_per_row: int) -> int:
    block, size = _block(type_name)
    return n_per_row // block * size


def quantize_rows(rows, type_name: str, pool: ThreadPoolExecutor, parts: int, exact: bool = False) -> bytearray:
    """`rows` (float32, rows x n_per_row) as `type_name`, by ggml (`exact`: its reference, see
    _quantizer), split over `parts` threads (ctypes lets go of the GIL during each call)."""
    n_rows, n_per_row = rows.shape
    row_out = _row_bytes_of(type_name, n_per_row)
    out = bytearray(n_rows * row_out)
    dst = (ctypes.c_char * len(out)).from_buffer(out)
    src, at = rows.ctypes.data, ctypes.addressof(dst)
    fn = _quantizer(type_name, exact)
    step = -(-n_rows // max(1, parts))
    jobs = [
        pool.submit(fn, src + first * n_per_row * 4, at + first * row_out, min(step, n_rows - first), n_per_row)
        for first in range(0, n_rows, step)
    ]
    try:
        for job in jobs:
            job.result()
    finally:
        wait(jobs)  # an interrupt must not free `rows` or `out` while a thread still writes through them
    del dst  # the buffer export ends before the bytes are handed on
    return out


@dataclass(frozen=True)
class _Piece:
    tensor: TensorInfo
    out_type: str
    offset: int
    length: int
    hole: bool


def _pieces(fd: int, tensors: Sequence[tuple[TensorInfo, str]]) -> list[_Piece]:
    """Each tensor in reads of at most CHUNK_BYTES (whole rows where it is converted), with
    whether each is a hole."""
    pieces = []
    for t, out_type in tensors:
        step = CHUNK_BYTES if out_type == t.ggml_type else max(1, CHUNK_BYTES // _row_bytes(t)) * _row_bytes(t)
        for at in range(0, t.n_bytes, step):
            length = min(step, t.n_bytes - at)
            pieces.append(_Piece(t, out_type, t.offset + at, length, is_hole(fd, t.offset + at, length)))
    return pieces


def converted_chunks(
    fd: int, tensors: Sequence[tuple[TensorInfo, str]], pool: ThreadPoolExecutor, parts: int, progress: Progress
) -> Iterator[memoryview | Zeros]:
    """The output data of `tensors` ((tensor, its output type), in file order): copied or
    quantized on `parts` threads of `pool`, a source hole as Zeros where its output is zeros too."""
    import numpy as np

    pieces = _pieces(fd, tensors)
    largest = max((p.length for p in pieces), default=CHUNK_BYTES)
    data = read_ahead(((fd, p.offset, p.length) for p in pieces if not p.hole), chunk=max(CHUNK_BYTES, largest))
    zero_rows: dict[tuple[str, int, int], bytes | None] = {}
    try:
        for p in pieces:
            copy = p.out_type == p.tensor.ggml_type
            n_per_row = p.tensor.shape[0]
            if p.hole:
                if copy:
                    yield Zeros(p.length)
                else:  # zeros quantize to zero bytes in Q8_0 (kept a hole), not in Q4_0
                    key = (p.out_type, n_per_row, p.length)
                    if key not in zero_rows:
                        rows = np.zeros((p.length // _row_bytes(p.tensor), n_per_row), np.float32)
                        out = bytes(quantize_rows(rows, p.out_type, pool, parts))
                        zero_rows[key] = None if not any(out) else out
                    out = zero_rows[key]
                    rows_out = p.length // _row_bytes(p.tensor) * _row_bytes_of(p.out_type, n_per_row)
                    yield Zeros(rows_out) if out is None else memoryview(out)
            else:
                view = next(data)
                if copy:
                    yield view
                else:
                    rows = to_float32(view, p.tensor.ggml_type, n_per_row)
                    exact = p.tensor.ggml_type not in FLOAT_TYPES  # a dequantized grid: ties are common
                    yield memoryview(quantize_rows(rows, p.out_type, pool, parts, exact))
            progress.add(p.length)
    finally:
        data.close()


# --- the run --------------------------------------------------------------------------------


@dataclass(frozen=True)
class RequantResult:
    directory: Path
    files: tuple[FileEntry, ...]
    seconds: float
    source_bytes: int  # tensor bytes read (holes included)
    trunk_before: int  # the requantized matrices' bytes, before and after
    trunk_after: int
    requantized: int  # tensors rewritten
    copied_experts: int  # routed expert bytes copied byte for byte
    resumed: int  # files kept from an interrupted run

    @property
    def rate(self) -> float:
        return self.source_bytes / max(self.seconds, 1e-9)


def _source_identity(m: ModelMap, trunk: str, algorithm: str) -> dict:
    files = [[f.name, os.stat(f).st_size, os.stat(f).st_mtime_ns] for f in m.files]
    return {"source": files, "trunk": trunk, "checksum": algorithm}


def _finished_files(partial: Path, identity: dict, names: list[str], say) -> dict[str, FileEntry]:
    """The files an interrupted run of the same job finished, still whole; the rest of
    `partial` is cleared."""
    state_path = partial / STATE_NAME
    kept: dict[str, FileEntry] = {}
    try:
        state = json.loads(state_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        state = None
    if isinstance(state, dict) and all(state.get(k) == v for k, v in identity.items()):
        for raw in state.get("done", []):
            try:
                entry = FileEntry(**raw)
            except TypeError:
                continue  # a damaged record: that file is written again
            path = partial / entry.name
            if entry.name not in names or not path.is_file():
                continue
            size = path.stat().st_size
            if size == entry.bytes and ends_digest(path, size, identity["checksum"]) == entry.ends:
                kept[entry.name] = entry
            else:
                say(f"requant: {entry.name} was finished but changed since ({size} bytes); writing it again")
    elif state is not None:
        say(f"requant: {partial} holds another run's files (another source, trunk type or checksum); starting over")
    for p in partial.iterdir():
        if p.name not in kept and p.name != STATE_NAME:
            p.unlink()
    return kept


def _save_state(partial: Path, identity: dict, done: dict[str, FileEntry]) -> None:
    tmp = partial / f".{STATE_NAME}.tmp"
    tmp.write_text(json.dumps({**identity, "done": [vars(e) for e in done.values()]}), encoding="utf-8")
    os.replace(tmp, partial / STATE_NAME)


def _clashes(outdir: Path, names: list[str], force: bool) -> list[Path]:
    if outdir.exists() and not outdir.is_dir():
        raise UserError(f"{outdir} is not a directory")
    existing = [outdir / n for n in names if (outdir / n).exists()]
    clash = ([outdir / MANIFEST_NAME] if (outdir / MANIFEST_NAME).exists() else []) + existing
    if clash and not force:
        more = f" and {len(clash) - 1} more" if len(clash) > 1 else ""
        raise UserError(f"{clash[0]}{more} already in {outdir} (use --force to replace them)")
    return existing


def _needed_bytes(m: ModelMap, out_types: dict[int, str], skip: set[str]) -> int:
    """The bytes on disk the files not yet written (not in `skip`) will take: their tensors'
    bytes, scaled by how much of the source is allocated (a sparse source gives a sparse copy)."""
    total = 0
    for i, f in enumerate(m.files):
        if f.name in skip:
            continue
        st = os.stat(f)
        allocated = min(1.0, st.st_blocks * 512 / max(st.st_size, 1))
        total += int(allocated * sum(output_bytes(t, out_types[t.index]) for t in m.tensors if t.file == i))
    return total


def requant_model(
    source: Path,
    outdir: Path,
    *,
    trunk: str = DEFAULT_TRUNK,
    force: bool = False,
    algorithm: str = DEFAULT_CHECKSUM,
    threads: int | None = None,
    progress_stream=None,
    say=print,
) -> RequantResult:
    """Write `source` (a GGUF or any file of a split set) to `outdir` with its trunk as
    `trunk` (a TRUNK_TYPES key), resuming an interrupted run. UserError for what the user can fix."""
    from gguf import GGUFValueType, LlamaFileType

    if trunk not in TRUNK_TYPES:
        raise UserError(f"--trunk {trunk}: choose one of {', '.join(TRUNK_TYPES)}")
    spec = TRUNK_TYPES[trunk]
    m = load_model_map(source)
    names = [f.name for f in m.files]
    if outdir.exists() and any(os.path.samefile(outdir, f.parent) for f in m.files):
        raise UserError(f"{outdir} holds the source itself; write the requantized copy to another directory")
    old = _clashes(outdir, names, force)
    out_types = {t.index: output_type(t, trunk) for t in m.tensors}
    changed = [t for t in m.tensors if out_types[t.index] != t.ggml_type]
    if not changed:
        raise UserError(
            f"{source}: no trunk matrix to rewrite as {spec.matrices} (already {spec.matrices}, or no rows that divide into its blocks)"
        )
    outdir.mkdir(parents=True, exist_ok=True)
    partial = outdir / PARTIAL_DIR
    partial.mkdir(exist_ok=True)
    identity = _source_identity(m, trunk, algorithm)
    done = _finished_files(partial, identity, names, say)
    resumed = len(done)
    if done:
        say(f"requant: resuming; {len(done)} of {len(names)} files were finished by an earlier run")
    needed = _needed_bytes(m, out_types, skip=set(done))
    free = shutil.disk_usage(outdir).free
    if free < needed:
        raise UserError(f"{outdir}: {format_bytes(free)} free, the requantized copy needs about {format_bytes(needed)} more")
    arch, alignment, kv = _kv_items(m.files[0])
    file_type_kv = ("general.file_type", int(LlamaFileType[spec.file_type]), GGUFValueType.UINT32, None)
    kv = [item for item in kv if item[0] != "general.file_type"] + [file_type_kv]
    split = split_names(m.files[0]) is not None
    todo_bytes = sum(t.n_bytes for t in m.tensors if m.files[t.file].name not in done)
    progress = Progress("requant", todo_bytes, progress_stream)
    workers = threads or os.cpu_count() or 1
    hasher = ThreadPoolExecutor(1, thread_name_prefix="kimitui-hash")
    pool = ThreadPoolExecutor(workers, thread_name_prefix="kimitui-quantize")
    moving = False
    try:
        for i, path in enumerate(m.files):
            if path.name in done:
                continue
            in_file = [t for t in m.tensors if t.file == i]
            infos = [(t.name, t.shape, out_types[t.index], output_bytes(t, out_types[t.index])) for t in in_file]
            fd = os.open(path, os.O_RDONLY)
            tmp = partial / f".{path.name}.tmp"
            try:
                chunks = converted_chunks(fd, [(t, out_types[t.index]) for t in in_file], pool, workers, progress)
                try:
                    entry = write_gguf_file(
                        tmp, arch, alignment, kv, infos, i, len(m.files), len(m.tensors), chunks, None, algorithm, hasher, split
                    )
                finally:
                    chunks.close()
                _fsync(tmp)
            except BaseException:
                tmp.unlink(missing_ok=True)  # a half-written file only holds space the user may need
                raise
            finally:
                os.close(fd)
            os.replace(tmp, partial / path.name)
            done[path.name] = FileEntry(path.name, entry.bytes, entry.checksum, entry.ends)
            _save_state(partial, identity, done)
        progress.close()
        manifest = Manifest(
            model=m.name, checksum=algorithm, files=tuple(done[n] for n in names),
            shard_size=max(e.bytes for e in done.values()), trunk_first=False,
        )
        moving = True
        (partial / STATE_NAME).unlink()
        _move_into_place(partial, outdir, names, old, manifest)
    except OSError as exc:  # a full disk, a drive gone: the user's to fix, in one line
        progress.close()
        where = f" ({exc.filename})" if exc.filename else ""
        left = (
            f"the files were being moved into {outdir}: run the same command with --force to write them again"
            if moving else f"{len(done)} finished files kept in {partial}, run the same command again to resume"
        )
        raise UserError(f"requant into {outdir} failed: {exc.strerror or exc}{where}; {left}") from None
    finally:
        progress.close()
        pool.shutdown()
        hasher.shutdown()
    return RequantResult(
        outdir,
        tuple(done[n] for n in names),
        progress.seconds,
        todo_bytes,
        trunk_before=sum(t.n_bytes for t in changed),
        trunk_after=sum(output_bytes(t, out_types[t.index]) for t in changed),
        requantized=len(changed),
        copied_experts=sum(t.n_bytes for t in m.tensors if t.role == ROUTED_EXPERTS),
        resumed=resumed,
    )


# --- command line ---------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", type=Path, help="GGUF file, or any file of a split set")
    parser.add_argument("outdir", type=Path, help="directory for the requantized file(s) and kimitui-manifest.json")
    parser.add_argument(
        "--trunk", choices=tuple(TRUNK_TYPES), default=DEFAULT_TRUNK,
        help=f"the trunk's new type (default {DEFAULT_TRUNK}; q4_0 has llama.cpp's fast ARM kernels)",
    )
    parser.add_argument("--threads", type=int, help="quantizing threads (default: one per core)")
    parser.add_argument("--checksum", choices=CHECKSUMS, default=DEFAULT_CHECKSUM, help=f"manifest checksum (default {DEFAULT_CHECKSUM})")
    parser.add_argument("--force", action="store_true", help="replace files of the same names and a manifest in OUTDIR")


def run(args: argparse.Namespace) -> int:
    if not args.model.exists():
        raise UserError(f"model file not found: {args.model}")
    if args.threads is not None and args.threads < 1:
        raise UserError(f"--threads {args.threads}: give 1 or more")
    result = requant_model(args.model, args.outdir, trunk=args.trunk, force=args.force, algorithm=args.checksum, threads=args.threads)
    n = len(result.files)
    spec = TRUNK_TYPES[args.trunk]
    target = spec.matrices if spec.head == spec.matrices else f"{spec.matrices} (embeddings and head {spec.head})"
    print(
        f"wrote {n} file{'s' if n > 1 else ''} to {result.directory}: {result.requantized} trunk matrices "
        f"{format_bytes(result.trunk_before)} -> {format_bytes(result.trunk_after)} as {target}, "
        f"{format_bytes(result.copied_experts)} of routed experts copied byte for byte; "
        f"{format_bytes(result.source_bytes)} read in {result.seconds:.1f} s ({format_rate(result.rate)}); "
        f"manifest {MANIFEST_NAME}"
    )
    return 0
