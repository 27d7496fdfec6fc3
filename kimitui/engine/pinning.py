"""The pinned set: the bytes kept resident across tokens, read with our own parallel reads.

After a fast-start load nothing of the model is resident. The engine chooses what to pin
within the budget (the trunk every token needs first, then layers in order), reads it
with a pool of threads doing positional reads of a few MiB each (many requests in flight is
what an SSD needs to reach its bandwidth; page faults give it one at a time), and locks those
pages of the model's mapping so memory pressure cannot evict them. On Linux the reads go, with
O_DIRECT, into anonymous memory moved over the pinned ranges of the mapping: the pinned set then
neither depends on the file staying whole (a cut file would SIGBUS compute in file-backed pages)
nor sits in the page cache. Where locking is not allowed (RLIMIT_MEMLOCK, iOS) the pages stay
unlocked, and the engine says so.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kimitui.engine.placers import make_placer
from kimitui.engine.platform import LIBC_NAME, MADV_DONTNEED, PlatformIO
from kimitui.model.gguf_map import ByteRange, ModelMap, Shard, merge_ranges

CHUNK_BYTES = 4 * 2**20
# Pinned chunks moved into place become a kernel mapping each: larger ones, fewer mappings.
PLACED_CHUNK_BYTES = 32 * 2**20
READ_THREADS = 4


@dataclass(frozen=True)
class PinProgress:
    done_bytes: int
    total_bytes: int
    elapsed_s: float

    @property
    def rate(self) -> float | None:
        return self.done_bytes / self.elapsed_s if self.elapsed_s > 0 and self.done_bytes else None

    @property
    def eta_s(self) -> float | None:
        rate = self.rate
        return (self.total_bytes - self.done_bytes) / rate if rate else None

    @property
    def finished(self) -> bool:
        return self.done_bytes >= self.total_bytes

    def describe(self) -> str:
        """One line for a status bar or a terminal: bytes, MB/s, ETA."""
        from kimitui.units import format_bytes, format_rate

        eta = "—" if self.eta_s is None else f"{self.eta_s:.1f}s"
        return f"pinning {format_bytes(self.done_bytes)}/{format_bytes(self.total_bytes)} · {format_rate(self.rate)} · ETA {eta}"


def plan_pinned(model: ModelMap, pin_bytes: int) -> list[Shard]:
    """Whole shards to pin, most useful first: what every token reads (non-layer tensors,
    then each layer's trunk in layer order), then routed experts; as many as fit."""

    def priority(shard: Shard):
        return (shard.routed, -1 if shard.layer is None else shard.layer, shard.file, shard.offset)

    chosen: list[Shard] = []
    left = pin_bytes
    for shard in sorted(model.shards, key=priority):
        if shard.length > left:
            break  # keep the pinned set a prefix of the priority order: no holes to reason about
        chosen.append(shard)
        left -= shard.length
    return chosen


def shard_ranges(model: ModelMap, shards: Sequence[Shard]) -> list[ByteRange]:
    return merge_ranges([s.range for s in shards], gap=model.alignment)


def fit_store(pinned: list[Shard], hot: list, room: int, page: int) -> tuple[list[Shard], list, int]:
    """The planned pinned set (shards in priority order, then hot expert units) cut to what
    the bounded layout's store holds in ``room`` bytes; the rest streams. Returns the shards
    and units kept and the planned bytes left out."""
    kept_shards, kept_hot, used = [], [], 0
    for shard in pinned:
        need = -(-shard.length // page) * page + 2 * page  # whole pages, a run boundary inside
        if used + need > room:
            break
        kept_shards.append(shard)
        used += need
    for unit in hot:
        need = sum(-(-r.length // page) * page + 2 * page for r in unit.ranges)
        if used + need > room:
            break
        kept_hot.append(unit)
        used += need
    cut = sum(s.length for s in pinned[len(kept_shards):]) + sum(u.footprint for u in hot[len(kept_hot):])
    return kept_shards, kept_hot, cut


def whole_pages(ranges: Sequence[ByteRange], page: int) -> list[ByteRange]:
    """``ranges`` rounded out to whole pages and merged where they then touch."""
    rounded = [ByteRange(r.file, r.offset // page * page, -(-r.end // page) * page - r.offset // page * page) for r in ranges]
    return merge_ranges(rounded)


def _chunks(ranges: Sequence[ByteRange], size: int) -> list[ByteRange]:
    out = []
    for r in ranges:
        for start in range(r.offset, r.end, size):
            out.append(ByteRange(r.file, start, min(size, r.end - start)))
    return out


class ParallelReader:
    """Reads byte ranges with positional reads from a thread pool; errors surface as OSError."""

    def __init__(self, threads: int = READ_THREADS, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.threads = threads
        self.chunk_bytes = chunk_bytes
        self._local = threading.local()

    def _buffer(self) -> memoryview:
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = memoryview(bytearray(self.chunk_bytes))
        return buf

    def read(
        self,
        files: Sequence[str | os.PathLike],
        ranges: Sequence[ByteRange],
        on_progress: Callable[[PinProgress], None] | None = None,
        cancel: threading.Event | None = None,
        placer=None,
    ) -> PinProgress:
        """``placer`` (a DirectPlacer): each chunk is read into anonymous memory and moved over
        its place in the model's mapping (``copy_in``) instead of into the page cache; ranges must
        then be whole pages. A chunk it cannot place is read through the page cache."""
        chunks = _chunks(ranges, self.chunk_bytes)
        total = sum(c.length for c in chunks)
        fds = {index: os.open(files[index], os.O_RDONLY) for index in {c.file for c in chunks}}
        lock = threading.Lock()
        done = [0]
        started = time.perf_counter()

        def read_chunk(chunk: ByteRange) -> None:
            if cancel is not None and cancel.is_set():
                return
            fd = fds[chunk.file]
            size = os.fstat(fd).st_size
            if chunk.offset >= size:
                raise OSError(f"short read at byte {chunk.offset} of {files[chunk.file]}: the file is shorter than its header says")
            want = min(chunk.length, size - chunk.offset)  # a last whole page may pass the end of the file
            got = placer.copy_in(chunk.file, chunk.offset, chunk.length) if placer is not None else None
            if got is not None:
                got = min(got, want)
            else:
                view = self._buffer()[:want]
                got = os.preadv(fd, [view], chunk.offset) if hasattr(os, "preadv") else len(os.pread(fd, want, chunk.offset))
            if got != want:
                raise OSError(f"short read at byte {chunk.offset} of {files[chunk.file]}: the file is shorter than its header says")
            with lock:
                done[0] += chunk.length  # a last page past the end of the file counts whole, as in total
                progress = PinProgress(done[0], total, time.perf_counter() - started)
            if on_progress is not None:
                on_progress(progress)

        try:
            with ThreadPoolExecutor(self.threads, thread_name_prefix="kimitui-read") as pool:
                futures = []
                for chunk in chunks:
                    # A cancelled read (the process is shutting down) submits nothing more:
                    # an executor refuses new work once the interpreter is exiting.
                    if cancel is not None and cancel.is_set():
                        break
                    futures.append(pool.submit(read_chunk, chunk))
                for future in futures:
                    future.result()
        finally:
            for fd in fds.values():
                os.close(fd)
        return PinProgress(done[0], total, time.perf_counter() - started)


def _libc() -> ctypes.CDLL:
    lib = ctypes.CDLL(LIBC_NAME, use_errno=True)
    lib.mlock.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    lib.munlock.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    lib.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return lib


def lock_ranges(addresses: dict[int, int], ranges: Sequence[ByteRange]) -> str | None:
    """mlock pinned ranges; ``addresses`` maps each file index to its mapping. None, or why not."""
    page = os.sysconf("SC_PAGE_SIZE")
    libc = _libc()
    for r in ranges:
        address = addresses[r.file]
        start = (address + r.offset) & ~(page - 1)
        end = address + r.end
        if libc.mlock(start, end - start) != 0:
            err = ctypes.get_errno()
            return f"cannot lock the pinned set in memory ({os.strerror(err)}); it stays in the page cache unlocked"
    return None


def unlock_ranges(addresses: dict[int, int], ranges: Sequence[ByteRange]) -> None:
    page = os.sysconf("SC_PAGE_SIZE")
    libc = _libc()
    for r in ranges:
        address = addresses[r.file]
        start = (address + r.offset) & ~(page - 1)
        libc.munlock(start, address + r.end - start)


def drop_outside(
    addresses: dict[int, int], lengths: dict[int, int], paths: dict[int, str], ranges: Sequence[ByteRange]
) -> str | None:
    """Unmap from this process every page of the model's mappings outside the pinned ranges.

    Locking faults the pinned pages in, and each fault also maps the page cache's neighbours of
    the faulted page (fault-around, 64 KiB): with the model file cached (written just now, or
    read by an earlier run) that mapped the neighbours of every small pinned expert too, counted
    nowhere. Called before anything is streamed, when every page of the model's mappings outside
    the pinned set is file-backed, so the drop only unmaps: the data stays in the file and the
    page cache. Only areas that map the model's own files are touched (/proc/self/maps): llama.cpp
    unmaps the unused head and tail of a mapping after the load, and the allocator may have
    taken that room since. Linux only (Darwin's MADV_DONTNEED does not unmap). None, or what the
    kernel refused (those pages stay mapped, and count against the budget)."""
    if not sys.platform.startswith("linux"):
        return None
    page = os.sysconf("SC_PAGE_SIZE")
    libc = _libc()
    areas = _file_areas({os.path.realpath(p) for p in paths.values()})
    refused, why = 0, ""
    by_file: dict[int, list[ByteRange]] = {}
    for r in merge_ranges(ranges):
        by_file.setdefault(r.file, []).append(r)
    for file, address in addresses.items():
        real = os.path.realpath(paths[file])
        # The gaps come in address order, and so (sorted) do the areas: one sweep over both,
        # not every area for every gap (locking splits the mapping into thousands of areas).
        mine = sorted((lo, hi) for lo, hi, path in areas if path == real)
        first = 0
        cursor = 0
        for r in by_file.get(file, []) + [ByteRange(file, lengths[file], 0)]:
            start = address + -(-cursor // page) * page  # whole pages between the pinned ranges only:
            end = address + r.offset // page * page  # the pinned ones at either end stay locked
            while first < len(mine) and mine[first][1] <= start:
                first += 1
            at = first
            while at < len(mine) and mine[at][0] < end:
                lo, hi = max(mine[at][0], start), min(mine[at][1], end)
                if hi > lo and libc.madvise(lo, hi - lo, MADV_DONTNEED) != 0:
                    refused += hi - lo
                    why = os.strerror(ctypes.get_errno())
                at += 1
            cursor = max(cursor, r.end)
    if refused:
        return f"the kernel kept {refused} bytes of the model mapped outside the pinned set ({why})"
    return None


def _file_areas(paths: set[str]) -> list[tuple[int, int, str]]:
    """(start, end, path) of this process's mappings of ``paths``."""
    out = []
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] in paths:
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            out.append((lo, hi, fields[5]))
    return out


class PinnedSet:
    """The bytes every token needs, held for good: read once with parallel reads into anonymous
    memory at their place in the model's mapping, as streamed shards are (a file cut short, a
    USB cable bumped, then cannot SIGBUS compute there, and the set stays whole when the file
    comes back), and locked. Where that cannot be done (a Linux before 5.7, a file that cannot
    be opened again) the set is the page cache's pages, locked."""

    def __init__(self) -> None:
        self.ranges: list[ByteRange] = []  # as read: whole pages
        self.bytes = 0  # the pinned tensors' bytes
        self.read_bytes = 0  # model bytes every read of a pinned set has read (re-pins add)
        self.hot_expert_bytes = 0  # experts earlier runs' heatmap marked hot, pinned with the trunk
        self.note: str | None = None  # why the set is not locked, or pages stay mapped, when so
        self._placer = None  # holds the set's anonymous pages
        self._windows = None  # the bounded layout the set's store was handed to, if so

    def read(self, files, mappings: dict, ranges: list[ByteRange], hot: list, on_progress, cancel: threading.Event,
             drop_the_rest: bool) -> None:
        """Read and lock ``ranges`` (of which ``hot``'s experts are a part) in ``mappings``
        (file index -> loadhooks.Mapping). ``drop_the_rest``: unmap every other page of the
        model, which a streamed model reads itself. OSError if a file cannot be read."""
        addresses = {i: m.address for i, m in mappings.items()}
        mapping_fds = {i: m.fd for i, m in mappings.items() if m.fd >= 0}
        from kimitui.engine.addressing import WholeFiles

        placer = make_placer(files, WholeFiles(addresses, {i: m.length for i, m in mappings.items()}), mapping_fds, 1)
        pages = whole_pages(ranges, os.sysconf("SC_PAGE_SIZE"))
        try:
            reader = ParallelReader(chunk_bytes=PLACED_CHUNK_BYTES) if placer is not None else ParallelReader()
            reader.read(files, pages, on_progress, cancel=cancel, placer=placer)
        except OSError:
            if placer is not None:
                placer.close()
            raise
        if placer is not None:
            placer.done_reading()
        self.read_bytes += sum(r.length for r in pages)
        self._placer = placer
        if cancel.is_set():
            return
        self.note = lock_ranges(addresses, pages)
        if drop_the_rest:
            lengths = {i: m.length for i, m in mappings.items()}
            kept = drop_outside(addresses, lengths, {i: str(path) for i, path in enumerate(files)}, ranges)
            self.note = "; ".join(note for note in (self.note, kept) if note) or None
        self.ranges = pages
        self.bytes = sum(r.length for r in ranges)
        self.hot_expert_bytes = sum(unit.footprint for unit in hot)

    def read_store(self, files, windows, ranges: list[ByteRange], hot: list, on_progress, cancel: threading.Event) -> None:
        """The bounded layout's pinned set (addressing.py): ``ranges`` read in whole pages into
        a store of their own, locked, and handed to ``windows``, which maps each layer's part
        into its slot whenever the layer takes one. OSError if a file cannot be read."""
        from kimitui.engine.addressing import PinnedStore

        windows.set_store(None)  # the old set's room first: the new one takes the same
        store = PinnedStore(windows.within_runs(ranges), os.sysconf("SC_PAGE_SIZE"), windows.calls, windows.store_home, windows.plan.store_bytes)
        try:
            self._fill(files, store, on_progress, cancel)
        except OSError:
            store.close()
            raise
        self.read_bytes += store.size
        if cancel.is_set():
            store.close()
            return
        self.note = store.lock()
        windows.set_store(store)
        self._windows = windows
        self.ranges = [pages for _, pages, _ in store.pieces]
        self.bytes = sum(r.length for r in ranges)
        self.hot_expert_bytes = sum(unit.footprint for unit in hot)

    @staticmethod
    def _fill(files, store, on_progress, cancel: threading.Event) -> None:
        chunks = [
            (pages.file, pages.offset + done, min(CHUNK_BYTES, pages.length - done), at + done)
            for _, pages, at in store.pieces
            for done in range(0, pages.length, CHUNK_BYTES)
        ]
        total = sum(c[2] for c in chunks)
        fds = {index: os.open(files[index], os.O_RDONLY) for index in {c[0] for c in chunks}}
        lock, done, started = threading.Lock(), [0], time.perf_counter()

        def read_chunk(chunk) -> None:
            file, offset, length, at = chunk
            if cancel.is_set():
                return
            fd = fds[file]
            want = min(length, os.fstat(fd).st_size - offset)  # a last whole page may pass the end of the file
            view = memoryview((ctypes.c_char * length).from_address(store.address + at)).cast("B")
            if want <= 0 or os.preadv(fd, [view[:want]], offset) != want:
                raise OSError(f"short read at byte {offset} of {files[file]}: the file is shorter than its header says")
            PlatformIO().uncache(fd, offset, want)  # the store holds the bytes now, not the page cache
            with lock:
                done[0] += length
                progress = PinProgress(done[0], total, time.perf_counter() - started)
            if on_progress is not None:
                on_progress(progress)

        try:
            with ThreadPoolExecutor(READ_THREADS, thread_name_prefix="kimitui-read") as pool:
                for future in [pool.submit(read_chunk, chunk) for chunk in chunks]:
                    future.result()
        finally:
            for fd in fds.values():
                os.close(fd)

    def release(self, mappings: dict) -> None:
        """Unlock the set and give its anonymous pages back to the file (the mapping reads the
        file there again); the bounded layout's store is closed."""
        windows, self._windows = self._windows, None
        if windows is not None:
            windows.set_store(None)
        elif mappings and self.ranges:
            unlock_ranges({i: m.address for i, m in mappings.items()}, self.ranges)
        self.ranges, self.bytes = [], 0
        if self._placer is not None:
            self._placer.close()
            self._placer = None
