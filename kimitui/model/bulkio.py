"""Bulk reads at disk speed for `shard` and `verify`: read-ahead on a thread, a progress line.

Checksumming and writing cost CPU; reading costs waiting. A background thread reads the next
chunks into a small pool of buffers while the caller hashes and writes the current one, so the
two overlap (the kernel and hashlib both release the GIL). Memory stays at DEPTH chunks.
"""

from __future__ import annotations

import errno
import os
import queue
import sys
import threading
import time
from typing import Iterable, Iterator

from kimitui.units import format_bytes, format_rate

CHUNK_BYTES = 8 * 1024**2
DEPTH = 4


def read_ahead(
    jobs: Iterable[tuple[int, int, int]], *, chunk: int = CHUNK_BYTES, depth: int = DEPTH
) -> Iterator[memoryview]:
    """The bytes of each (fd, offset, length) job in order, as views of at most `chunk` bytes
    that never span two jobs. A view is valid until the next one is asked for. Raises OSError
    if a file ends before a job does."""
    free: queue.Queue[bytearray] = queue.Queue()
    for _ in range(depth):
        free.put(bytearray(chunk))
    full: queue.Queue = queue.Queue()
    stop = threading.Event()

    def reader() -> None:
        try:
            for fd, offset, length in jobs:
                end = offset + length
                while offset < end:
                    buf = free.get()
                    if stop.is_set():
                        return
                    view = memoryview(buf)[: min(chunk, end - offset)]
                    got = 0
                    while got < len(view):  # a regular file may still return short reads
                        n = os.preadv(fd, [view[got:]], offset + got)
                        if n == 0:
                            raise OSError(f"the file ends at byte {offset + got}, expected {end} bytes")
                        got += n
                    full.put((buf, got))
                    offset += got
            full.put(None)
        except BaseException as exc:  # handed to the consumer, which raises it
            full.put(exc)

    thread = threading.Thread(target=reader, name="kimitui-read-ahead", daemon=True)
    thread.start()
    try:
        while True:
            item = full.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            buf, n = item
            yield memoryview(buf)[:n]
            free.put(buf)
    finally:
        stop.set()
        free.put(bytearray(0))  # wakes a reader waiting for a buffer so it sees `stop`
        thread.join()


def is_hole(fd: int, offset: int, length: int) -> bool:
    """Whether `length` bytes at `offset` are all a hole of a sparse file: zeros with no data
    to read. False where the filesystem cannot tell (no SEEK_DATA)."""
    seek_data = getattr(os, "SEEK_DATA", None)
    if seek_data is None:
        return False
    try:
        return os.lseek(fd, offset, seek_data) >= offset + length
    except OSError as exc:
        return exc.errno == errno.ENXIO  # ENXIO: no data after `offset` at all


class Progress:
    """One self-rewriting line on stderr when it is a terminal, at most twice a second."""

    def __init__(self, label: str, total: int, stream=None) -> None:
        self.label, self.total, self.done = label, total, 0
        self.stream = stream if stream is not None else sys.stderr
        self.live = self.stream.isatty()
        self.start = self.last = time.monotonic()
        self._lock = threading.Lock()  # verify adds from several threads

    def add(self, n: int) -> None:
        with self._lock:
            self.done += n
            now = time.monotonic()
            if not self.live or now - self.last < 0.5:
                return
            self.last = now
            rate = self.done / max(now - self.start, 1e-9)
            eta = (self.total - self.done) / rate if rate else 0.0
            share = self.done / self.total if self.total else 1.0
            self.stream.write(
                f"\r{self.label}: {format_bytes(self.done)} of {format_bytes(self.total)} "
                f"({share:.0%}), {format_rate(rate)}, {eta:.0f} s left  "
            )
            self.stream.flush()

    @property
    def seconds(self) -> float:
        return time.monotonic() - self.start

    def close(self) -> None:
        if self.live:
            self.stream.write("\r" + " " * 79 + "\r")
            self.stream.flush()
