"""Read a GGUF's header with the `gguf` package and reject broken files before llama.cpp does.

llama.cpp aborts or prints pages of log on a bad file; users get one line from here instead.
A split set is checked whole (any of its files may be given): every file present, its
header readable and its tensors inside it, its split number where its name says, and, where
`kimitui shard` left a manifest next to the files, each file's size and ends as listed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kimitui.errors import UserError

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class ModelInfo:
    path: Path  # the file llama.cpp opens: the first file of a split set
    name: str
    architecture: str
    file_bytes: int  # all files of a split set together
    tensor_bytes: int
    n_tensors: int
    n_layers: int | None
    context_length: int | None
    has_chat_template: bool
    files: tuple[Path, ...] = ()  # every file, in split order (just `path` for a single file)


_checked: dict[tuple, ModelInfo] = {}


def read_model_info(path: Path) -> ModelInfo:
    """Checked once per file state: start-up asks twice (command line, engine), and the header
    parse is a sixth of the time to ready. A file state (every file's path, inode, size and
    mtime) that passed once is remembered in the user cache dir; the manifest's size-and-ends
    check, which reads the files, still runs at every start."""
    if not path.exists():
        raise UserError(f"model file not found: {path}")
    if not path.is_file():
        raise UserError(f"model path is not a file: {path}")
    from kimitui.model.gguf_map import split_set

    try:
        # Every file of a set is part of the key: a damaged later file must be seen again.
        key = tuple(
            (str(f.resolve()), st.st_ino, st.st_size, st.st_mtime_ns) for f in split_set(path) for st in [f.stat()]
        )
    except (OSError, UserError):
        key = None  # let the full check name what is wrong
    if key is None:
        return _read_model_info(path)
    if key not in _checked:
        info = _remembered(key)
        if info is None:
            info = _read_model_info(path)
            _remember(key, info)
        else:
            from kimitui.model.manifest import quick_check

            quick_check(info.files)
        _checked[key] = info
    return _checked[key]


def _cache_file() -> Path:
    from kimitui.config import cache_dir

    return cache_dir() / "checked-models.json"


def _remembered(key: tuple) -> ModelInfo | None:
    import json

    try:
        entry = json.loads(_cache_file().read_text()).get(json.dumps(key))
        if entry is None:
            return None
        return ModelInfo(**{**entry, "path": Path(entry["path"]), "files": tuple(Path(f) for f in entry["files"])})
    except (OSError, ValueError, TypeError, AttributeError):
        return None  # no cache or an unreadable one: check the file again


def _remember(key: tuple, info: ModelInfo) -> None:
    import dataclasses
    import json

    from kimitui.config import replace_file

    cache = _cache_file()
    try:
        known = json.loads(cache.read_text())
        if not isinstance(known, dict):
            known = {}
    except (OSError, ValueError):
        known = {}
    entry = {**dataclasses.asdict(info), "path": str(info.path), "files": [str(f) for f in info.files]}
    known = {k: v for k, v in list(known.items())[-31:]}  # the last few models are enough
    known[json.dumps(key)] = entry
    try:
        replace_file(cache, json.dumps(known))
    except OSError:
        pass  # a read-only cache dir costs the next start its header parse, nothing more


def check_split_number(reader, file: Path, index: int, n_files: int) -> None:
    """A file of a split set must carry the split number its name gives (counted from 1 in
    both): UserError naming it otherwise."""
    if n_files == 1:
        return
    from kimitui.model.gguf_map import field_value

    number, count = field_value(reader, "split.no"), field_value(reader, "split.count")
    if number != index or count != n_files:
        shown = number + 1 if isinstance(number, int) else number
        raise UserError(f"{file}: its header says split {shown} of {count}, its name says {index + 1} of {n_files} (a file from another set?)")


def _read_model_info(path: Path) -> ModelInfo:
    from kimitui.model.gguf_map import _open_reader, field_value, split_set, tensor_layout
    from kimitui.model.manifest import quick_check

    files = split_set(path)
    first = None
    file_bytes = tensor_bytes = n_tensors = 0
    for index, file in enumerate(files):
        reader = _open_reader(file)  # header only: one line naming the file on damage
        size = os.path.getsize(file)
        file_bytes += size
        check_split_number(reader, file, index, len(files))
        for _name, _type, _shape, n_bytes, _offset in tensor_layout(reader, file, size):
            tensor_bytes += n_bytes
            n_tensors += 1
        if index == 0:
            first = reader
    assert first is not None
    if len(files) > 1:
        expected = field_value(first, "split.tensors.count")
        if expected is not None and expected != n_tensors:
            raise UserError(
                f"{files[0]}: the set's files hold {n_tensors} tensors, its split.tensors.count says "
                f"{expected} (files from different sets?)"
            )
    quick_check(files)

    arch = field_value(first, "general.architecture") or "unknown"
    name = field_value(first, "general.name") or files[0].stem
    n_layers = field_value(first, f"{arch}.block_count")
    ctx = field_value(first, f"{arch}.context_length")
    return ModelInfo(
        path=files[0],
        name=str(name),
        architecture=str(arch),
        file_bytes=file_bytes,
        tensor_bytes=tensor_bytes,
        n_tensors=n_tensors,
        n_layers=int(n_layers) if n_layers is not None else None,
        context_length=int(ctx) if ctx is not None else None,
        has_chat_template=field_value(first, "tokenizer.chat_template") is not None,
        files=tuple(files),
    )
