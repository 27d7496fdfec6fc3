"""Find a model whose files are spread over several directories (drives) and hand llama.cpp
one path it can load.

llama.cpp opens split file N next to the first file, by name. When the trunk files sit on
internal storage and the experts on an external SSD, kimitui gathers symlinks to every file
in one directory of the user cache (never on the model's drives) and gives llama.cpp the
first of those; the kernel follows the links, so reads go to the real files.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Sequence

from kimitui.config import cache_dir
from kimitui.errors import UserError
from kimitui.model.gguf_map import _SPLIT_RE, split_names
from kimitui.model.manifest import MANIFEST_NAME, locate, read_manifest


def link_root() -> Path:
    return cache_dir() / "split-sets"


def _search_dirs(path: Path, search_dirs: Sequence[Path]) -> list[Path]:
    dirs: list[Path] = []
    for d in [path.parent, *search_dirs]:
        d = d.expanduser()
        if d not in dirs:
            dirs.append(d)
    return dirs


def model_in_directory(directory: Path) -> Path:
    """The model a directory holds: the first file its manifest lists (`kimitui shard`'s output),
    else its one GGUF or split set. UserError when that is not one model."""
    manifest = directory / MANIFEST_NAME
    if manifest.is_file():
        return directory / read_manifest(manifest).files[0].name
    firsts = sorted(
        p.name for p in directory.glob("*.gguf") if (m := _SPLIT_RE.match(p.name)) is None or int(m["no"]) == 1
    )
    if len(firsts) == 1:
        return directory / firsts[0]
    found = f"{len(firsts)} models ({', '.join(firsts[:3])}{', ...' if len(firsts) > 3 else ''})" if firsts else "no .gguf file"
    raise UserError(f"{directory} is a directory with {found}: give the model's .gguf file")


def assemble_split_set(path: Path, search_dirs: Sequence[Path] = ()) -> Path:
    """The path llama.cpp should open for `path` (any file of a split set, or a single GGUF;
    looked for in its own directory, then in `search_dirs` in order, first match wins).

    A single file, or a set whose files all sit together, comes back as found. A set spread
    over several directories comes back as the first file of a directory of symlinks in the
    user cache. UserError names every missing file in one line. A directory stands for the
    model in it."""
    if path.is_dir():
        path = model_in_directory(path)
    dirs = _search_dirs(path, search_dirs)
    looked = ", ".join(str(d) for d in dirs)
    names = split_names(path)
    if names is None:
        found = locate(path.name, dirs)
        if found is None:
            raise UserError(f"model file not found: {path.name} (looked in {looked})")
        return found
    found = {name: locate(name, dirs) for name in names}
    missing = [name for name, p in found.items() if p is None]
    if missing:
        raise UserError(
            f"split set of {len(names)} files is incomplete: {', '.join(missing)} not found (looked in {looked})"
        )
    paths = [found[name] for name in names]
    if len({p.parent for p in paths}) == 1:
        return paths[0]
    return _link_dir([Path(os.path.realpath(p)) for p in paths])[0]


def _link_dir(targets: list[Path]) -> list[Path]:
    """Symlinks named as `targets` in a cache directory keyed by the targets; reused when it
    already points at them, rebuilt (through a temporary name) when not."""
    key = hashlib.sha256("\n".join(str(t) for t in targets).encode()).hexdigest()[:16]
    prefix = _SPLIT_RE.match(targets[0].name)["prefix"]
    root = link_root()
    final = root / f"{prefix}-{key}"
    links = [final / t.name for t in targets]
    if all(link.is_symlink() and Path(os.readlink(link)) == t for link, t in zip(links, targets)):
        return links
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{final.name}.{os.getpid()}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for t in targets:
        (tmp / t.name).symlink_to(t)
    shutil.rmtree(final, ignore_errors=True)
    try:
        os.replace(tmp, final)
    except OSError:  # another kimitui built the same directory meanwhile: same key, same links
        shutil.rmtree(tmp, ignore_errors=True)
    return links

