"""Messages that worker threads post back to the main screen (they stop there: no bubbling to the app)."""

from __future__ import annotations

from dataclasses import dataclass

from textual.message import Message

from kimitui.engine.metrics import Snapshot
from kimitui.engine.pinning import PinProgress
from kimitui.engine.generation import GenerationResult, TokenEvent


@dataclass
class LoadProgress(Message, bubble=False):
    fraction: float


@dataclass
class LoadFinished(Message, bubble=False):
    seconds: float


@dataclass
class PinProgressed(Message, bubble=False):
    progress: PinProgress


@dataclass
class PinFinished(Message, bubble=False):
    pinned_bytes: int
    note: str | None
    whole_model: bool


@dataclass
class TokenReceived(Message, bubble=False):
    reply_id: int
    event: TokenEvent


@dataclass
class ReplyFinished(Message, bubble=False):
    reply_id: int
    result: GenerationResult


@dataclass
class SnapshotReady(Message, bubble=False):
    snapshot: Snapshot


@dataclass
class HistoryFailed(Message, bubble=False):
    """A write to the history database failed (posted to the app from the writer's thread)."""

    error: str
