"""`kimitui verify DIR|GGUF`: check every file a manifest lists, size and checksum, and name the bad ones.

Given a GGUF instead (a single file, or any file of a split set, as published sets come without
a kimitui manifest), the check is structural: every file of the set present, each header
readable with its split number where its name says, every tensor inside its file, the set's
tensor count as the first header says, and both ends of every tensor readable from the drive.
There are no checksums to compare without a manifest; ``kimitui shard`` writes one.

Files are looked for in DIR, then in the `model.paths` directories of the config, as the
engine finds them when a set is spread over drives. Files are hashed in parallel (one thread
per core, up to MAX_THREADS), each with read-ahead, so the check runs at disk speed where the
CPU allows. Exit 0: all good; 1: some file missing or damaged (one line each); 2: usage error.
"""

from __future__ import annotations

import argparse
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kimitui.errors import UserError
from kimitui.model.bulkio import Progress, is_hole, read_ahead
from kimitui.model.manifest import MANIFEST_NAME, FileEntry, Manifest, locate, new_hash, read_manifest
from kimitui.units import format_bytes, format_rate

MAX_THREADS = 4


@dataclass(frozen=True)
class Problem:
    name: str
    path: Path | None  # where it was found; None when missing
    message: str

    def line(self) -> str:
        return f"{self.path or self.name}: {self.message}"


def file_digest(path: Path, algorithm: str, progress: Progress) -> str:
    digest = new_hash(algorithm)
    fd = os.open(path, os.O_RDONLY)
    try:
        for view in read_ahead([(fd, 0, os.fstat(fd).st_size)]):
            digest.update(view)
            progress.add(len(view))
    finally:
        os.close(fd)
    return digest.hexdigest()


@dataclass(frozen=True)
class VerifyResult:
    checked: int
    n_bytes: int
    seconds: float
    problems: tuple[Problem, ...]


def verify(directory: Path, search: list[Path], *, threads: int | None = None, progress_stream=None) -> VerifyResult:
    """Check every file of the manifest in `directory` (found there or in `search`)."""
    manifest_path = directory / MANIFEST_NAME
    if directory.is_file() and directory.name == MANIFEST_NAME:
        manifest_path, directory = directory, directory.parent
    if not directory.is_dir():
        raise UserError(f"not a directory: {directory}")
    if not manifest_path.is_file():
        raise UserError(f"no {MANIFEST_NAME} in {directory} (kimitui shard writes one next to the files)")
    manifest: Manifest = read_manifest(manifest_path)
    dirs = [directory] + [d for d in search if d != directory]
    problems: list[Problem] = []
    to_hash: list[tuple[FileEntry, Path]] = []
    for entry in manifest.files:
        path = locate(entry.name, dirs)
        if path is None:
            where = ", ".join(str(d) for d in dirs)
            problems.append(Problem(entry.name, None, f"missing (looked in {where})"))
            continue
        size = path.stat().st_size
        if size != entry.bytes:
            why = "truncated copy?" if size < entry.bytes else "not the file the manifest lists?"
            problems.append(Problem(entry.name, path, f"{size} bytes, the manifest says {entry.bytes} ({why})"))
            continue
        to_hash.append((entry, path))
    total = sum(e.bytes for e, _ in to_hash)
    progress = Progress("verify", total, progress_stream)

    def check(item: tuple[FileEntry, Path]) -> Problem | None:
        entry, path = item
        try:
            if file_digest(path, manifest.checksum, progress) != entry.checksum:
                return Problem(entry.name, path, f"damaged: its {manifest.checksum} differs from the manifest (copy it again)")
        except OSError as exc:
            return Problem(entry.name, path, f"cannot read: {exc.strerror or exc}")
        return None

    workers = threads or min(MAX_THREADS, os.cpu_count() or 1)
    try:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kimitui-verify") as pool:
            results = list(pool.map(check, to_hash))
    finally:
        progress.close()
    problems += [p for p in results if p is not None]
    order = {e.name: i for i, e in enumerate(manifest.files)}
    problems.sort(key=lambda p: order[p.name])
    return VerifyResult(len(manifest.files), total, progress.seconds, tuple(problems))


