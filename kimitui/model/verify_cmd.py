"""`kimitui verify DIR`: check every file a manifest lists, size and checksum, and name the bad ones.

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
from kimitui.model.bulkio import Progress, read_ahead
from kimitui.model.manifest import MANIFEST_NAME, FileEntry, Manifest, new_hash, read_manifest
from kimitui.units import format_bytes, format_rate

MAX_THREADS = 4


@dataclass(frozen=True)
class Problem:
    name: str
    path: Path | None  # where it was found; None when missing
    message: str

    def line(self) -> str:
        return f"{self.path or self.name}: {self.message}"


def locate(name: str, dirs: list[Path]) -> Path | None:
    for d in dirs:
        candidate = d / name
        if candidate.is_file():
            return candidate
    return None


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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", type=Path, help=f"directory holding {MANIFEST_NAME} (written by kimitui shard)")
    parser.add_argument("--config", type=Path, help="TOML config whose model.paths are searched too (default: the usual one)")


def run(args: argparse.Namespace) -> int:
    from kimitui.config import load_settings

    settings = load_settings(args.config, explicit=args.config is not None)
    search = [Path(p).expanduser() for p in settings["model.paths"]]
    result = verify(args.directory, search)
    for p in result.problems:
        print(p.line())
    rate = format_rate(result.n_bytes / max(result.seconds, 1e-9))
    if result.problems:
        print(f"{len(result.problems)} of {result.checked} files bad ({format_bytes(result.n_bytes)} hashed at {rate})")
        return 1
    print(f"all {result.checked} files good: {format_bytes(result.n_bytes)} checked in {result.seconds:.1f} s ({rate})")
    return 0
