"""The per-token trace: where every millisecond and byte of a reply went.

``TraceWriter`` (writer.py) records requests, tokens and storage reads as JSON Lines;
``kimitui trace summarize|compare|bench`` (cli.py) reads them back. Traces live in the user log
dir unless ``trace.path`` / ``--trace`` say otherwise, never on the drive the model streams from.
"""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

from kimitui.config import APP_NAME, Settings
from kimitui.errors import UserError
from kimitui.trace.writer import TraceWriter

__all__ = ["TraceWriter", "check_not_model_drive", "default_trace_path", "open_trace"]


def default_trace_path() -> Path:
    return Path(platformdirs.user_log_dir(APP_NAME)) / "trace.jsonl"


def _device(path: Path) -> int:
    """st_dev of ``path`` or of its nearest existing parent (the file may not exist yet)."""
    for candidate in (path, *path.parents):
        try:
            return os.stat(candidate).st_dev
        except FileNotFoundError:
            continue
    raise AssertionError("the file system root always exists")


def check_not_model_drive(trace: Path, model_files: list[Path], origin: str) -> None:
    """Writes on the drive the model streams from would compete with its reads. The system
    drive (the one holding the user log dir) is allowed: a model there streams from it anyway."""
    device = _device(trace)
    if device == _device(default_trace_path()):
        return
    for model in model_files:
        if _device(model) == device:
            raise UserError(
                f"{origin}: {trace} is on the drive the model {model.name} streams from; "
                "traces go elsewhere so their writes never compete with model reads"
            )


def open_trace(settings: Settings, model_files: list[Path]) -> TraceWriter | None:
    """The writer ``trace.*`` asks for (None when tracing is off); errors are one line."""
    if not settings["trace.enabled"]:
        return None
    raw = settings["trace.path"]
    path = Path(raw).expanduser() if raw else default_trace_path()
    origin = settings.origin("trace.path") if raw else "trace.path (default)"
    check_not_model_drive(path, model_files, origin)
    try:
        return TraceWriter(path, max_bytes=settings["trace.max_size"], keep=settings["trace.keep"])
    except OSError as exc:
        raise UserError(f"{origin}: cannot write the trace file {path}: {exc.strerror or exc}") from None