@dataclass(frozen=True)
class StructureResult:
    checked: int  # files
    n_bytes: int
    tensors: int
    seconds: float
    problems: tuple[Problem, ...]


def verify_gguf(path: Path) -> StructureResult:
    """The structural check of a GGUF or split set without a manifest (see the module's doc)."""
    import time

    from kimitui.model.gguf_file import check_split_number
    from kimitui.model.gguf_map import _open_reader, field_value, split_set, tensor_layout

    started = time.perf_counter()
    files = split_set(path)  # UserError naming the first missing file
    problems: list[Problem] = []
    n_tensors, expected = 0, None
    page = os.sysconf("SC_PAGE_SIZE")
    for index, file in enumerate(files):
        try:
            reader = _open_reader(file)
            size = os.path.getsize(file)
            check_split_number(reader, file, index, len(files))
            if len(files) > 1 and index == 0:
                expected = field_value(reader, "split.tensors.count")
            layout = list(tensor_layout(reader, file, size))
            fd = os.open(file, os.O_RDONLY)
            try:
                for name, _type, _shape, n_bytes, offset in layout:
                    for at in {offset, max(offset, offset + n_bytes - page)}:
                        if len(os.pread(fd, min(page, n_bytes), at)) != min(page, n_bytes):
                            raise UserError(f"tensor {name}: short read at byte {at} (file changed while read?)")
            finally:
                os.close(fd)
            n_tensors += len(layout)
        except UserError as exc:
            message = str(exc)
            problems.append(Problem(file.name, file, message.removeprefix(f"{file}: ")))
        except OSError as exc:
            problems.append(Problem(file.name, file, f"cannot read: {exc.strerror or exc}"))
    if not problems and expected is not None and expected != n_tensors:
        problems.append(Problem(files[0].name, files[0], f"the set's files hold {n_tensors} tensors, its split.tensors.count says {expected} (files from different sets?)"))
    n_bytes = sum(f.stat().st_size for f in files)
    return StructureResult(len(files), n_bytes, n_tensors, time.perf_counter() - started, tuple(problems))


@dataclass(frozen=True)
class ExpertsResult:
    tensors: int
    n_bytes: int
    holes: int  # bytes both sides have as holes: equal without a read
    seconds: float
    problems: tuple[Problem, ...]


def same_experts(model: Path, source: Path, *, progress_stream=None) -> ExpertsResult:
    """Compare every routed expert tensor of `model` with `source`'s of the same name, byte
    for byte (what `kimitui requant` promises); ranges that are holes in both are equal unread."""
    import time

    from kimitui.model.gguf_map import ROUTED_EXPERTS, load_model_map

    started = time.perf_counter()
    ours, theirs = load_model_map(model), load_model_map(source)
    by_name = {t.name: t for t in theirs.tensors if t.role == ROUTED_EXPERTS}
    routed = [t for t in ours.tensors if t.role == ROUTED_EXPERTS]
    problems: list[Problem] = []
    names = {t.name for t in routed}
    for name in sorted(set(by_name) - names):
        problems.append(Problem(name, None, f"in {source.name} but not in {model.name}"))
    pairs = []
    for t in routed:
        other = by_name.get(t.name)
        if other is None:
            problems.append(Problem(t.name, None, f"in {model.name} but not in {source.name}"))
        elif (t.ggml_type, t.shape) != (other.ggml_type, other.shape):
            problems.append(Problem(t.name, None, f"{t.ggml_type} {list(t.shape)} here, {other.ggml_type} {list(other.shape)} in {source.name}"))
        else:
            pairs.append((t, other))
    fds_a = [os.open(f, os.O_RDONLY) for f in ours.files]
    fds_b = [os.open(f, os.O_RDONLY) for f in theirs.files]
    progress = Progress("verify experts", sum(t.n_bytes for t, _ in pairs), progress_stream)
    holes = 0
    try:
        for t, other in pairs:
            a, b = fds_a[t.file], fds_b[other.file]
            step = 8 * 1024**2
            for at in range(0, t.n_bytes, step):
                n = min(step, t.n_bytes - at)
                if is_hole(a, t.offset + at, n) and is_hole(b, other.offset + at, n):
                    holes += n
                elif os.pread(a, n, t.offset + at) != os.pread(b, n, other.offset + at):
                    problems.append(Problem(t.name, None, f"differs from {source.name} within bytes {at}-{at + n} of the tensor"))
                    break
                progress.add(n)
    finally:
        progress.close()
        for fd in fds_a + fds_b:
            os.close(fd)
    return ExpertsResult(len(pairs), sum(t.n_bytes for t, _ in pairs), holes, time.perf_counter() - started, tuple(problems))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "directory", type=Path, metavar="path",
        help=f"directory holding {MANIFEST_NAME} (written by kimitui shard), or a GGUF (any file of a split set)",
    )
    parser.add_argument("--config", type=Path, help="TOML config whose model.paths are searched too (default: the usual one)")
    parser.add_argument(
        "--same-experts-as", type=Path, metavar="MODEL",
        help="also compare every routed expert tensor with MODEL's, byte for byte (after kimitui requant)",
    )


