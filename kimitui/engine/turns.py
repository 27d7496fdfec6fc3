"""First-come first-served access to the single llama.cpp context.

A plain Lock gives no order and no way to tell a waiting client where it stands; tickets do.
A waiter that gives up (client gone) marks its ticket done so the line never stalls on it.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator


class TurnQueue:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._next_ticket = 0
        self._serving = 0
        self._done: set[int] = set()

    @property
    def waiting(self) -> int:
        """Holder and waiters together: 0 when the engine is free."""
        with self._cond:
            return self._next_ticket - self._serving - len(self._done)

    def take(self) -> int:
        with self._cond:
            ticket = self._next_ticket
            self._next_ticket += 1
            return ticket

    def position(self, ticket: int) -> int:
        """0 for the holder, 1 for the next in line, ..."""
        with self._cond:
            return max(0, ticket - self._serving - sum(1 for t in self._done if t < ticket))

    def wait(self, ticket: int, abandon: threading.Event | None = None) -> bool:
        """Block until ``ticket`` is served; False if ``abandon`` was set first."""
        with self._cond:
            while self._serving != ticket:
                if abandon is not None and abandon.is_set():
                    self._finish(ticket)
                    return False
                self._cond.wait(timeout=0.05)
            return True

    def release(self, ticket: int) -> None:
        with self._cond:
            self._finish(ticket)

    def _finish(self, ticket: int) -> None:
        self._done.add(ticket)
        while self._serving in self._done:
            self._done.discard(self._serving)
            self._serving += 1
        self._cond.notify_all()

    @contextmanager
    def turn(self, abandon: threading.Event | None = None) -> Iterator[bool]:
        ticket = self.take()
        served = self.wait(ticket, abandon)
        try:
            yield served
        finally:
            if served:
                self.release(ticket)
