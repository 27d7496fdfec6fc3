"""The streaming engine: read each layer's unpinned shards before compute reaches them.

llama.cpp's eval callback tells us when a layer starts (the previous layer's ``l_out`` node, or
``embd`` for layer 0). At that moment:

1. the layer that just ran gives back its streamed shards (pin-and-stream drops them at once;
   LRU keeps them until the stream window is full), so the kernel never has to evict anything
   and the pinned set is never under pressure;
2. the starting layer must be resident: a shard already read (or pinned) is a hit; one still
   in flight, or not yet asked for, is a miss, and compute waits for our reads (stall time)
   instead of faulting the weights in a page at a time;
3. the shards of the next ``prefetch_depth`` layers (cyclically: after the last layer comes
   the next token's first) go to the I/O pool: parallel positional reads of a few MiB.

A read that fails (file truncated, drive unplugged) stops the token through llama.cpp's abort
callback, so the reply ends with an error instead of SIGBUS. ggml sees the abort only after the
node it is computing, so until the token is over every file-backed page of the model's mapping
reads as zeros (``_shield``); the next token gets the file back and reads again what it needs.
The unit of residency is a shard; the MoE work adds (layer, expert) units beside it.
"""

from __future__ import annotations

import enum
import itertools
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Callable

from kimitui.engine.addressing import is_floating
from kimitui.engine.budget import PIECE_BYTES, pool_buffers
from kimitui.engine.direct import read_gaps, split_pieces
from kimitui.engine.experts import ExpertCache, ExpertUnit, RouterPredictor, StagingError
from kimitui.engine.placers import make_placer
from kimitui.engine.platform import HUGE_ALIGN, PlatformIO
from kimitui.engine.settings import StreamSettings, check_changes
from kimitui.engine.trimming import SOFTMAX_WEIGHTED_ARCHS, RouteTrimmer
from kimitui.model.gguf_map import ROUTED_EXPERTS, ByteRange, ModelMap, Shard

CHUNK_BYTES = 4 * 2**20
COPY_IN = "copy in"  # a piece read into memory of its own and moved into place in one step
SLICE = "slice"  # an expert slice: its own pages read into place, its shared end pages copied in
PAGE_IN = "page in"  # an expert slice paged into the file mapping through the page cache
ARENA = "arena"  # a piece of a layer read whole, into the arena (DirectPlacer.place_in_arena)
MERGED_READ_BYTES = 8 * 2**20  # the most one request of neighbouring expert slices reads
MERGED_READ_PIECES = 512  # and the most buffers it fills (preadv takes at most IOV_MAX, 1024)


