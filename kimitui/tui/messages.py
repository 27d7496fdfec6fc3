"""Messages that worker threads post back to the app's event loop."""

from __future__ import annotations

from dataclasses import dataclass

from textual.message import Message

from kimitui.engine.metrics import Snapshot
from kimitui.engine.pinning import PinProgress
from kimitui.engine.session import GenerationResult, TokenEvent


@dataclass
class LoadProgress(Message):
    fraction: float


@dataclass
class LoadFinished(Message):
    seconds: float


@dataclass
class LoadFailed(Message):
    error: str


@dataclass
class PinProgressed(Message):
    progress: PinProgress


@dataclass
class PinFinished(Message):
    pinned_bytes: int
    note: str | None


@dataclass
class TokenReceived(Message):
    reply_id: int
    event: TokenEvent


@dataclass
class ReplyFinished(Message):
    reply_id: int
    result: GenerationResult


@dataclass
class ReplyFailed(Message):
    reply_id: int
    error: str
    result: GenerationResult


@dataclass
class SnapshotReady(Message):
    snapshot: Snapshot