def run(args: argparse.Namespace) -> int:
    from kimitui.config import load_settings

    settings = load_settings(args.config, explicit=args.config is not None)
    search = [Path(p).expanduser() for p in settings["model.paths"]]
    if args.same_experts_as is not None:
        return _run_same_experts(args.directory, args.same_experts_as)
    if args.directory.is_file() and args.directory.name != MANIFEST_NAME:
        result = verify_gguf(args.directory)
        for p in result.problems:
            print(p.line())
        if result.problems:
            print(f"{len(result.problems)} of {result.checked} files bad")
            return 1
        files = f"all {result.checked} files good: headers, split numbers" if result.checked > 1 else "the file is good: its header"
        print(
            f"{files} and {result.tensors:,} tensors checked, both ends of each "
            f"read ({format_bytes(result.n_bytes)} in all) in {result.seconds:.1f} s; no checksums without a manifest "
            "(kimitui shard writes one)"
        )
        return 0
    result = verify(args.directory, search)
    for p in result.problems:
        print(p.line())
    rate = format_rate(result.n_bytes / max(result.seconds, 1e-9))
    if result.problems:
        print(f"{len(result.problems)} of {result.checked} files bad ({format_bytes(result.n_bytes)} hashed at {rate})")
        return 1
    print(f"all {result.checked} files good: {format_bytes(result.n_bytes)} checked in {result.seconds:.1f} s ({rate})")
    return 0


def _model_file(path: Path) -> Path:
    """A model's first file, from the file itself, its directory or its manifest."""
    if path.is_file() and path.name == MANIFEST_NAME:
        path = path.parent
    if path.is_dir():
        manifest_path = path / MANIFEST_NAME
        if not manifest_path.is_file():
            raise UserError(f"no {MANIFEST_NAME} in {path}: give the model's first file instead")
        return path / read_manifest(manifest_path).files[0].name
    return path


def _run_same_experts(path: Path, source: Path) -> int:
    """First the files' own check (against the manifest, or their structure), then the experts
    against `source`'s."""
    model, source = _model_file(path), _model_file(source)
    if path.is_dir() or path.name == MANIFEST_NAME:
        checked = verify(path, [])
        own = "against the manifest"
    else:
        checked = verify_gguf(path)
        own = "in their structure"
    for p in checked.problems:
        print(p.line())
    if checked.problems:
        print(f"{len(checked.problems)} of {checked.checked} files bad; experts not compared")
        return 1
    print(f"all {checked.checked} files good {own}")
    result = same_experts(model, source)
    for p in result.problems:
        print(p.line())
    if result.problems:
        print(f"{len(result.problems)} routed expert tensors differ from {source}'s or are missing from one side")
        return 1
    if not result.tensors:
        print(f"no routed expert tensors in {model.name} or {source.name}: nothing to compare")
        return 0
    holes = f" ({format_bytes(result.holes)} holes on both sides)" if result.holes else ""
    print(
        f"the routed experts are identical to {source}: {result.tensors} tensors, "
        f"{format_bytes(result.n_bytes)}{holes} compared in {result.seconds:.1f} s"
    )
    return 0
