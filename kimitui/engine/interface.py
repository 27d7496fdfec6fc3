"""What a user interface asks of an engine: the in-process one (session.Engine) and the one
across HTTP (server.client.RemoteEngine) both implement it, and the app takes either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Protocol

from kimitui.engine.metrics import EngineMetrics
from kimitui.engine.pinning import PinProgress
from kimitui.engine.state import Lifecycle


@dataclass(frozen=True)
class PinOutcome:
    pinned_bytes: int  # 0: nothing pinned here (a remote engine, or the stock load)
    note: str | None  # why the pinned set is not what was asked for (not locked, kept mapped), when it is not
    whole_model: bool  # the model fits: nothing streams


@dataclass(frozen=True)
class TuningValues:
    """The live-tunable settings of a streaming engine, as they are now."""

    budget: int
    prefetch_depth: int
    shard_size: int
    policy: str
    expert_policy: str
    io_threads: int
    expert_lookahead: bool


class Reply(Protocol):
    """One generation: iterate for its TokenEvents; ``result`` once it ends."""

    result: object

    def __iter__(self) -> Iterator: ...
    def cancel(self) -> None: ...


class ChatEngine(Protocol):
    metrics: EngineMetrics
    load_s: float | None  # how long the load took, once it has
    lifecycle: Lifecycle  # its state: a reply is asked for only where ``lifecycle.refusal()`` is None

    def label(self) -> tuple[str, int | None]:
        """(model name, file bytes): what the status bar names; a remote one knows it once loaded."""

    def load(self, on_progress: Callable[[float], None] | None = None) -> None:
        """Block until the model answers; EngineError says why not."""

    def notices(self) -> list[str]:
        """What the user should know once loaded (fast start unavailable, context shrunk, ...)."""

    def pin(self, on_progress: Callable[[PinProgress], None] | None = None) -> PinOutcome: ...

    def chat(self, messages: list[dict], sampling, keep: str | None = None) -> Reply:
        """A reply to ``messages``; ``keep`` names the conversation whose state the engine may
        keep on disk between replies and restarts (ignored where it keeps none)."""

    def resumes(self, key: str) -> bool:
        """Whether the conversation ``key`` would resume from a saved state, its tokens not evaluated."""

    def forget_state(self, key: str) -> None:
        """The conversation ``key`` was deleted: what the engine kept of it goes."""

    def abort_load(self) -> None: ...

    def tuning(self) -> TuningValues | None:
        """The values live tuning starts from; None where this engine is not tuned from here."""

    def retune(self, **changes) -> str:
        """Apply ``changes`` (fields of TuningValues); a line saying when they take effect.
        EngineError for a value that cannot be taken, with nothing changed."""
