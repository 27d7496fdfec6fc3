"""Helpers the test modules share (pytest puts tests/ on sys.path for its conftest)."""

from __future__ import annotations

import time


def wait_for(condition, what: str, timeout: float = 180.0) -> None:
    """Poll ``condition`` from a test thread until it holds, or fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)
