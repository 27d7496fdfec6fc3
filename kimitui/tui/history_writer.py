"""The history database's writes, in order, on a thread of their own: a commit (in WAL mode an
fsync now and then, slow on a phone's storage) never stalls the event loop mid-reply."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from kimitui.history import HistoryStore


class HistoryWriter:
    def __init__(self, store: HistoryStore, on_error: Callable[[BaseException], None]) -> None:
        self.store = store
        self._on_error = on_error
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="kimitui-history")

    async def call(self, fn: Callable, *args, **kwargs):
        """Run ``fn`` (a store method) after every write queued before it; its result."""
        return await asyncio.wrap_future(self._thread.submit(fn, *args, **kwargs))

    def post(self, fn: Callable, *args, **kwargs) -> None:
        """Queue ``fn`` and go on; a failure reaches ``on_error``."""
        self._thread.submit(fn, *args, **kwargs).add_done_callback(self._check)

    def _check(self, future: Future) -> None:
        error = future.exception()
        if error is not None:
            self._on_error(error)

    def close(self) -> None:
        """Every queued write done."""
        self._thread.shutdown(wait=True)
