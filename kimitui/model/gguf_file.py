"""Read a GGUF's header with the `gguf` package and reject broken files before llama.cpp does.

llama.cpp aborts or prints pages of log on a bad file; users get one line from here instead.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kimitui.errors import UserError

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class ModelInfo:
    path: Path
    name: str
    architecture: str
    file_bytes: int
    tensor_bytes: int
    n_tensors: int
    n_layers: int | None
    context_length: int | None
    has_chat_template: bool


def _field_value(reader, key: str):
    field = reader.fields.get(key)
    if field is None:
        return None
    try:
        return field.contents()
    except Exception:  # a field of a type this gguf version cannot render: treat as absent
        return None


def read_model_info(path: Path) -> ModelInfo:
    if not path.exists():
        raise UserError(f"model file not found: {path}")
    if not path.is_file():
        raise UserError(f"model path is not a file: {path}")
    try:
        with path.open("rb") as fh:
            magic = fh.read(4)
    except OSError as exc:
        raise UserError(f"cannot read model file {path}: {exc.strerror}") from None
    if magic != GGUF_MAGIC:
        raise UserError(f"{path}: not a GGUF file (starts with {magic!r}, expected b'GGUF')")

    from gguf import GGUFReader  # heavy import (numpy); only when a model is opened

    try:
        reader = GGUFReader(str(path), "r")
    except Exception as exc:  # the gguf package raises ValueError, IndexError, ... on damage
        raise UserError(f"{path}: corrupt or truncated GGUF ({type(exc).__name__}: {exc})") from None

    file_bytes = os.path.getsize(path)
    tensor_bytes = 0
    for tensor in reader.tensors:
        end = tensor.data_offset + tensor.n_bytes
        if end > file_bytes:
            raise UserError(
                f"{path}: tensor {tensor.name} ends at byte {end} but the file has {file_bytes} "
                "bytes (truncated copy?)"
            )
        tensor_bytes += int(tensor.n_bytes)

    arch = _field_value(reader, "general.architecture") or "unknown"
    name = _field_value(reader, "general.name") or path.stem
    n_layers = _field_value(reader, f"{arch}.block_count")
    ctx = _field_value(reader, f"{arch}.context_length")
    return ModelInfo(
        path=path,
        name=str(name),
        architecture=str(arch),
        file_bytes=file_bytes,
        tensor_bytes=tensor_bytes,
        n_tensors=len(reader.tensors),
        n_layers=int(n_layers) if n_layers is not None else None,
        context_length=int(ctx) if ctx is not None else None,
        has_chat_template=_field_value(reader, "tokenizer.chat_template") is not None,
    )
