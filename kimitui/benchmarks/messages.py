"""A measured child's messages to its parent: one line each, ``MARKER`` and a JSON object
with its ``kind``, written straight to file descriptor 1 (Textual captures ``print`` while an
app runs). Both sides import this alone: a phase's imports are part of what it measures."""

from __future__ import annotations

import json
import os

MARKER = "@kimitui-bench "


def emit(kind: str, **payload) -> None:
    os.write(1, (MARKER + json.dumps({"kind": kind, **payload}) + "\n").encode())


def parse(line: str) -> tuple[str, dict] | None:
    """A message's kind and payload; None for a line that is not a message (llama.cpp's log)."""
    if not line.startswith(MARKER):
        return None
    message = json.loads(line[len(MARKER):])
    return message.pop("kind"), message
