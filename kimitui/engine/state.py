"""What state an engine is in, the one object that changes it, and the engine's errors (shown
to the user as they are)."""

from __future__ import annotations

import enum
import threading
from typing import Callable


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


class IllegalMove(RuntimeError):
    """A transition the lifecycle does not allow: a bug in the caller, never a user's mistake."""


# Every transition there is. FAILED never leads to GENERATING: a failed engine is READY again
# only once what broke it was made anew (``Lifecycle.begin_reply``), or it is loaded again.
MOVES: dict[EngineState, frozenset[EngineState]] = {
    EngineState.EMPTY: frozenset({EngineState.LOADING}),
    EngineState.LOADING: frozenset({EngineState.READY, EngineState.FAILED, EngineState.EMPTY}),
    EngineState.READY: frozenset({EngineState.GENERATING, EngineState.FAILED, EngineState.EMPTY}),
    EngineState.GENERATING: frozenset({EngineState.READY, EngineState.FAILED}),
    EngineState.FAILED: frozenset({EngineState.LOADING, EngineState.READY, EngineState.EMPTY}),
}


class Lifecycle:
    """An engine's state and the only way to change it: each move is checked against MOVES.

    A failure says why (``reason``) and, where the engine can mend it without a new load,
    how (``recover``: a callable that raises EngineError when it cannot, for instance a
    llama.cpp context made anew after a budget change failed to make one). The next reply tries
    it first; a reply never starts on a failed engine."""

    def __init__(self) -> None:
        self._state = EngineState.EMPTY
        self._lock = threading.Lock()
        self.closed = False  # after close(): EMPTY for good, and a load or reply ending late changes nothing
        self.reason: str | None = None  # why the engine failed, while it is FAILED
        self._recover: Callable[[], None] | None = None

    @property
    def state(self) -> EngineState:
        return self._state

    def move(self, to: EngineState) -> None:
        with self._lock:
            if self.closed:
                return
            if to not in MOVES[self._state]:
                raise IllegalMove(f"engine state {self._state.value} -> {to.value} is not a transition")
            self._state = to
            if to is not EngineState.FAILED:
                self.reason, self._recover = None, None

    def fail(self, reason: str, recover: Callable[[], None] | None = None) -> None:
        """FAILED, from any state that has started (loading, ready, generating): ``reason`` is
        what the user is told."""
        with self._lock:
            if self.closed:
                return
            if self._state is not EngineState.FAILED and EngineState.FAILED not in MOVES[self._state]:
                raise IllegalMove(f"engine state {self._state.value} -> failed is not a transition")
            self._state, self.reason, self._recover = EngineState.FAILED, reason, recover

    @property
    def recoverable(self) -> bool:
        return self._state is EngineState.FAILED and self._recover is not None

    def refusal(self) -> str | None:
        """Why a reply asked for now would be refused; None when it would run (a recoverable
        failure included: the reply tries the recovery first). What the TUI and the API ask
        before they start one."""
        state = self._state
        if state in (EngineState.READY, EngineState.GENERATING) or self.recoverable:
            return None
        if state is EngineState.FAILED:
            return self.reason or "the engine failed"
        if self.closed:
            return "the engine was closed"
        return "the model is still loading"  # EMPTY too: a server answers before its load begins

    def begin_reply(self) -> None:
        """READY -> GENERATING, in the engine's turn; a recoverable failure is mended first.
        EngineError (the engine's state unchanged) when no reply can run."""
        if self._state is EngineState.FAILED and self._recover is not None:
            recover = self._recover
            try:
                recover()
            except EngineError as exc:
                self.fail(str(exc), recover)
                raise
            except Exception as exc:  # a bug in the mend: said, and the engine stays failed
                reason = f"mending the engine failed: {type(exc).__name__}: {exc}"
                self.fail(reason, recover)
                raise EngineError(reason) from None
            self.move(EngineState.READY)
        refused = self.refusal()
        if refused is not None or self._state is not EngineState.READY:
            raise EngineError(refused or f"the engine is {self._state.value}")
        self.move(EngineState.GENERATING)

    def end_reply(self) -> None:
        """GENERATING -> READY; a failure met during the reply stays."""
        with self._lock:
            if self._state is EngineState.GENERATING and not self.closed:
                self._state = EngineState.READY

    def close(self) -> None:
        """EMPTY from any state, for good: the engine was closed (a quit mid-load or mid-reply)."""
        with self._lock:
            self._state, self.closed, self.reason, self._recover = EngineState.EMPTY, True, None, None

    def require(self, *states: EngineState) -> None:
        """For code that touches llama.cpp's context (slots): a bug if the engine is elsewhere."""
        if self._state not in states:
            raise IllegalMove(f"engine state {self._state.value}: expected {', '.join(s.value for s in states)}")