def arena_segments(model: ModelMap, hot: list[ExpertUnit], page: int) -> dict[int, list[tuple[int, int]]]:
    """The whole pages only streamed expert slices use, as (lo, hi) file offsets per file: each
    run of routed tensors less its pages shared with other tensors, and less the
    pinned hot experts' pages. Empty where a slice is a huge page or more: each slice mapped on
    its own then gets huge pages, and its mapping calls are few against its bytes."""
    routed = [t for t in model.tensors if t.role == ROUTED_EXPERTS]
    if not routed or max(t.n_bytes // max(t.n_expert, 1) for t in routed) >= HUGE_ALIGN:
        return {}
    runs: list[list[int]] = []  # [file, start, end]: routed tensors with no other tensor between
    follows = False
    for t in sorted(model.tensors, key=lambda t: (t.file, t.offset)):
        if t.role != ROUTED_EXPERTS:
            follows = False
        elif follows and runs[-1][0] == t.file:
            runs[-1][2] = t.offset + t.n_bytes
        else:
            runs.append([t.file, t.offset, t.offset + t.n_bytes])
            follows = True
    held: dict[int, list[tuple[int, int]]] = {}
    for unit in hot:
        held.setdefault(unit.file, []).extend(_pages_of(unit, page))
    out: dict[int, list[tuple[int, int]]] = {}
    for file, start, end in runs:
        spans = _less(-(-start // page) * page, end // page * page, held.get(file, []))
        if spans:
            out.setdefault(file, []).extend(spans)
    return out


def _pages_of(unit: ExpertUnit, page: int) -> list[tuple[int, int]]:
    """The pages an expert's slices touch, (lo, hi) file offsets each."""
    return [(r.offset // page * page, -(-r.end // page) * page) for r in unit.ranges]


def _less(start: int, end: int, held: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """[start, end) less the ``held`` spans, as (lo, hi) stretches in order."""
    out, at = [], start
    for lo, hi in sorted(held):
        if hi <= at or lo >= end:
            continue
        if lo > at:
            out.append((at, lo))
        at = max(at, hi)
    if end > at:
        out.append((at, end))
    return out


class Residency(enum.Enum):
    COLD = "cold"
    INFLIGHT = "in flight"
    RESIDENT = "resident"
    PINNED = "pinned"


class _WholeRead:
    """An expert's slices (gate, up, down: three reads) reported to the trace as one read, when
    the last lands: hundreds fewer records per token on a Kimi-shaped model."""

    __slots__ = ("offset", "length", "left", "start", "end", "_lock")

    def __init__(self, offset: int, length: int, pieces: int) -> None:
        self.offset, self.length, self.left = offset, length, pieces
        self.start, self.end = float("inf"), 0.0
        self._lock = threading.Lock()

    def landed(self, started: float, ended: float) -> bool:
        """One slice is in; True for the last one."""
        with self._lock:
            self.left -= 1
            self.start, self.end = min(self.start, started), max(self.end, ended)
            return self.left == 0


@dataclass(frozen=True)
class _LayerRead:
    """A layer's routed tensors read whole (for read errors and the trace)."""

    layer: int
    file: int
    index = None  # not a shard


class StreamAbort(Exception):
    """A model read failed; the message is what the user sees. ``guess``: the read was a guess
    (on the look-ahead's lane), whose failure is nobody's error: a decoded layer that waited for
    it, for its own expert or a neighbour sharing an end page it was bringing, reads that again."""

    def __init__(self, message: str, guess: bool = False) -> None:
        super().__init__(message)
        self.guess = guess


class Dropper:
    """Releases streamed ranges on a thread of its own.

    Evicting experts costs a madvise and an fadvise per slice, hundreds of slices per token:
    on the compute thread that was a third of a token's time. A range read again before its
    turn comes is kept (``keep``); the lock is held across each release, so a read submitted
    after ``keep`` returns can never be thrown away by a release still under way.

    A read that an eviction made room for waits for that release (``mark``, then
    ``wait_released``): otherwise reads outrun the releases behind them and the model's pages
    pass the budget while the queue drains (115% of it was seen on a K3 slice).
    """

    def __init__(self, release: Callable[[object], None], on_error: Callable[[str], None]) -> None:
        self._release = release
        self._on_error = on_error
        self._lock = threading.Lock()
        self._released = threading.Condition(self._lock)
        self._pending: dict[object, tuple] = {}  # key -> (ranges, release, sequence number), oldest first
        self._seq = 0
        self._wake = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._closing = False
        self._open = threading.Event()  # cleared while paused
        self._open.set()
        self._thread = threading.Thread(target=self._run, name="kimitui-drop", daemon=True)
        self._thread.start()

    def later(self, key, ranges, release: Callable[[object], None] | None = None) -> None:
        """Release ``ranges`` soon, with ``release`` (default: the dropper's own). A key still
        waiting keeps its ranges too: each release gives back the end pages its read held (an
        expert read again and evicted again before its first release ran holds them twice)."""
        with self._lock:
            self._seq += 1
            waiting = self._pending.pop(key, None)  # to the back of the queue, in sequence order
            self._pending[key] = ((waiting[0] if waiting else ()) + tuple(ranges), release or self._release, self._seq)
            self._idle.clear()
        self._wake.set()

    def keep(self, key) -> bool:
        """Cancel ``key``'s release if it has not run; True when it had not."""
        with self._lock:
            kept = self._pending.pop(key, None) is not None
            self._released.notify_all()
            return kept

    def queued(self, key) -> bool:
        """Whether ``key``'s release is still waiting (one under way holds the lock: waited for)."""
        with self._lock:
            return key in self._pending

    def mark(self) -> int:
        """The releases queued so far. Read without the lock, which a release holds while it runs
        (a batch of an eviction's experts): the caller's own ``later`` calls came before it."""
        return self._seq

    def wait_released(self, mark: int) -> bool:
        """Wait until every release queued up to ``mark`` is done (or cancelled); False if the
        dropper is paused first (a failure's shield holds the releases back until the token is
        over, and a read must not wait for it: compute may be waiting for that read)."""
        def released() -> bool:
            return not self._pending or next(iter(self._pending.values()))[2] > mark

        with self._released:
            self._released.wait_for(lambda: not self._open.is_set() or released())
            return self._open.is_set() or released()

    def settle(self, mark: int) -> bool:
        """Wait until every release queued up to ``mark`` is done; False if the dropper is
        paused first (a release failed: the rest wait for the end of the token)."""
        with self._released:
            while self._pending and next(iter(self._pending.values()))[2] <= mark:
                if not self._open.is_set():
                    return False
                self._released.wait(0.05)
        return True

    def pause(self) -> None:
        """Hold every release back (a release maps the file back in) until ``resume``; returns
        once none is under way."""
        self._open.clear()
        if threading.current_thread() is not self._thread:
            with self._lock:  # a release runs under the lock, and none starts while paused
                self._released.notify_all()  # reads waiting for a release stop waiting
        else:  # the dropper's own failure: it holds the lock
            self._released.notify_all()

    def resume(self) -> None:
        self._open.set()

    def flush(self) -> None:
        """Wait until every queued release is done, or the dropper is paused (a release failed:
        the shield holds the rest back until the token is over)."""
        self._wake.set()
        while not self._idle.wait(0.05):
            if not self._open.is_set():
                return

    def close(self) -> None:
        self._closing = True
        self.resume()
        self.flush()
        self._wake.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            while True:
                self._open.wait()
                with self._lock:
                    if not self._open.is_set():
                        continue  # paused after the wait above: wait again
                    if not self._pending:
                        self._idle.set()
                        break
                    key = next(iter(self._pending))
                    ranges, release, _ = self._pending.pop(key)
                    for r in ranges:
                        try:
                            release(r)
                        except Exception as exc:  # noqa: BLE001 - the thread lives on: reads wait for it
                            self._on_error(f"cannot give streamed bytes back to the model file: {exc}")
                    self._released.notify_all()
            if self._closing:
                return


def _io_pools(threads: int) -> tuple[ThreadPoolExecutor, ThreadPoolExecutor]:
    """The read pool, and the look-ahead's lane beside it: a guess never queues ahead of a read
    that compute is waiting for."""
    return (
        ThreadPoolExecutor(threads, thread_name_prefix="kimitui-stream"),
        ThreadPoolExecutor(max(1, threads // 2), thread_name_prefix="kimitui-guess"),
    )


class Streamer:
    def __init__(
        self,
        model: ModelMap,
        space,
        pinned: set[int],
        settings: StreamSettings,
        platform_io: PlatformIO | None = None,
        mapping_fds: dict[int, int] | None = None,
        window_limit: int | None = None,
        pool_limit: int | None = None,
    ) -> None:
        """``space``: where each byte of the model is (addressing.py); ``mapping_fds``:
        descriptors of the open files llama.cpp mapped (loadhooks keeps them), through which
        direct reads give ranges back to the file; our own otherwise.
        ``window_limit``: the most trunk bytes in flight the budget allows, whatever the
        prefetch depth is tuned to later; ``pool_limit``: the direct-read buffers the budget
        holds room for."""
        self.window_limit = window_limit
        self.pool_limit = pool_limit
        self.model = model
        self.space = space
        self.settings = settings
        self.io = platform_io or PlatformIO()
        self.fds = {i: os.open(path, os.O_RDONLY) for i, path in enumerate(model.files)}
        for fd in self.fds.values():
            self.io.exact_reads(fd)
        self.file_sizes = list(model.file_sizes)
        self.state = [Residency.PINNED if s.index in pinned else Residency.COLD for s in model.shards]
        self.layer_shards = [[s for s in model.layer_shards(layer) if s.index not in pinned] for layer in range(model.n_layers)]
        self._layer_most = self._most_layer_bytes()
        # What each file must hold for a layer (None: the output tensors), checked at its start.
        self._file_ends: dict[int | None, dict[int, int]] = {}
        for shard in model.shards:
            ends = self._file_ends.setdefault(shard.layer, {})
            ends[shard.file] = max(ends.get(shard.file, 0), shard.offset + shard.length)
        # Layer -> its FLOATING tensors in streamed shards, (shard, file, offset, length, name): the
        # graph reads them inside the layer before (K3's res_mix), so they are read when that
        # layer starts. The bounded layout gives them a fixed place instead.
        self._floating: dict[int, list[tuple[int, int, int, int, str]]] = {}
        if not space.bounded:
            for shard in model.shards:
                for i in shard.tensors if shard.index not in pinned else ():
                    t = model.tensors[i]
                    if is_floating(t):
                        self._floating.setdefault(t.layer, []).append((shard.index, t.file, t.offset, t.n_bytes, t.name))
        self._futures: dict[int, list[Future]] = {}
        self._paged_in: set[int] = set()  # shards a prompt's layer pages in under compute (_submit)
        self._prefetched: set[int] = set()  # read ahead, not yet reached by compute
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._resident_bytes = 0
        self._lock = threading.Lock()
        self._pool, self._guess_pool = _io_pools(settings.io_threads)
        self._retired_pools: list[ThreadPoolExecutor] = []  # replaced by a live I/O-threads change
        self.predictor: RouterPredictor | None = None
        self._edge_refs: dict[tuple[int, int], int] = {}  # (file, page) -> slices holding a shared end page
        # (file, page) -> the read bringing a shared end page, where it reads as zeros until then
        # (the placer's arena): a slice that finds the page held waits for it too.
        self._edge_reads: dict[tuple[int, int], Future] = {}
        self._blanked: list[tuple] = []  # (file, offset, length[, address]) shielded as zeros, see _shield
        self._failing = threading.Condition()  # guards error, _shielding and _resetting
        self._shielding = 0  # failures raising the shield now (see fail)
        self._resetting = False  # reset_error or close under way: the failed token's reads are settling
        # Shard pages are read past the page cache into anonymous memory at their place in the
        # mapping (O_DIRECT on Linux, direct.py; F_NOCACHE on Darwin, darwin_placer.py); None
        # where that cannot be done (Linux before 5.7), and compute uses the file's own pages.
        # A prompt's MoE layers read whole (see _read_layers_whole): layer -> its reads, the
        # layers that may be, and the cache's bytes lent for them (with the pool pieces they make).
        self._layer_reads: dict[int, list[Future]] = {}
        self._whole_ranges: dict[int, list[ByteRange]] = {}  # layer -> what of it is read whole
        self._lent = self._lent_pieces = self._whole_pieces = self._whole_bytes = 0
        self._window_lent = 0  # the streamed trunk's room, lent to a staged layer (_lend_idle_window)
        self.placer = make_placer(model.files, space, self.fds | (mapping_fds or {}), 0, self.io.platform)
        if self.placer is not None:
            self._size_pool()
            self._hold_pinned_edges(pinned)
        self._dropper = Dropper(self._release, self.fail)
        self._batches = itertools.count()  # the keys of releases of many experts at once
        # Bounded layout: the next layer's slot is taken over here while a layer computes
        # (mapping a slot again is the kernel tearing the old layer's pages down: 11-15 ms).
        self._slot_lane = ThreadPoolExecutor(1, thread_name_prefix="kimitui-slot") if space.bounded else None
        self._claiming: dict[int, tuple[int, Future]] = {}  # slot -> (the layer taking it, its claim)
        self._local = threading.local()
        self.error: str | None = None
        self.current_layer: int | None = None
        self.chunk_tokens = 1  # the tokens the graph computing now evaluates (the engine's callback sets it)
        self._pending: StreamSettings | None = None
        # Counters (cumulative; the trace and panels read them).
        self.page_cache_fallback_bytes = 0  # shard pages meant for a direct read that went through the page cache
        self.paged_in_bytes = 0  # read while compute ran on them (a prompt's trunk, staged matrices)
        # The eval callback's calls and the time spent in them (counted by the engine's callback,
        # on the compute thread only): ggml asking about each node, and the nodes observed.
        self.eval_asks = self.eval_observed = 0
        self.eval_ask_s = self.eval_observe_s = 0.0
        self.hits = self.misses = 0
        self.stall_s = 0.0
        self.slot_wait_s = 0.0  # of the stall: compute waiting for a slot taken over on the slot lane
        self.bytes_read = 0
        self.bytes_needed = 0  # streamed bytes compute used that were not resident before (read for it)
        self.prefetch_issued = self.prefetch_used = self.prefetch_wasted = 0
        self.prefetch_wasted_bytes = 0
        self.bytes_from_cache = 0  # pinned or already-read bytes compute found resident
        self._pinned_by_layer = [
            sum(s.length for s in model.layer_shards(layer) if s.index in pinned) for layer in range(model.n_layers)
        ]
        # Called from I/O threads for every storage read: (shard, offset, bytes, start, seconds).
        self.on_read: Callable[[Shard | ExpertUnit, int, int, float, float], None] | None = None
        # Called on the compute thread for each router choice: (layer, experts, how many were resident).
        self.on_route: Callable[[int, list[int], int], None] | None = None
        self.experts: ExpertCache | None = None
        self.trimmer: RouteTrimmer | None = None  # set while expert trimming is on (trimming.py)
        self._trimmer_seen: RouteTrimmer | None = None  # the last one, whose counts the panels keep showing

    def _hold_pinned_edges(self, pinned: set[int]) -> None:
        """Pinned pages are locked in place (anonymous, see Engine.pin): the end pages a pinned
        shard shares are held for good, so a neighbour never reads over them."""
        self._take_edges([shard.range for shard in self.model.shards if shard.index in pinned])

    # -- sizes --------------------------------------------------------------------------

    @property
    def parked_bytes(self) -> int:
        """Cached experts' pages moved out of slots other layers hold (bounded layout): the
        model's memory, outside its windows."""
        return self.placer.parked_bytes if self.placer is not None else 0

    @property
    def spare_bytes(self) -> int:
        """Memory the placer has faulted in ahead of its reads (DirectPlacer.spare): the model's,
        outside its mapping."""
        spare = self.placer.spare if self.placer is not None else None
        return spare.held if spare is not None else 0

    @property
    def streamed_bytes_per_token(self) -> int:
        """Trunk bytes streamed per token (routed experts, when attached, come on demand)."""
        return sum(s.length for shards in self.layer_shards for s in shards)

    def _most_layer_bytes(self) -> int:
        """The largest layer's streamed trunk (``layer_shards`` changes only when experts attach)."""
        return max((sum(s.length for s in shards) for shards in self.layer_shards), default=0)

    def _window(self) -> int:
        per_layer = self._layer_most
        wanted = self.settings.window_bytes or per_layer * (self.settings.prefetch_depth + 1)
        # Never less than one layer: the layer computing must be resident.
        return wanted if self.window_limit is None else max(per_layer, min(wanted, self.window_limit))

    def _pool_pieces(self) -> int:
        """Direct-read buffers for a full window: each shard of the layers in flight may take one
        buffer more than its bytes say (the plan counts the same, budget.pool_buffers)."""
        most_shards = max((len(shards) for shards in self.layer_shards), default=0)
        return pool_buffers(self._window(), most_shards, self.settings.prefetch_depth + 1)

    def _size_pool(self) -> None:
        """The pool a full window needs, never more than the budget holds room for (near the
        minimum budget): a piece that finds such a pool spent is read through the page cache at
        once, into the window's own pages, which the budget counts."""
        if self._window_lent:  # the pool's room is the expert cache's now (_lend_idle_window)
            self.placer.short, self.placer.capacity = True, 0
            return
        wanted = self._pool_pieces()
        capped = self.pool_limit is not None and wanted > self.pool_limit
        self.placer.short = capped
        # What the expert cache lends for a prompt's layers read whole comes on top.
        self.placer.capacity = (self.pool_limit if capped else wanted) + self._lent_pieces

    # -- reads --------------------------------------------------------------------------

    def _buffer(self) -> memoryview:
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = memoryview(bytearray(CHUNK_BYTES))
        return buf

    def _read_chunk(
        self, unit, file: int, offset: int, length: int, whole: _WholeRead | None = None, placed=False,
        room: int | None = None, guess: bool = False,
    ) -> int:
        """Read one piece of a shard or an expert (``unit``, for messages and the trace);
        ``whole`` gathers an expert's slices into one read for the trace; ``placed``: whole
        pages that go to the mapping by direct read (None back: the pool is spent, or O_DIRECT
        was refused); ``room``: the dropper's mark to wait for before reading; ``guess``: read
        ahead on the look-ahead's lane (see ``StreamAbort``)."""
        if room is not None and not self._dropper.wait_released(room):
            raise StreamAbort(self.error or "streaming stopped: the releases this read waits for are held back")
        started = time.perf_counter()
        expert = isinstance(unit, ExpertUnit)
        try:
            size = os.fstat(self.fds[file]).st_size
            # A read rounded out to whole pages may pass the end of the file by less than a page
            # (tensors are padded to 32 bytes, not to pages): the bytes up to the end are all.
            expected = size - offset if placed and 0 < offset + length - size < self.io.page else length
            if offset + expected > size:
                got = max(0, size - offset)
            elif placed == ARENA:
                got = self.placer.place_in_arena(file, offset, length)
            elif placed == PAGE_IN:
                got = length if self.io.populate(self.fds[file], self._base(file, offset), offset, length) else self._pread(file, offset, length)
            elif placed and (
                got := self.placer.copy_in(file, offset, length)
                if placed == COPY_IN
                else self.placer.place_slice(file, offset, length, placed[1], placed[2])
                if expert
                else self.placer.place(file, offset, length)
            ) is not None:
                pass
            # Shards (MiB, in file order) are faulted straight into the mapping; an expert's slices
            # are read through our descriptor instead, because a fault on the mapping brings the
            # disk's whole read-ahead window (8 MiB here) with each small slice.
            elif not expert and self.io.populate(self.fds[file], self._base(file, offset), offset, length):
                got = length
                if placed:  # meant for a direct read, but the pool was spent
                    with self._lock:
                        self.page_cache_fallback_bytes += length
            else:
                got = self._pread(file, offset, length)
                if placed:
                    with self._lock:
                        self.page_cache_fallback_bytes += length
                if expert and placed:  # gaps read through are nobody's: out of the cache again
                    for gap_start, gap_length in read_gaps(offset, length, placed[1], placed[2], self.io.page):
                        self.io.uncache(self.fds[file], gap_start, gap_length)
        except OSError as exc:
            failure = (
                f"cannot read {self._what(unit)} of layer {unit.layer} from model file "
                f"{os.path.basename(self.model.files[file])} at byte {offset}: {exc.strerror or exc} (drive removed or failing?)"
            )
        else:
            failure = None if got >= expected else (
                f"model file {os.path.basename(self.model.files[file])} ended at byte {offset + got}; "
                f"{self._what(unit)} of layer {unit.layer} {'need' if isinstance(unit, _LayerRead) else 'needs'} bytes up to {offset + expected} "
                "(file truncated or drive removed?)"
            )
        if failure is not None:
            if placed == PAGE_IN:  # compute may be reaching for these pages now: shield them at once
                self.fail(failure)
            raise StreamAbort(failure, guess)
        with self._lock:
            self.bytes_read += expected
            if placed == PAGE_IN:
                self.paged_in_bytes += expected
        on_read = self.on_read
        if on_read is not None:
            ended = time.perf_counter()
            if whole is None:
                on_read(unit, offset, length, started, ended - started)
            elif whole.landed(started, ended):
                on_read(unit, whole.offset, whole.length, whole.start, whole.end - whole.start)
        return length

    def _pread(self, file: int, offset: int, length: int) -> int:
        """Through the page cache, in buffer-sized reads: the page cache keeps the bytes for the mapping."""
        buf, got = self._buffer(), 0
        while got < length:
            n = os.preadv(self.fds[file], [buf[: min(CHUNK_BYTES, length - got)]], offset + got)
            if n == 0:
                break
            got += n
        return got

    @staticmethod
    def _what(unit) -> str:
        if isinstance(unit, ExpertUnit):
            return f"expert {unit.expert}"
        return "the routed experts" if isinstance(unit, _LayerRead) else f"shard {unit.index}"

    def _read_ranges(
        self, unit, ranges, pool: ThreadPoolExecutor | None = None, hold: bool = True, page_in: bool = False,
    ) -> list[Future]:
        """``hold``: count the ranges' shared end pages as held (not when a cancelled release
        left them held already). ``page_in``: into the file mapping, in file order, for compute
        to meet as they land (end pages counted all the same: the release balances them)."""
        expert = isinstance(unit, ExpertUnit)
        if page_in:
            if hold:
                self._take_edges(ranges)
            pieces = [
                (r.file, start, min(CHUNK_BYTES, r.end - start), PAGE_IN)
                for r in ranges
                for start in range(r.offset, r.end, CHUNK_BYTES)
            ]
        elif self.placer is not None and expert:
            pieces = [piece for piece in self._expert_pieces(ranges) if piece is not None]
        elif self.placer is not None:
            page = self.placer.page
            pieces = []
            kind = ARENA if isinstance(unit, _LayerRead) else True
            for r in ranges:
                for start, length, whole_pages in split_pieces(r.offset, r.end, page):
                    if whole_pages:
                        pieces.append((r.file, start, length, kind))
                for edge in self._take_edges([r])[0] if hold else ():
                    pieces.append((r.file, edge, page, COPY_IN))
        else:
            pieces = [
                (r.file, start, min(CHUNK_BYTES, r.end - start), False)
                for r in ranges
                for start in range(r.offset, r.end, CHUNK_BYTES)
            ]
        whole = None
        if expert and len(pieces) > 1 and self.on_read is not None:
            whole = _WholeRead(pieces[0][1], sum(p[2] for p in pieces), len(pieces))
        room = self._dropper.mark()  # the releases that made room for these reads
        guess = pool is not None and pool is self._guess_pool
        futures = []
        for file, start, length, placed in pieces:
            future = (pool or self._pool).submit(self._read_chunk, unit, file, start, length, whole, placed, room, guess)
            futures.append(future)
            if expert and placed:
                self._reading_edges(file, placed[2], future)
        return self._handed([futures], [ranges])[0] if expert else futures

    def _read_experts(self, units: list[ExpertUnit]) -> list[list[Future]]:
        """A layer's missed experts, read into place: their slices' pieces in file order, and
        pieces that follow each other in the file (the same tensor's slices of neighbouring
        experts, as a prompt's many tokens route to) read as one request of up to
        MERGED_READ_BYTES. On a disk that serves scattered 30 KiB reads at a tenth of its
        sequential rate, that is most of a long prompt's expert reads; where the placer can,
        a short gap between two such pieces is read through too (``gap_bytes``). Each unit's
        futures are the reads that hold any of its pieces."""
        slices = [(r, index) for index, unit in enumerate(units) for r in unit.ranges]
        owned = sorted(
            ((piece, index) for piece, (_, index) in zip(self._expert_pieces([r for r, _ in slices]), slices) if piece is not None),
            key=lambda owned_piece: owned_piece[0][:2],
        )
        gap_most = self.placer.gap_bytes if self.placer is not None else 0
        runs: list[list] = []  # [file, start, length, inners, edges, owners, gaps read through]
        for (file, start, length, (_, inners, fresh)), index in owned:
            last = runs[-1] if runs else None
            gap = start - (last[1] + last[2]) if last is not None else -1
            if (
                last is not None and last[0] == file and 0 <= gap <= gap_most
                # in the bounded layout a gap may end one run of the layer's tensors: each run has its own place
                and (gap == 0 or self.space.at(file, start) - start == self.space.at(file, last[1]) - last[1])
                and last[2] + gap + length <= MERGED_READ_BYTES
                and len(last[3]) + len(last[4]) + len(last[6]) + 4 <= MERGED_READ_PIECES
            ):
                last[2] += gap + length
                if gap:
                    last[6].append(gap)
            else:
                last = [file, start, length, [], [], set(), []]
                runs.append(last)
            last[3].extend(inners)
            last[4].extend(fresh)
            last[5].add(index)
        room = self._dropper.mark()  # the releases that made room for these reads
        futures: list[list[Future]] = [[] for _ in units]
        # Bytes read past what compute needs: counted as read (bytes_read), and as the prompt's.
        if self.experts is not None and self.experts.prefilling:
            gap_bytes = sum(sum(run[6]) for run in runs)
            self.experts.prefill_read_bytes += gap_bytes
            self.experts.prefill_gap_bytes += gap_bytes
        for file, start, length, inners, edges, owners, _gaps in runs:
            unit = units[min(owners)]  # named in messages and the trace
            future = self._pool.submit(self._read_chunk, unit, file, start, length, None, (SLICE, inners, edges), room)
            self._reading_edges(file, edges, future)
            for index in owners:
                futures[index].append(future)
        return self._handed(futures, [unit.ranges for unit in units])

    def _page_in_experts(self, units: list[ExpertUnit]) -> list[list[Future]]:
        """A staged matrix's slices paged into the file mapping (Linux: MADV_POPULATE_READ
        after WILLNEED), in the order ``units`` come (the order compute uses them), for compute
        to meet as they land. Their shared end pages are counted as held, as a placed slice's,
        so the release (``_release_expert``) gives back what no one else holds."""
        return [self._read_ranges(unit, unit.ranges, page_in=True) for unit in units]

    def _sweep_layer(self, layer: int, kept: set[int]) -> None:
        """A staged layer's page-ins are over: give back every page of its routed tensors but the
        kept experts' (and pages shared with other tensors). A fault maps the cached pages about
        it too (fault-around: 64 KiB), and a paged-in slice's release gives back only its own,
        so without this its neighbours' pages would stay mapped, resident and counted nowhere.
        No read of this layer is under way: the stage's page-ins were waited for, and reads
        ahead for it are of kept experts."""
        page = self.io.page
        for matrix, t in enumerate(self.model.routed_tensors(layer)):
            at, stop = -(-t.offset // page) * page, (t.offset + t.n_bytes) // page * page
            with self._lock:  # a held end page may be a placed copy a neighbour counts on
                held = [(edge, edge + page) for (file, edge), refs in self._edge_refs.items() if file == t.file and at <= edge < stop and refs > 0]
            holes = sorted(
                [(r.offset // page * page, -(-r.end // page) * page) for r in (self.model.expert_ranges(layer, e)[matrix] for e in kept)]
                + held
            )
            for lo, hi in holes + [(stop, stop)]:
                if lo > at:
                    self.io.drop(self.fds[t.file], self._base(t.file, at), at, min(lo, stop) - at)
                at = max(at, hi)
                if at >= stop:
                    break

    def _reading_edges(self, file: int, edges: list[int], future: Future) -> None:
        """``future`` brings the shared end pages ``edges`` (see ``_handed``)."""
        if edges and self.placer.reads_in_place:
            with self._lock:
                for edge in edges:
                    self._edge_reads[(file, edge)] = future

    def _handed(self, futures_of: list[list[Future]], ranges_of: list) -> list[list[Future]]:
        """What the expert cache waits on for each expert's slice reads: its ``futures``, and
        where a shared end page reads as zeros until its read lands (the placer's arena), the
        reads still bringing the ones another slice's read holds. (The cache then never cancels
        a read: one may bring a page others wait for.) One lock for a layer's experts."""
        if self.placer is None or not self.placer.reads_in_place:
            return futures_of
        out = []
        with self._lock:
            for futures, ranges in zip(futures_of, ranges_of):
                waits = list(futures)
                for r in ranges:
                    for edge in self._slice_pages(r)[2]:
                        future = self._edge_reads.get((r.file, edge))
                        # Still bringing the page, or failed to (the wait then fails too and
                        # the expert is read again: the page is not there).
                        if future is not None and future not in waits and (
                            not future.done() or future.cancelled() or future.exception() is not None
                        ):
                            waits.append(future)
                out.append(waits)
        return out

    def fail(self, message: str) -> None:
        """Stop the token: the abort callback ends it, the reply ends with ``message``. From an
        I/O thread (a page-in), the token may end before the shield is up: ``reset_error`` waits
        for it, or it would come up after, zeros over the model's file pages for good. Page-ins
        of the failed token that fail while ``reset_error`` waits for them are its failure too."""
        with self._failing:
            if self.error is not None or self._resetting:
                return
            self.error = message
            self._shielding += 1
        try:  # not under the lock: the dropper's own failure comes here while the shield waits for it
            self._shield()
        finally:
            with self._failing:
                self._shielding -= 1
                self._failing.notify_all()

    def _shield(self) -> None:
        """Until the aborted token is over, no page compute may touch faults on the file.

        ggml checks the abort after each node, so a node or two of the layer whose read failed
        may still run, on pages that a cut file would SIGBUS. Resident bytes are anonymous
        memory on the direct-read path (pinned set, shards, experts), so every file-backed page
        of the mapping is one nobody holds: it is mapped as zeros, and releases (which map the
        file back) wait, until ``reset_error``. Without direct reads the pages are the page
        cache's, and the abort is all there is."""
        if self.placer is None:
            return
        self._dropper.pause()
        try:
            self._blanked += self.placer.blank_file_backed()
        except OSError as exc:
            self.error += f" (and the mapping could not be shielded: {exc})"

    def _release(self, r) -> None:
        """The dropper's work for one shard's range: placed pages go back to the file first, so the
        drop below only ever meets file-backed memory; then its end pages that no one holds."""
        try:
            if self.placer is not None:
                self.placer.release(r.file, r.offset, r.length)
            self.io.drop(self.fds[r.file], self._base(r.file, r.offset), r.offset, r.length)
        finally:
            if self.placer is not None:
                for file, offset, length in self._give_back_edges([r]):
                    self._give_back(file, offset, length)

    # -- expert slices in place ------------------------------------------------------------
    #
    # An expert slice is read, whole pages and all, into anonymous memory at its place (see
    # direct.py), its partial end pages included: a file-backed page there would be faulted in
    # by compute, and the fault maps its cached neighbours with it (fault-around: 64 KiB of
    # other experts per fault when the file sits in the page cache, as after a restart). An end
    # page is shared with the neighbouring slice, so it is counted: read by the first slice
    # that needs it, given back with the last. A pinned hot expert holds its pages for good.

    def _slice_pages(self, r) -> tuple[int, int, list[int]]:
        """(first page, end, shared end pages) of a slice, as file offsets."""
        page = self.io.page
        lo, hi = r.offset // page * page, -(-r.end // page) * page
        shared = []
        if r.offset % page:
            shared.append(lo)
        if r.end % page and hi - page not in shared:
            shared.append(hi - page)
        return lo, hi, shared

    def _take_edges(self, ranges) -> list[list[int]]:
        """Count each range's shared end pages as held; for each, the ones no one held before,
        to be read.

        In the bounded layout a page on a layer's edge has a place in each layer's slot, so no
        end page is placed: they stay the window's file pages (see addressing.py)."""
        return self._hold_edges([(r.file, self._slice_pages(r)[2]) for r in ranges])

    def _hold_edges(self, edges_of: list[tuple[int, list[int]]]) -> list[list[int]]:
        """``_take_edges`` for (file, shared end pages) pairs, in order, under one lock: of two
        slices sharing a page, the first reads it."""
        if self.space.bounded:
            return [[] for _ in edges_of]
        out = []
        refs = self._edge_refs
        with self._lock:
            for file, shared in edges_of:
                out.append([edge for edge in shared if refs.get((file, edge), 0) == 0 or self._edge_read_failed(file, edge)])
                for edge in shared:
                    refs[(file, edge)] = refs.get((file, edge), 0) + 1
        return out

    def _edge_read_failed(self, file: int, edge: int) -> bool:
        """Whether the read that was to bring a held end page failed (its slice is then read
        again, or forgotten): in the arena the page is not there, and whoever needs it next
        reads it. Caller holds the lock."""
        future = self._edge_reads.get((file, edge))
        return future is not None and future.done() and (future.cancelled() or future.exception() is not None)

    def _give_back_edges(self, ranges) -> list[tuple[int, int, int]]:
        """Stop holding the ranges' shared end pages, under one lock; (file, offset, length) of
        the ones no one holds any more, to be given back."""
        if self.space.bounded:
            return []
        page = self.io.page
        out = []
        with self._lock:
            for r in ranges:
                for edge in self._slice_pages(r)[2]:
                    left = self._edge_refs.get((r.file, edge), 0) - 1
                    if left > 0:
                        self._edge_refs[(r.file, edge)] = left
                    else:
                        self._edge_refs.pop((r.file, edge), None)
                        self._edge_reads.pop((r.file, edge), None)
                        out.append((r.file, edge, page))
        return out

    def _base(self, file: int, offset: int) -> int:
        """Where ``file``'s offset 0 would be for the run holding ``offset`` (a range within one
        run of one layer maps linearly; for platform calls that take a base and an offset)."""
        return self.space.at(file, offset) - offset

    def _give_back(self, file: int, offset: int, length: int) -> None:
        if self.placer is not None and self.placer.holds(file, offset):
            self.placer.release_in_place(file, offset)
        else:  # read through the page cache (O_DIRECT refused): out of our tables and the cache
            self.io.drop(self.fds[file], self._base(file, offset), offset, length)

    def _expert_pieces(self, ranges) -> list[tuple | None]:
        """For each slice, its pages not already held as one read (None: all held): its own
        whole pages into place, each shared end page no one holds yet copied in (a shared page
        must never read as zeros: a neighbour's read that found it held reads the file's page
        meanwhile, or, in the placer's arena, waits for this read)."""
        page = self.io.page
        pages = [self._slice_pages(r) for r in ranges]
        out = []
        for r, (lo, hi, shared), fresh in zip(ranges, pages, self._hold_edges([(r.file, p[2]) for r, p in zip(ranges, pages)])):
            held = [edge for edge in shared if edge not in fresh]
            inner = self._own_span(lo, hi, shared)
            start = lo + page if lo in held else lo
            end = hi - page if hi - page in held else hi
            out.append((r.file, start, end - start, (SLICE, [inner] if inner is not None else [], fresh)) if end > start else None)
        return out

    def _slice_own(self, r) -> tuple[int, int] | None:
        """(offset, length) of a slice's pages that are its alone (its shared end pages aside)."""
        return self._own_span(*self._slice_pages(r))

    def _own_span(self, lo: int, hi: int, shared: list[int]) -> tuple[int, int] | None:
        """``_slice_own`` from the slice's pages (``_slice_pages``)."""
        page = self.io.page
        inner_start = lo + page if lo in shared else lo
        inner_end = hi - page if hi - page in shared else hi
        return (inner_start, inner_end - inner_start) if inner_end > inner_start else None

    def _release_expert(self, r) -> None:
        """Give a slice back: its own pages, and each shared end page no resident slice holds."""
        own = self._slice_own(r)
        for file, offset, length in ([(r.file, *own)] if own else []) + self._give_back_edges([r]):
            self._give_back(file, offset, length)

    def _release_slices(self, batch) -> None:
        """``_release_expert`` for many slices at once (the experts one call of the cache
        evicted, where the placer has the arena): their end pages counted under one lock, the
        placer's records taken under one, and neighbouring pages freed in one call each. A
        prompt's chunk evicts hundreds, and its reads wait for their release: one by one, the
        dropper took 1.4 s of a 128-token prompt's I/O threads on the README's MoE example."""
        by_file: dict[int, list[tuple[int, int]]] = {}
        for r in batch:
            own = self._slice_own(r)
            if own is not None:
                by_file.setdefault(r.file, []).append(own)
        for file, offset, length in self._give_back_edges(batch):
            by_file.setdefault(file, []).append((offset, length))
        failure = None
        for file, parts in by_file.items():  # every part tried, the first failure raised after
            rest, failed = self.placer.release_many(file, parts)
            failure = failure or failed
            for offset, length in rest:  # read through the page cache
                try:
                    self.io.drop(self.fds[file], self._base(file, offset), offset, length)
                except OSError as exc:
                    failure = failure or exc
        if failure is not None:
            raise failure

    def _submit(self, shard: Shard) -> None:
        """Queue a shard's chunks; caller holds no lock and the shard is COLD."""
        kept = self._dropper.keep(("shard", shard.index))  # its end pages are still held then
        if self.placer is None:  # a placer reads past the cache: read-ahead into it would read twice
            self.io.advise_read(self.fds[shard.file], shard.offset, shard.length)
        # A prompt's layer computes while its trunk pages in: the layer's attention starts on
        # the first bytes instead of after the last (the tensors lie in the file about in the
        # order the graph uses them). A decoded token reads its trunk ahead instead (prefetch).
        page_in = self.experts is not None and self.experts.prefilling and self._can_page_in()
        if page_in:
            if self.placer is not None:  # the window is the file's pages now: the budget has no room for both
                self.placer.free_idle_buffers()
            self._paged_in.add(shard.index)
        else:
            self._paged_in.discard(shard.index)
        self._futures[shard.index] = self._read_ranges(shard, [shard.range], hold=not kept, page_in=page_in)
        self.state[shard.index] = Residency.INFLIGHT
        self._resident_bytes += shard.length

    def _drop(self, shard: Shard) -> None:
        if self.state[shard.index] not in (Residency.RESIDENT, Residency.INFLIGHT):
            return
        futures = self._futures.pop(shard.index, [])
        for f in futures:
            f.cancel()
        for f in futures:
            if not f.cancelled():
                try:
                    f.result()
                except Exception:  # a failed read of a shard nobody needs any more
                    pass
        if shard.index in self._prefetched:
            self.prefetch_wasted += 1
            self.prefetch_wasted_bytes += shard.length
            self._prefetched.discard(shard.index)
        self._dropper.later(("shard", shard.index), [shard.range])
        self.state[shard.index] = Residency.COLD
        self._resident_bytes -= shard.length
        self._lru.pop(shard.index, None)

    # -- the eval callback's hook --------------------------------------------------------

    def on_layer_start(self, layer: int) -> bool:
        """Called by the engine's eval callback; False means: abort this token."""
        if self.error is not None:
            return False
        try:
            self._layer_start(layer)
        except (StreamAbort, StagingError) as exc:
            self.fail(str(exc))
        except OSError as exc:
            self.fail(f"cannot read the model: {exc}")
        return self.error is None

    def _layer_start(self, layer: int) -> None:
        n = self.model.n_layers
        if self.experts is not None:  # a staged layer before is over (at 0: a graph that was cut short)
            self.experts.end_stage(strict=layer > 0)
        if layer == 0:  # a graph cut short (cancelled) left its layers read whole: given back
            for stale in list(self._layer_reads):
                self._give_back_layer(stale)
        if layer == 0 and self._pending is not None:
            self._apply_pending()
        if layer > 0:
            self._finish_layer(layer - 1)
        if self._lent:
            self._return_lent_room()
        if self._window_lent and (layer >= n or self.layer_shards[layer] or not self.experts.prefilling):
            self._take_back_window()  # the trunk streams again (or decode starts): the window's own
        if layer >= n:  # output stage: non-layer tensors are always pinned
            self.current_layer = None
            self._check_files(None)
            self._prefetch_from(0)
            self._claim_ahead(0)
            return
        if layer == 0:
            self._check_files(None)
        self._take_slot(layer)  # the layer before has finished: its slot, if shared, is free
        self.current_layer = layer
        self._check_files(layer)
        self.bytes_from_cache += self._pinned_by_layer[layer]
        waited = 0.0
        for shard in self.layer_shards[layer]:
            i = shard.index
            futures = self._futures.get(i, [])
            if any(f.done() and not f.cancelled() and f.exception() is not None for f in futures):
                self._drop(shard)  # a read ahead that failed (a drive hiccup) is tried again now
                futures = []
            arrived = self.state[i] == Residency.RESIDENT or (
                self.state[i] == Residency.INFLIGHT and all(f.done() for f in futures)
            )
            if self.state[i] != Residency.RESIDENT:
                self.bytes_needed += shard.length
            if arrived:
                self.hits += 1
                self.bytes_from_cache += shard.length
            else:
                self.misses += 1
                if self.state[i] == Residency.COLD:
                    self._submit(shard)
                t0 = time.perf_counter()
                for f in self._futures[i] if i not in self._paged_in else ():
                    f.exception()  # waits; the error itself is raised just below
                waited += time.perf_counter() - t0
            try:
                for f in self._futures.get(i, []):
                    if i not in self._paged_in or f.done():
                        f.result()  # raises StreamAbort for a failed read, before compute touches the bytes
            except Exception:
                self._drop(shard)  # not kept as failed: the next token reads it again
                raise
            self.state[i] = Residency.RESIDENT
            if i in self._prefetched:
                self.prefetch_used += 1
                self._prefetched.discard(i)
            self._lru[i] = None
            self._lru.move_to_end(i)
        self.stall_s += waited
        if self.experts is not None:  # after the trunk: the layer's attention needs it first
            self._read_layers_whole(layer)
            self._lend_idle_window(layer)
            self.experts.read_first_matrices(layer, self.chunk_tokens, self._early_room(layer))
        self._read_floating(layer + 1)
        self._prefetch_from(layer + 1)
        if layer + 1 < n:
            self._claim_ahead(layer + 1)

    def _read_floating(self, layer: int) -> None:
        """``layer``'s FLOATING tensors into the mapping now, where their shard's bytes have not
        landed: the layer computing reads them (K3's residual attention scores the banked stack
        one layer early). Missing, each was a fault compute waited on, a read from the file no
        counter saw (on a 4-layer K3 with its trunk streamed, one a layer and token). The wait
        is a stall; a few pages each."""
        ranges = self._floating.get(layer)
        if not ranges:
            return
        started = time.perf_counter()
        try:
            for index, file, offset, length, name in ranges:
                state, futures = self.state[index], self._futures.get(index, [])
                if state == Residency.RESIDENT or (
                    state == Residency.INFLIGHT and all(f.done() and not f.cancelled() and f.exception() is None for f in futures)
                ):
                    continue  # the shard's bytes are in place
                if self._dropper.queued(("shard", index)):  # its release would take back what is read here
                    self._dropper.wait_released(self._dropper.mark())
                try:
                    read = self.io.populate(self.fds[file], self._base(file, offset), offset, length)
                except OSError as exc:
                    raise StreamAbort(
                        f"cannot read {name} from model file {os.path.basename(self.model.files[file])} at byte {offset}: "
                        f"{exc.strerror or exc} (drive removed or failing?)"
                    ) from None
                if read:
                    with self._lock:
                        self.bytes_read += length
        finally:
            self.stall_s += time.perf_counter() - started

    def _finish_layer(self, layer: int) -> None:
        if layer >= self.model.n_layers:
            return
        if layer in self._layer_reads:
            self._give_back_layer(layer)
        for shard in self.layer_shards[layer]:  # a page-in that failed under compute stops the token
            if shard.index in self._paged_in:
                for f in self._futures.get(shard.index, []):
                    if not f.cancelled():
                        f.result()
        if self.settings.policy == "pin-stream":
            for shard in self.layer_shards[layer]:
                self._drop(shard)
        else:
            self._evict_lru(keep=set())

    def _evict_lru(self, keep: set[int], extra: int = 0) -> None:
        window = self._window()
        while self._lru and self._resident_bytes + extra > window:
            victim = next((i for i in self._lru if i not in keep), None)
            if victim is None:
                return
            self._drop(self.model.shards[victim])

    def _prefetch_from(self, first_layer: int) -> None:
        if self._window_lent:  # the window's room is the cache's until a layer whose trunk streams starts
            return
        n = self.model.n_layers
        window = self._window()
        depth = self.settings.prefetch_depth
        if self.space.bounded:  # a live change may ask for more than the slots hold
            depth = min(depth, self.space.n_slots - 1)
        for d in range(depth):
            layer = (first_layer + d) % n
            if not self._take_slot(layer):
                break  # its slot holds the layer computing now
            for shard in self.layer_shards[layer]:
                if self.state[shard.index] != Residency.COLD:
                    continue
                if self.settings.policy == "lru":
                    # Never the layer computing now: with direct reads its pages would turn to zeros.
                    now = [] if self.current_layer is None else self.layer_shards[self.current_layer]
                    wanted = {s.index for k in range(self.settings.prefetch_depth) for s in self.layer_shards[(first_layer + k) % n]}
                    wanted |= {s.index for s in now}
                    self._evict_lru(keep=wanted, extra=shard.length)
                if self._resident_bytes + shard.length > window:
                    return
                self._read_ahead(shard)
        # Promote finished reads so the residency strip and hit test see them.
        for index, futures in self._futures.items():
            if self.state[index] == Residency.INFLIGHT and all(f.done() and f.exception() is None for f in futures):
                self.state[index] = Residency.RESIDENT

    def _read_ahead(self, shard: Shard) -> None:
        """Start reading ``shard`` before compute reaches it, counted as read ahead."""
        self._submit(shard)
        self._prefetched.add(shard.index)
        self.prefetch_issued += 1

    def _take_slot(self, layer: int) -> bool:
        """Bounded layout: make ``layer``'s slot its own (addressing.Windows.claim), giving back
        first everything placed there for the layer that held it. False while that layer is the
        one computing."""
        space = self.space
        if self._claiming:
            self._collect_claim(space.slot_of(layer))
        if space.owns(layer):
            return True
        held_by = space.occupant(layer)
        if held_by is not None:
            if held_by == self.current_layer:
                return False
            self._vacate(held_by)
            self._dropper.flush()  # every release done: nothing placed for it is left in the slot
            if self.error is not None:
                raise StreamAbort(self.error)  # a release failed: the slot is not taken over
        self._claim(layer, held_by)
        if self.experts is not None:
            self._unpark_experts(layer)
        return True

    def _claim_ahead(self, layer: int) -> None:
        """Bounded layout: take ``layer``'s slot over on the slot lane while the layer before it
        computes, when the layer holding the slot has been computed; ``_take_slot`` collects it."""
        space = self.space
        if not space.bounded or self.error is not None or space.owns(layer):
            return
        slot = space.slot_of(layer)
        held_by = space.occupant(layer)
        if slot in self._claiming or (held_by is not None and held_by == self.current_layer):
            return
        if held_by is not None:
            self._vacate(held_by)
        mark = self._dropper.mark()  # the releases of what ``held_by`` had placed in the slot
        self._claiming[slot] = (layer, self._slot_lane.submit(self._claim_when_released, layer, held_by, mark))

    def _claim_when_released(self, layer: int, held_by: int | None, mark: int) -> bool:
        """The slot lane's work: False where a release failed first (the slot is left as it was,
        and taken over on the compute thread once the failed token is over)."""
        if not self._dropper.settle(mark) or self.error is not None:
            return False
        self._claim(layer, held_by)
        return True

    def _collect_claim(self, slot: int) -> None:
        """Wait for a claim under way on ``slot``; its layer's parked experts go back in place."""
        layer, claim = self._claiming.pop(slot, (None, None))
        if claim is None:
            return
        t0 = time.perf_counter()
        claimed = claim.result()  # an OSError of its mapping is raised here, as on the compute thread
        waited = time.perf_counter() - t0
        self.stall_s += waited
        self.slot_wait_s += waited
        if claimed and self.experts is not None:
            self._unpark_experts(layer)

    def _vacate(self, held_by: int) -> None:
        """``held_by`` is leaving its slot: its shards given back, its cached experts parked."""
        for shard in self.layer_shards[held_by]:
            self._drop(shard)
        if self.experts is not None:
            self._park_experts(held_by)

    def _claim(self, layer: int, held_by: int | None) -> None:
        """Map ``layer`` over its slot, once nothing placed there for ``held_by`` is left."""
        space = self.space
        if held_by is not None:
            for run in space.plan.layers[held_by]:
                if self.placer is not None:  # records a failed read or release left: the claim clears their pages
                    self.placer.forget_within(run.file, run.lo, run.hi)
                # The pages compute faulted in through the window (a run's end pages, reads that
                # went through the page cache) leave the cache with it, as streamed ranges do.
                self.io.uncache(self.fds[run.file], run.lo, run.hi - run.lo)
        space.claim(layer)

    def _own_pages(self, unit: ExpertUnit) -> list[tuple[int, int]]:
        """(file, offset) of each slice's own whole pages: what of it is placed in the bounded
        layout (its end pages stay the window's)."""
        return [(r.file, own[0]) for r in unit.ranges if (own := self._slice_own(r)) is not None]

    def _park_experts(self, layer: int) -> None:
        """The cached experts of a layer leaving its slot keep their pages (moved out, placer.park)
        and stay cached; one that cannot be parked is given back and read again when routed to."""
        for key, unit in self.experts.resident_of(layer):
            if self.placer is None or not all([self.placer.park(*part) for part in self._own_pages(unit)]):
                self.experts.forget(key)  # the slices parked are given back with the rest

    def _unpark_experts(self, layer: int) -> None:
        for key, unit in self.experts.resident_of(layer):
            if self.placer is None or not all([self.placer.unpark(*part) for part in self._own_pages(unit)]):
                self.experts.forget(key)

    def _check_files(self, layer: int | None) -> None:
        """Pinned bytes live in the mapping too: a file that shrank would SIGBUS there, so stop
        first. ``layer`` None checks the non-layer tensors (embeddings, output)."""
        for file, end in self._file_ends.get(layer, {}).items():
            if os.fstat(self.fds[file]).st_size < end:
                where = "the output tensors need" if layer is None else f"layer {layer} needs"
                raise StreamAbort(
                    f"model file {os.path.basename(self.model.files[file])} is shorter than its header says "
                    f"({where} byte {end}); file truncated or drive removed?"
                )

    # -- routed experts -----------------------------------------------------------------

    def attach_experts(self, capacity: int, pinned: list[ExpertUnit], counts: list[list[int]]) -> None:
        """Stream MoE layers by expert: their routed shards leave the layer-by-layer stream."""
        for layer in range(self.model.n_layers):
            self.layer_shards[layer] = [s for s in self.layer_shards[layer] if not s.routed]
        self._trunk_streams = any(self.layer_shards)  # fixed from here on: read by _link_idle each decoded MoE layer
        self._layer_most = self._most_layer_bytes()

        # Locked in anonymous memory by the pin: never read here, never given back.
        self._take_edges([r for unit in pinned for r in unit.ranges])
        if self.placer is not None and not self.space.bounded:
            self.placer.make_arena(arena_segments(self.model, pinned, self.io.page))

        def read_unit(unit: ExpertUnit, pool: ThreadPoolExecutor | None = None) -> list[Future]:
            # A release still queued for it runs first (the new read waits for it), so what
            # counts as resident is always what this read put there.
            return self._read_ranges(unit, unit.ranges, pool)

        def drop_unit(unit: ExpertUnit) -> None:
            self._dropper.later(("expert", unit.layer, unit.expert, unit.matrix), unit.ranges, self._release_expert)

        def drop_units(units: list[ExpertUnit]) -> None:  # one release, under a key of its own
            batch = tuple(r for unit in units for r in unit.ranges)
            self._dropper.later(("experts", next(self._batches)), [batch], self._release_slices)

        spare = self.placer.spare if self.placer is not None and self.placer.reads_in_place else None
        if spare is not None and (self.model.expert_slice_bytes or 0) < self.placer.spare_from:
            spare = None  # no read would take them: small slices fault in fewer pages than a move costs
        self.experts = ExpertCache(
            self.model, capacity, pinned, counts, read_unit, drop_unit, self.settings.expert_policy,
            read_ahead=lambda unit: read_unit(unit, self._guess_pool),
            read_units=self._read_experts if self.placer is not None else None,
            cancel_reads=self.placer is None or not self.placer.reads_in_place,
            page_in_units=self._page_in_experts if self._pages_in_slices() else None,
            sweep_layer=self._sweep_layer,
            # Where a release is one madvise each (the arena), an eviction's go as one.
            drop_units=drop_units if self.placer is not None and self.placer.reads_in_place else None,
            spare=spare,
            fill_spare=self._fill_spare if spare is not None else None,
            link_idle=self._link_idle,
        )
        if self.settings.expert_lookahead:
            self.predictor = RouterPredictor.from_mapping(self.model, self.space)
        self._set_trimmer()
        self._find_whole_layers(pinned)
        if self.placer is not None:
            self._size_pool()  # the window is trunk bytes now

    def _fill_spare(self) -> None:
        """Fault in what the cache lent the spare pages, beside compute, on a look-ahead thread
        (idle unless look-ahead is on; not one compute waits on), once the releases queued so far
        are done: room an eviction freed in the books is not memory until then."""
        mark, spare = self._dropper.mark(), self.placer.spare

        def fill() -> None:
            if self._dropper.wait_released(mark):
                spare.fill()

        self._guess_pool.submit(fill)

    # -- a prompt's layers read whole --------------------------------------------------------
    #
    # Where a prompt's chunk routes to most of a small-expert layer (128 tokens on the MoE
    # example: 93% of its 384 experts), reading its experts one by one is thousands of slices,
    # each with its books, its end pages and its place in the arena: on two cores that work,
    # not the disk, was the prompt's wait. Such a layer's routed tensors are read whole instead,
    # as the trunk is: a few 4 MiB pieces into the pool's huge pages, moved into the arena, one
    # layer ahead of compute, and moved out again when the layer is done. The cache lends the
    # room for two layers while the prompt lasts. Not where the cache holds most experts: there
    # a prompt's experts read into it stay for decode, which otherwise read them all again (the
    # 4 GiB MoE at a 4000 MiB budget and 1 GB/s: first token 2.5 s against 3.8, decode at 82% of
    # compute in RAM against 75%).

    def _find_whole_layers(self, pinned: list[ExpertUnit]) -> None:
        """The MoE layers that may be read whole: their routed tensors less the pinned hot
        experts' pages (locked in place for good), each stretch's whole pages in the arena."""
        placer = self.placer
        if placer is None or not placer.reads_in_place or self.experts is None:
            return
        page = placer.page
        held: dict[int, list[tuple[int, int]]] = {}  # layer -> pinned pages (file offsets; one file a layer)
        for unit in pinned:
            held.setdefault(unit.layer, []).extend(_pages_of(unit, page))
        most_pieces = most_bytes = 0
        for layer in range(self.model.n_layers):
            ranges = [
                ByteRange(shard.file, lo, hi - lo)
                for shard in self.model.layer_shards(layer) if shard.routed
                for lo, hi in _less(shard.offset, shard.offset + shard.length, held.get(layer, []))
            ]
            pieces = [(r.file, start, length) for r in ranges for start, length, placed in split_pieces(r.offset, r.end, page) if placed]
            if not pieces or not all(placer.in_arena(file, start, start + length) for file, start, length in pieces):
                continue
            whole = sum(1 for _, _, length in pieces if length == PIECE_BYTES)
            read = sum(length for _, _, length in pieces)
            # Pinned experts scattered through a layer leave few whole pieces, and the rest read in
            # place costs the kernel a fault per page: the MoE example's 128-token prompt took
            # 2.2-2.3 s that way with the hot experts of a run before pinned, 1.9 s expert by expert.
            if 4 * whole * PIECE_BYTES < 3 * read:
                continue
            self._whole_ranges[layer] = ranges
            most_pieces, most_bytes = max(most_pieces, whole), max(most_bytes, read)
        # Two layers in flight: the one computing and the next. A whole piece takes a pool
        # buffer; the rest is read in place (DirectPlacer.place).
        self._whole_pieces, self._whole_bytes = 2 * most_pieces, 2 * most_bytes

    def _read_layers_whole(self, layer: int) -> None:
        """A prompt's layer starts: the next two MoE layers from it are read whole where its
        chunk routes to most of their experts and the cache does not hold most of the model's
        (the first time, the cache lends the room)."""
        experts = self.experts
        if not self._whole_ranges or not experts.prefilling or experts.holds_most:
            return
        targets = self.model.moe_layers_from(layer)[:2]
        for target in targets:
            if target in self._layer_reads or target not in self._whole_ranges:
                continue
            if not experts.routes_to_most(target, self.chunk_tokens):
                continue
            if not self._lent:
                if not experts.lend(self._whole_bytes):
                    return  # the cache is too small for it now (or all in use)
                self._lent, self._lent_pieces = self._whole_bytes, self._whole_pieces
                if not self._dropper.settle(self._dropper.mark()):  # the evictions are out before the pool grows
                    raise StreamAbort(self.error or "streaming stopped: the cache's releases are held back")
                self._size_pool()
            experts.give_up_layer(target)
            unit = _LayerRead(target, self._whole_ranges[target][0].file)
            # Its experts' releases, and its last reading's if still queued, run first (the
            # reads' room mark).
            self._layer_reads[target] = self._read_ranges(unit, self._whole_ranges[target])

    def _routed_whole(self, layer: int, experts: set[int]) -> float:
        """The router of a layer read whole has chosen: wait for its reads; seconds waited."""
        started = time.perf_counter()
        futures = self._layer_reads[layer]
        for f in futures:
            f.exception()  # waits
        waited = time.perf_counter() - started
        for f in futures:
            f.result()  # a failed read stops the token here, before the expert matmuls
        read = sum(r.length for r in self._whole_ranges[layer])
        self.experts.routed_whole(layer, experts, read)
        return waited

    def _give_back_layer(self, layer: int) -> None:
        """A layer read whole is over (computed, or its token stopped): its pieces go back to the pool."""
        futures = self._layer_reads.pop(layer, None)
        if futures is None:
            return
        for f in futures:
            f.exception()  # a read still under way lands first: its release must come after it
        self._dropper.later(("layer", layer), [tuple(self._whole_ranges[layer])], self._release_layer)
        self.experts.whole_layers.discard(layer)

    def _release_layer(self, ranges: tuple[ByteRange, ...]) -> None:
        """The dropper's work for a layer read whole: its pieces out of the arena, then the end
        pages its ranges share with trunk tensors that no one holds any more."""
        failure = None
        for r in ranges:
            try:
                self.placer.release_pieces(r.file, r.offset, r.end)
            except OSError as exc:
                failure = failure or exc
        for file, offset, length in self._give_back_edges(ranges):
            try:
                self._give_back(file, offset, length)
            except OSError as exc:
                failure = failure or exc
        if failure is not None:
            raise failure

    def _lend_idle_window(self, layer: int) -> None:
        """A prompt's layer whose trunk is all pinned, with nothing of the streamed trunk in
        memory or on its way, where nothing is read ahead (prefetch depth 0: the budget holds one
        layer of streamed trunk): the window's room, the read pool's buffers, is idle until a
        layer whose trunk streams starts. The expert cache has it meanwhile, so that a staged
        layer reads its next matrix while one computes, and its first matrices start early;
        with room for one matrix, reads and compute took turns (on the K3 slice at 2 GiB the
        disk sat idle for a second of a 7 s prompt)."""
        experts, placer = self.experts, self.placer
        if (
            self._window_lent
            or not experts.prefilling
            or self.layer_shards[layer]
            or self._resident_bytes
            or self.settings.prefetch_depth > 0
            or placer is None
            or not placer.capacity
            or not experts.pages_in  # staged slices page in (Linux, slices of a huge page or more)
        ):
            return
        self._window_lent = placer.capacity * PIECE_BYTES
        experts.capacity += self._window_lent
        self._size_pool()  # none: a read that would take a buffer goes through the page cache

    def _after_last_read(self) -> None:
        """A prompt's staged layer has read its last matrix and gave one back: the room it frees
        goes to what comes next, while that last matrix computes. Where the next layer streams
        its trunk, the window goes back to it and the trunk starts paging in; else the next
        staged layer's first matrices start."""
        experts, layer = self.experts, self.current_layer
        if not experts.prefilling or not experts.staging or layer is None or not experts.stage_all_read():
            return
        following = layer + 1
        if following >= self.model.n_layers:
            return
        if self.layer_shards[following]:
            # Only where the cache already fits its own room, so that nothing is evicted while the
            # last matrix computes (its reads and the stage's cached experts cannot go yet).
            if self._window_lent and experts.resident_bytes <= experts.capacity - self._window_lent:
                self._take_back_window()
                for shard in self.layer_shards[following]:
                    if self.state[shard.index] == Residency.COLD:
                        self._read_ahead(shard)
            return
        experts.read_first_matrices(following, self.chunk_tokens, self._early_room(following))

    def _early_room(self, layer: int) -> int | None:
        """The cache's room that stays its own until the next MoE layer's stage: less the
        window's, where a layer on the way there streams its trunk (the window goes back then)."""
        if not self._window_lent:
            return None
        target = next(iter(self.model.moe_layers_from(layer)), layer)
        if any(self.layer_shards[i] for i in range(layer + 1, target + 1)):
            return self.experts.capacity - self._window_lent
        return None

    def _take_back_window(self) -> None:
        """A layer whose trunk streams starts, or decode: the cache gives the window's room back,
        its staged reads given back already (``end_stage``) and its coldest experts evicted."""
        experts, room = self.experts, self._window_lent
        self._window_lent = 0
        experts.capacity -= room
        if not experts.shrink(everything=True):  # the layer before is done: none of its experts in use
            from kimitui.units import format_bytes

            raise StagingError(
                f"the expert cache holds {format_bytes(experts.resident_bytes)}, past its "
                f"{format_bytes(experts.capacity)} once the streamed trunk's room goes back"
            )
        self._size_pool()

    def _return_lent_room(self) -> None:
        """The prompt is over: the pool pieces its layers used go, and the cache has its room back."""
        if not self._lent or self._layer_reads or self.experts.prefilling:
            return
        self._dropper.flush()  # the last layers' pieces are back in the pool first
        self.experts.take_back(self._lent)
        self._lent = self._lent_pieces = 0
        self._size_pool()  # the lent buffers beyond the pool's own go at once

    def _can_page_in(self) -> bool:
        """Reads may page in under compute (staged matrices, see ``ExpertCache.stage_matrix``,
        and a prompt's trunk, see ``_submit``) where the mapping is the whole file and the OS
        can fault a range in ahead of compute (Linux), not in the bounded layout's slots, and
        the placer's releases leave the file's pages behind (see ``PlacedParts.pages_in``)."""
        return (
            self.io.platform.startswith("linux")
            and not self.space.bounded
            and (self.placer is None or self.placer.pages_in)
        )

    def _pages_in_slices(self) -> bool:
        """Staged slices page in where each is a huge page or more (Kimi K3's are 5.85 MB). A
        fault also maps the cached pages about it (fault-around: 64 KiB), which a smaller slice's
        release would leave behind, resident past the budget until the stage's sweep; and small
        slices have the arena, whose unplaced pages read as zeros, not the file's."""
        routed = [t for t in self.model.tensors if t.role == ROUTED_EXPERTS]
        return (
            self._can_page_in()
            and bool(routed)
            and min(t.n_bytes // max(t.n_expert, 1) for t in routed) >= HUGE_ALIGN
            and not (self.placer is not None and self.placer.reads_in_place)
        )

    def _set_trimmer(self) -> None:
        """Expert trimming follows the settings; its counts carry over a change of rule."""
        rule = self.settings.trim_rule
        if not rule.on or self.experts is None:
            self.trimmer = None
            return
        self.trimmer = self._trimmer_seen or RouteTrimmer(rule, softmax_weighted=self.model.architecture in SOFTMAX_WEIGHTED_ARCHS)
        self.trimmer.rule = rule
        self._trimmer_seen = self.trimmer

    def trim_routes(self, layer: int, ids, weights) -> None:
        """The router of ``layer`` chose ``ids`` with ``weights`` ((n_tokens, k) views of the
        graph's tensors): skip what the trim rule skips, rewriting both, then read the rest."""
        try:
            kept = self.trimmer.trim(ids, weights, lambda experts: self.experts.holds(layer, experts))
        except Exception as exc:  # noqa: BLE001 - the token stops rather than compute on half-rewritten routes
            self.fail(f"layer {layer}: expert trimming failed: {type(exc).__name__}: {exc}")
            return
        self.on_experts(layer, kept)

    def _link_idle(self) -> bool:
        """Whether a decoded token leaves the link idle while it computes, so the expert cache's
        free room may be read into (``ExpertCache.warm``): read-ahead on (a prefetch depth of 0
        reads nothing it was not asked for), the trunk all pinned (a streamed trunk has the link
        to itself) and the whole-file layout (slots go to the layers computing)."""
        return self.settings.prefetch_depth > 0 and not self.space.bounded and not self._trunk_streams

    def on_router_input(self, layer: int, hidden) -> None:
        """Layer ``layer``'s FFN input (one token's, float32) is ready: read ahead the experts
        the next layer's router would pick for it."""
        following = layer + 1
        predictor = self.predictor
        if self.error is not None or predictor is None or following not in predictor.routers:
            return
        try:
            if not self._take_slot(following):
                return
            self.experts.prefetch(following, predictor.predict(following, hidden, self.model.n_expert_used))
        except StreamAbort as exc:
            self.fail(str(exc))

    def on_experts(self, layer: int, experts: set[int]) -> None:
        """The router of ``layer`` chose ``experts`` (for every token of the batch)."""
        if self.error is not None or self.experts is None or not experts:
            return  # no tokens in this micro-batch (llama.cpp builds such graphs): nothing to read
        n_expert = self.model.layers[layer].n_expert
        if min(experts) < 0 or max(experts) >= n_expert:
            # ggml's tensor layout moved under us: stop rather than guess which bytes to read.
            self.fail(f"layer {layer}: router ids {sorted(experts)[:8]} are not experts 0..{n_expert - 1} (unsupported llama.cpp build?)")
            return
        try:
            hits = self.experts.hits
            if layer in self._layer_reads:
                self.stall_s += self._routed_whole(layer, experts)
            else:
                self.stall_s += self.experts.ensure(layer, experts)
            self.experts.warm()
            on_route = self.on_route
            if on_route is not None:
                on_route(layer, sorted(experts), self.experts.hits - hits)
            following = layer + 1
            # Without router weights to apply, look-ahead guesses what the next layer chose last token.
            if (
                self.settings.expert_lookahead
                and self.predictor is None
                and following < self.model.n_layers
                and self.model.layers[following].is_moe
                and self._take_slot(following)
            ):
                self.experts.prefetch(following, self.experts.last_choice[following])
        except (StreamAbort, StagingError) as exc:
            self.fail(str(exc))
        except OSError as exc:
            self.fail(f"cannot read the model: {exc}")

    @property
    def staging(self) -> bool:
        """A layer's routed experts are being computed matrix by matrix (see experts.py)."""
        return self.experts is not None and self.experts.staging

    def on_expert_matrix(self, name: bytes) -> bool:
        """A graph node is about to compute with tensor ``name``: True when it is a staged
        matrix, now resident (the engine then hears of the node again once it has computed)."""
        if self.error is not None:
            return False
        try:
            waited = self.experts.stage_matrix(name)
        except (StreamAbort, StagingError) as exc:
            self.fail(str(exc))
            return False
        except OSError as exc:
            self.fail(f"cannot read the model: {exc}")
            return False
        if waited is None:
            return False
        self.stall_s += waited
        return True

    def on_expert_matrix_done(self, name: bytes) -> None:
        if self.error is not None:  # the token stops: no read ahead behind the shield (the stage ends at the next graph)
            return
        try:
            self.experts.matrix_done(name)
            self._after_last_read()
        except (StreamAbort, StagingError) as exc:
            self.fail(str(exc))
        except OSError as exc:
            self.fail(f"cannot read the model: {exc}")

    # -- tuning and views ----------------------------------------------------------------

    def reconfigure(self, **changes) -> None:
        """Live tuning: applied when the next token starts."""
        check_changes(changes)
        self._pending = replace(self._pending or self.settings, **changes)

    def _apply_pending(self) -> None:
        before, (self.settings, self._pending) = self.settings, (self._pending, None)
        if self.settings.io_threads != before.io_threads:
            # Reads already queued finish on the old pools; new ones go to pools of the new size.
            old = (self._pool, self._guess_pool)
            self._pool, self._guess_pool = _io_pools(self.settings.io_threads)
            for pool in old:
                pool.shutdown(wait=False)
            self._retired_pools += old  # joined at close: a read queued there still uses the placer
        if self.experts is not None:
            self.experts.set_policy(self.settings.expert_policy)
            self._set_trimmer()
            if self.settings.expert_lookahead and self.predictor is None:
                self.predictor = RouterPredictor.from_mapping(self.model, self.space)
            elif not self.settings.expert_lookahead:
                self.predictor = None
        self._evict_lru(keep=set())
        if self.placer is not None:
            self._size_pool()

    def residency_by_layer(self) -> list[str]:
        """One cell per layer: pinned / resident / in flight / cold (the least ready shard wins)."""
        out = []
        for layer in range(self.model.n_layers):
            streamed = {s.index for s in self.layer_shards[layer]}
            # Routed shards of expert-streamed layers show in the expert heatmap instead.
            states = [
                self.state[i]
                for i in self.model.layers[layer].shards
                if self.state[i] == Residency.PINNED or i in streamed or self.experts is None
            ]
            for candidate in (Residency.COLD, Residency.INFLIGHT, Residency.RESIDENT, Residency.PINNED):
                if candidate in states:
                    out.append(candidate.value)
                    break
            else:
                out.append(Residency.PINNED.value)
        return out

    def panel_counters(self) -> dict:
        """What the panels show, as it is now: read from the sampler's thread when it asks.
        ``list`` copies the shard reads at once (the engine thread adds to them meanwhile)."""
        inflight = [i for i in list(self._futures) if self.state[i] == Residency.INFLIGHT]  # only shards with reads
        experts = self.experts
        return dict(
            cache_hits=self.hits,
            cache_misses=self.misses,
            expert_hits=None if experts is None else experts.hits,
            expert_misses=None if experts is None else experts.misses,
            expert_routes=None if self._trimmer_seen is None else self._trimmer_seen.routes,
            expert_routes_skipped=None if self._trimmer_seen is None else self._trimmer_seen.routes_skipped,
            prefetch_queue_depth=len(inflight),
            prefetch_inflight_bytes=sum(self.model.shards[i].length for i in inflight),
            prefetch_used=self.prefetch_used + (experts.prefetch_used if experts else 0),
            prefetch_wasted_bytes=self.prefetch_wasted_bytes + (experts.prefetch_wasted_bytes if experts else 0),
            page_cache_fallback_bytes=self.page_cache_fallback_bytes,
            stall_s=self.stall_s,
        )

    def counters(self) -> dict:
        """Cumulative counters; a tracer takes differences per token."""
        with self._lock:
            read = self.bytes_read
        experts = self.experts
        return {
            "expert_prefetch_wasted_bytes": experts.prefetch_wasted_bytes if experts else None,
            "expert_hits": experts.hits if experts else None,
            # Expert trimming, where it was ever on: (token, slot) routes seen, skipped, and the
            # distinct experts a layer's micro-batch did not read because of it.
            "expert_routes": self._trimmer_seen.routes if self._trimmer_seen else None,
            "expert_routes_skipped": self._trimmer_seen.routes_skipped if self._trimmer_seen else None,
            "experts_skipped": self._trimmer_seen.experts_skipped if self._trimmer_seen else None,
            "expert_misses": experts.misses if experts else None,
            "bytes_read": read,
            "bytes_needed": self.bytes_needed + (experts.bytes_needed if experts else 0),
            "expert_bytes_needed": experts.bytes_needed if experts else None,
            "bytes_from_cache": self.bytes_from_cache + (experts.bytes_from_cache if experts else 0),
            "hits": self.hits + (experts.hits if experts else 0),
            "misses": self.misses + (experts.misses if experts else 0),
            "stall_s": self.stall_s,
            "slot_wait_s": self.slot_wait_s,
            "eval_asks": self.eval_asks,
            "eval_ask_s": self.eval_ask_s,
            "eval_observed": self.eval_observed,
            "eval_observe_s": self.eval_observe_s,
            # Shards read ahead and, with expert look-ahead, experts read ahead: one count each.
            "prefetch_issued": self.prefetch_issued + (experts.prefetch_issued if experts else 0),
            "prefetch_used": self.prefetch_used + (experts.prefetch_used if experts else 0),
            "prefetch_wasted": self.prefetch_wasted + (experts.prefetch_wasted if experts else 0),
            "page_cache_fallback_bytes": self.page_cache_fallback_bytes if self.placer is not None else None,
            # Placed in anonymous memory: "direct" (O_DIRECT), "buffered" (read through the page
            # cache, which the file system insists on), or None (not placed: the file's own pages).
            "placement": None if self.placer is None else "direct" if self.placer.direct else "buffered",
        }

    def reset_error(self) -> None:
        """The aborted token is over: the file goes back under the shielded pages, releases run
        again, and what the shield may have covered (bytes read through the page cache) is read
        again when next needed."""
        with self._failing:  # a shield still going up is up first
            self._failing.wait_for(lambda: self._shielding == 0)
            self._resetting = True
        try:
            self._reset_error()
        finally:
            with self._failing:
                self._resetting = False

    def _reset_error(self) -> None:
        self._dropper.resume()
        if self._window_lent and self.experts is not None:  # the stopped prompt's
            self.experts.end_stage(strict=False)
            self.experts.clear_early()
            self._take_back_window()
        for slot in list(self._claiming):  # a slot's mapping changes on the slot lane until collected
            try:
                self._collect_claim(slot)
            except OSError:
                pass  # the slot is held by no one: the next layer to need it maps it again
        for layer in list(self._layer_reads):  # the stopped token's: read again when next needed
            self._give_back_layer(layer)
        if self._blanked:
            # Reads under way when the shield went up may have placed pages inside it since:
            # everything streamed is given back first (reads waited for, releases done), so
            # that mapping the file over the shielded ranges replaces only zeros and file pages.
            for shard in self.model.shards:
                self._drop(shard)
            if self.experts is not None:
                self.experts.clear()
            self._dropper.flush()
            self._unshield()
        self.error = None

    def _unshield(self) -> None:
        """The file again over the ranges the shield blanked (``_shield``): each one tried, the
        first failure raised after."""
        blanked, self._blanked = self._blanked, []
        failures = []
        for entry in blanked:
            try:
                self.placer.map_file(*entry)
            except OSError as exc:
                failures.append(exc)
        if failures:
            raise failures[0]

    def close(self) -> None:
        with self._failing:  # a read failing from here on shields nothing; one shielding now is done first
            self._failing.wait_for(lambda: self._shielding == 0)
            self._resetting = True
        self._dropper.resume()  # reads waiting on a release must be able to finish
        if self.placer is not None and self.placer.spare is not None:
            self.placer.spare.close()  # a fill under way stops after its run
        for pool in (self._pool, self._guess_pool, *self._retired_pools, self._slot_lane):
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
        self._dropper.close()
        if self.placer is not None:
            self.placer.close()  # the mapping is the file's again before llama.cpp unmaps it
            try:
                self._unshield()  # a shield no token took down (a read ahead failed after the reply)
            except OSError:
                pass
        for fd in self.fds.values():
            os.close(fd)
