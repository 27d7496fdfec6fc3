"""`kimitui-manifest.json`: what `kimitui shard` wrote, so a copy can be checked file by file.

Per file: its size, a checksum of all its bytes (what `kimitui verify` recomputes) and a
checksum of its two ends (the first and last ENDS_BYTES). The ends catch, at every model
load and for the price of two small reads per file, the usual ways a copy goes wrong without
changing the size: a different file under the same name, a damaged header (all of it, but
the first file's vocabulary), a copy that stopped early into a preallocated file (exFAT does
that) and left zeros at the end. Everything else is for `kimitui verify`.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from kimitui.errors import UserError
from kimitui.units import format_bytes

MANIFEST_NAME = "kimitui-manifest.json"
FORMAT = "kimitui-shards"
VERSION = 1
# sha256 by default: OpenSSL uses the CPU's SHA instructions (x86 SHA-NI, ARMv8 SHA2, which
# the target phones have). Measured here: sha256 1.7 GiB/s, blake2b 0.87 GiB/s per core.
CHECKSUMS = ("sha256", "blake2b")
DEFAULT_CHECKSUM = "sha256"
ENDS_BYTES = 64 * 1024  # x2 per file at each load: ~100 MB over the ~800 files of a 1.5 TB set


@dataclass(frozen=True)
class FileEntry:
    name: str
    bytes: int
    checksum: str  # hex digest of the whole file
    ends: str  # hex digest of its first and last `Manifest.ends_bytes`


@dataclass(frozen=True)
class Manifest:
    model: str
    checksum: str  # the hashlib algorithm of every digest
    files: tuple[FileEntry, ...]
    shard_size: int
    trunk_first: bool
    ends_bytes: int = ENDS_BYTES

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": FORMAT,
                "version": VERSION,
                "model": self.model,
                "checksum": self.checksum,
                "shard_size": self.shard_size,
                "trunk_first": self.trunk_first,
                "ends_bytes": self.ends_bytes,
                "files": [vars(f) for f in self.files],
            },
            indent=1,
        )

    def entry(self, name: str) -> FileEntry | None:
        for f in self.files:
            if f.name == name:
                return f
        return None


def new_hash(algorithm: str):
    return hashlib.new(algorithm)


def ends_digest(path: Path, size: int, algorithm: str, ends_bytes: int = ENDS_BYTES) -> str:
    """Checksum of a file's first and last `ends_bytes` (the whole file when it is smaller)."""
    h = new_hash(algorithm)
    with path.open("rb") as fh:
        h.update(fh.read(min(size, ends_bytes)))
        tail = max(ends_bytes, size - ends_bytes)
        if tail < size:
            fh.seek(tail)
            h.update(fh.read(size - tail))
    return h.hexdigest()


def write_manifest(directory: Path, manifest: Manifest) -> Path:
    """Write through a temporary name: a manifest that exists is always whole."""
    final = directory / MANIFEST_NAME
    tmp = directory / f".{MANIFEST_NAME}.partial"
    with tmp.open("w", encoding="utf-8") as fh:
        fh.write(manifest.to_json() + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, final)
    return final


def read_manifest(path: Path) -> Manifest:
    """Parse a manifest file; UserError naming it when it is not one of ours."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror}") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise UserError(f"{path}: not a kimitui manifest (not JSON: {exc})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise UserError(f"{path}: not a kimitui manifest (no \"format\": \"{FORMAT}\")")
    if data.get("version") != VERSION:
        raise UserError(f"{path}: manifest version {data.get('version')!r}; this kimitui reads version {VERSION}")
    try:
        algorithm = data["checksum"]
        if algorithm not in CHECKSUMS:
            raise ValueError(f"unknown checksum {algorithm!r}")
        files = tuple(
            FileEntry(str(f["name"]), int(f["bytes"]), str(f["checksum"]), str(f["ends"])) for f in data["files"]
        )
        if not files:
            raise ValueError("it lists no files")
        return Manifest(
            model=str(data.get("model", "")),
            checksum=algorithm,
            files=files,
            shard_size=int(data["shard_size"]),
            trunk_first=bool(data["trunk_first"]),
            ends_bytes=int(data["ends_bytes"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(f"{path}: damaged manifest ({type(exc).__name__}: {exc})") from None


def locate(name: str, dirs: list[Path]) -> Path | None:
    """The first ``dirs/name`` that is a file: where a manifest's entry lives when its files
    were moved apart."""
    for d in dirs:
        candidate = d / name
        if candidate.is_file():
            return candidate
    return None


def find_manifests(files: Iterable[Path]) -> list[tuple[Path, Manifest]]:
    """Manifests in the directories the (real, symlinks followed) files live in."""
    found: list[tuple[Path, Manifest]] = []
    seen: set[Path] = set()
    for f in files:
        directory = Path(os.path.realpath(f)).parent
        if directory in seen:
            continue
        seen.add(directory)
        candidate = directory / MANIFEST_NAME
        if candidate.is_file():
            found.append((candidate, read_manifest(candidate)))
    return found


def quick_check(files: Sequence[Path]) -> None:
    """Size and ends of each file against a manifest found next to it (or next to another
    file of the set); UserError naming the first bad file. Files no manifest lists pass."""
    manifests = find_manifests(files)
    if not manifests:
        return
    for f in files:
        real = Path(os.path.realpath(f))
        # prefer the manifest in the file's own directory: it was copied with the file
        ordered = sorted(manifests, key=lambda pm: pm[0].parent != real.parent)
        for manifest_path, manifest in ordered:
            entry = manifest.entry(f.name)
            if entry is None:
                continue
            size = real.stat().st_size
            if size != entry.bytes:
                raise UserError(
                    f"{real}: {size} bytes, {manifest_path} says {entry.bytes} "
                    f"({'truncated copy' if size < entry.bytes else 'wrong file'}? kimitui verify names every bad file)"
                )
            if ends_digest(real, size, manifest.checksum, manifest.ends_bytes) != entry.ends:
                raise UserError(
                    f"{real}: its first or last {format_bytes(manifest.ends_bytes, 0)} differ from {manifest_path} "
                    "(damaged or unfinished copy? kimitui verify names every bad file)"
                )
            break
