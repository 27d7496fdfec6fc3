"""What state an engine is in, and its errors (shown to the user as they are)."""

from __future__ import annotations

import enum


class EngineState(enum.Enum):
    EMPTY = "empty"
    LOADING = "loading"
    READY = "ready"
    GENERATING = "generating"
    FAILED = "failed"


class EngineError(Exception):
    """A failure while loading or generating; the message is shown to the user as is."""


class ChatTemplateError(EngineError):
    """The model's chat template refused the messages (its ``raise_exception``, or a template
    that does not render them): the request's fault, not the engine's."""
