"""Direct placement (Linux): streamed shard bytes reach the model's mapping without the page cache.

Reading a shard through the page cache (MADV_POPULATE_READ on the file mapping, or pread) costs
the kernel a page-cache insert, and later an eviction, for every 4 KiB page: on this machine
~0.3 s of system time per GiB, taken from the two cores compute needs, and the reads themselves
ran at 1.1-1.4 GB/s against 2.1-2.6 GB/s for O_DIRECT reads into memory faulted in beforehand.

So the whole pages inside a shard are read with O_DIRECT into anonymous buffers from a pool
(faulted in once, kept), and each buffer is then moved over the shard's place in llama.cpp's
mapping with ``mremap``: the weights' addresses never change, and compute reads the new pages.
The load hooks put the mapping on a 2 MiB boundary, so a whole 4 MiB piece arrives as two huge
pages, one page-table entry each, both for the move and for compute's TLB.
Releasing a piece moves its pages back to the pool and maps the file there again, so the range
is ordinary cold file-backed memory. Both moves use MREMAP_DONTUNMAP, and the file is mapped
back with MAP_FIXED over what remains, so no address in the mapping is ever a hole that another
mmap could be given; where a failed call may have left one anyway, the file goes back only with
MAP_FIXED_NOREPLACE (``_refill``), never over memory that is not ours. Between the two steps of
a release the range reads as zeros: the streamer releases only ranges no one computes with, and
a read of the same range waits for the release to finish (streaming.Dropper), so no one sees it. The partial pages at a shard's two ends share a page with its neighbours
and stay file-backed (the caller faults them in the ordinary way).

Routed experts take a shorter way (``place_slice``): their slices (~5.85 MB at Kimi K3's size)
start anywhere in a 4 MiB block, so a pool buffer would hold the rest of its pages for nothing.
The whole pages of a slice become anonymous memory in place (mmap MAP_FIXED over the mapping,
huge pages asked for) and the O_DIRECT read lands there: resident memory is exactly the bytes
read. The range reads as zeros only while its own read runs, and the engine never lets compute
at a slice before its read is done. Its end pages, shared with the neighbouring slices, come in
the same read into memory of their own and are moved into place after it, so a page a
neighbour may be using never reads as zeros. Releasing maps the file there again.

Where slices are small (under a huge page: the MoE models a phone runs well, whose experts are
tens of KiB), those mapping calls were most of a prompt's time: two or three per slice and one
per release, each holding the process's mappings lock against the others and each making every
CPU flush its TLB. There the routed tensors' whole pages become one *arena* of anonymous memory
when streaming starts (``make_arena``): a slice is read straight into its place, shared end
pages too (a page a neighbour holds is not read again, and a neighbour that finds a page held
waits for the read that brings it), and given back with MADV_DONTNEED. Unplaced experts read as
zeros there, which no one sees: compute reads only routed experts, and only after their reads.
Huge pages stay off in the arena (a fault would zero 2 MiB around a 30 KiB slice).
Where an arena slice is large (a MiB: a 4 GiB MoE's), a read into memory never touched faults in
and zeroes every page before the disk is even asked: 2-4 ms of a decoded token's 1 MiB read that
the disk served in 1, on the cores compute needs, while the expert cache fills. There the cache
lends its free room to ``SparePages``, faulted in on an I/O thread once the prompt is done, and
each large read has spare pages moved under it first: one mapping call instead of a fault a page.

Where the file system refuses O_DIRECT (tmpfs, some FUSE mounts) the same placer reads through
an ordinary descriptor and drops the page-cache copy after each read (POSIX_FADV_DONTNEED; on
tmpfs the cache is the file itself and stays): one more copy than a direct read, but the bytes
compute uses are still anonymous memory, so a file cut short (a USB cable bumped) cannot SIGBUS
compute, and resident memory is still what the budget counts.

Darwin/iOS has neither O_DIRECT nor mremap: darwin_placer.py does the same there with
F_NOCACHE and mach_vm_remap.
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import os
import threading
from collections.abc import Callable, Iterable

from kimitui.engine.budget import PAGE, PIECE_BYTES
from kimitui.engine.platform import (
    HUGE_ALIGN, MAP_ANONYMOUS, MAP_FAILED, MAP_FIXED, MAP_PRIVATE, MAP_SHARED, PROT_READ, PROT_WRITE, bind_mmap,
    reserve_aligned,
)

MREMAP_MAYMOVE, MREMAP_FIXED, MREMAP_DONTUNMAP = 1, 2, 4
MADV_HUGEPAGE, MADV_NOHUGEPAGE = 14, 15
MADV_DONTNEED, MADV_POPULATE_WRITE = 4, 23
MAP_FIXED_NOREPLACE = 0x100000
MAP_NORESERVE = 0x4000


class Libc:
    def __init__(self) -> None:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        self.mmap, self.munmap = bind_mmap(libc)
        self.mremap = libc.mremap
        self.mremap.restype = ctypes.c_void_p
        self.mremap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
        self.madvise = libc.madvise
        self.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)

    @staticmethod
    def check(result, what: str) -> int:
        """``result`` of mmap or mremap, or OSError."""
        if result in (None, MAP_FAILED):
            err = ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")
        return result


def huge_buffer(libc: Libc, size: int) -> int:
    """Anonymous memory on a huge-page boundary, huge pages asked for: an O_DIRECT read into
    it goes to the disk as a few large requests (254 segments of one 4 KiB page each cap a
    request at about 1 MiB here), and ran at twice the rate of one into 4 KiB pages."""
    start = libc.check(
        reserve_aligned(libc.mmap, libc.munmap, size, HUGE_ALIGN, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS), "mmap"
    )
    libc.madvise(start, size, MADV_HUGEPAGE)
    return start


def small_page_buffer(libc: Libc, size: int) -> int:
    """Anonymous memory in small pages, even where THP is "always"; OSError where none is had."""
    buf = libc.check(libc.mmap(None, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0), "mmap")
    libc.madvise(buf, size, MADV_NOHUGEPAGE)
    return buf


def fault_in(libc: Libc, buf: int, size: int) -> None:
    """Every page of [buf, buf+size) faulted in now: a read into untouched memory would pay for it."""
    if libc.madvise(buf, size, MADV_POPULATE_WRITE) != 0:
        ctypes.memset(buf, 0, size)


def mapped_areas() -> list[tuple[int, int, tuple[int, int] | None, int]]:
    """This process's mappings from /proc/self/maps: (start, end, (st_dev, st_ino) of the file
    mapped, None for anonymous memory, the file offset mapped at start)."""
    out = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            major, minor = (int(x, 16) for x in fields[3].split(":"))
            inode = int(fields[4])
            out.append((lo, hi, (os.makedev(major, minor), inode) if inode else None, int(fields[2], 16)))
    return out


def split_pieces(offset: int, end: int, page: int) -> list[tuple[int, int, bool]]:
    """[offset, end) as (start, length, placed): whole pages in pieces of at most PIECE_BYTES
    that start on multiples of it (placed), and the partial pages at either end (not placed)."""
    inner_start = -(-offset // page) * page
    inner_end = end // page * page
    if inner_end - inner_start <= 0:
        return [(offset, end - offset, False)]
    out = []
    if offset < inner_start:
        out.append((offset, inner_start - offset, False))
    start = inner_start
    while start < inner_end:
        stop = min(inner_end, (start // PIECE_BYTES + 1) * PIECE_BYTES)
        out.append((start, stop - start, True))
        start = stop
    if inner_end < end:
        out.append((inner_end, end - inner_end, False))
    return out


def read_gaps(offset: int, length: int, inners, edges, page: int) -> list[tuple[int, int]]:
    """What a read of [offset, offset+length) holds between its slices' own pages (``inners``,
    (start, size)) and shared end pages (``edges``): (start, size) of each gap read through."""
    gaps, at = [], offset
    for start, size in sorted(list(inners) + [(edge, page) for edge in edges]):
        if start > at:
            gaps.append((at, start - at))
        at = start + size
    if offset + length > at:
        gaps.append((at, offset + length - at))
    return gaps


class SparePages:
    """Anonymous memory faulted in ahead of the reads that will land on it (see the module doc).

    How much it may hold is the expert cache's to say, out of its free room: ``allow`` lends it
    more (``fill`` then faults that much in, on an I/O thread), ``free`` takes room back at once,
    and ``earmark`` sets aside held pages the reads just issued will take, which ``free`` leaves
    alone until ``settle``, once those reads have landed, gives up what they did not take. What
    it holds, and what ``fill`` is faulting in, never pass what is allowed and earmarked, so the
    cache's books (its experts and ``allowed``) bound the memory."""

    RUN = 2**20  # faulted in at a time: ``free`` waits at most for one

    def __init__(self, libc: "Libc") -> None:
        self._libc = libc
        self._runs: list[tuple[int, int]] = []  # (address, length), faulted in
        self.held = 0
        self.allowed = 0
        self.earmarked = 0
        self._filling = 0  # the run being faulted in now
        self._changed = threading.Condition()

    def allow(self, length: int) -> None:
        with self._changed:
            self.allowed += length

    def fill(self) -> None:
        """Fault in runs until what is allowed is held (or ``free`` lowers it meanwhile)."""
        c = self._libc
        while True:
            with self._changed:
                # Earmarked pages are held already (``earmark``): what is allowed bounds the rest.
                if self._filling or self.held - self.earmarked + self.RUN > self.allowed:
                    return
                self._filling = self.RUN
            kept = False
            try:
                try:
                    address = small_page_buffer(c, self.RUN)  # moved a page at a time under slices
                except OSError:
                    return
                fault_in(c, address, self.RUN)
                with self._changed:
                    kept = self.held - self.earmarked + self.RUN <= self.allowed
                    if kept:
                        self._runs.append((address, self.RUN))
                        self.held += self.RUN
                if not kept:  # lowered while it was faulted in: gone before ``free`` hears of it
                    c.munmap(address, self.RUN)
            finally:
                with self._changed:
                    self._filling = 0
                    self._changed.notify_all()
            if not kept:
                return

    def earmark(self, length: int) -> None:
        """Set aside ``length`` bytes of held pages (as many as there are) for the reads just issued."""
        with self._changed:
            moved = min(length, self.allowed, self.held - self.earmarked)
            self.allowed -= moved
            self.earmarked += moved

    def take(self, length: int) -> list[tuple[int, int]]:
        """Up to ``length`` bytes of held runs (page multiples), now the caller's to move."""
        taken: list[tuple[int, int]] = []
        with self._changed:
            want = length
            while want and self._runs:
                address, size = self._runs.pop()
                part = min(size, want)
                if size > part:
                    self._runs.append((address + part, size - part))
                taken.append((address, part))
                want -= part
            got = length - want
            self.held -= got
            from_earmark = min(got, self.earmarked)
            self.earmarked -= from_earmark
            self.allowed -= min(got - from_earmark, self.allowed)
        return taken

    def free(self, length: int) -> None:
        """Take ``length`` bytes of room back (of what is allowed), its pages freed before this returns."""
        with self._changed:
            self.allowed -= min(length, self.allowed)
        self._trim()

    def settle(self) -> None:
        """The reads earmarks were for have landed: what they left is given up."""
        with self._changed:
            if not self.earmarked:
                return
            self.earmarked = 0
        self._trim()

    def close(self) -> None:
        with self._changed:
            self.allowed = self.earmarked = 0
        self._trim()

    def _trim(self) -> None:
        """Free held pages past what is allowed and earmarked, waiting for a run being faulted in."""
        while True:
            with self._changed:
                over = self.held + self._filling - self.allowed - self.earmarked
                if over <= 0:
                    return
                if self.held == 0:
                    self._changed.wait()  # the run being faulted in: fill drops it when it sees
                    continue
                address, size = self._runs.pop()
                part = min(size, -(-over // PAGE) * PAGE)
                if size > part:
                    self._runs.append((address, size - part))
                self.held -= part
            self._libc.munmap(address + size - part, part)


class PlacedParts:
    """What every placer keeps: the parts of the mapping that are its anonymous memory, keyed
    (file, offset), given back through ``_unplace``."""

    page: int
    _lock: threading.Lock
    _placed: dict
    _parked: dict
    _file_fds: dict[int, int]

    # The widest stretch between two slices that one request may read through into scratch
    # memory instead of ending there (0: this placer reads only what it is asked).
    gap_bytes = 0
    # Memory faulted in ahead for large reads in the arena (None: this placer keeps none).
    spare: SparePages | None = None
    # Whether ranges it has not placed may be paged into the file mapping under compute instead
    # (Streamer._can_page_in): its releases leave only the file's pages there, which the page
    # cache's drop then frees.
    pages_in = False

    def holds(self, file: int, offset: int) -> bool:
        with self._lock:
            return (file, offset) in self._placed or (file, offset) in self._parked

    def free_idle_buffers(self) -> None:
        """Give the read pool's free buffers back to the system (a placer without a pool has none)."""

    def make_arena(self, segments: dict[int, list[tuple[int, int]]]) -> bool:
        """Anonymous memory over ``segments`` (file -> [(lo, hi)], whole pages), slices read
        into it in place: False where this placer cannot (it keeps mapping each slice)."""
        return False

    @property
    def reads_in_place(self) -> bool:
        """Whether a shared end page reads as zeros until its read lands (the arena), so a
        slice that finds it held must wait for that read."""
        return False

    def park(self, file: int, offset: int) -> bool:
        """Keep a part read in place while its slot is taken over (the bounded layout): False
        where this placer cannot, and the caller gives it back instead."""
        return False

    def unpark(self, file: int, offset: int) -> bool:
        """A parked part back at its place (its layer took its slot again); False where it is
        not parked any more, or cannot be moved back (given back then: read it again)."""
        return False

    @property
    def parked_bytes(self) -> int:
        with self._lock:
            return sum(length for _address, length in self._parked.values())

    def release_in_place(self, file: int, offset: int) -> None:
        """Give one part read in place back to the file (its anonymous pages are freed)."""
        self._unplace(file, offset)

    def release_many(self, file: int, parts: list[tuple[int, int]]) -> tuple[list[tuple[int, int]], OSError | None]:
        """Give back many parts read in place, (offset, length) each. Each is tried: returns the
        ones it does not hold (read through the page cache: the caller drops those) and the
        first failure (that part stays placed)."""
        rest, failure = [], None
        for offset, length in parts:
            if not self.holds(file, offset):
                rest.append((offset, length))
                continue
            try:
                self._unplace(file, offset)
            except OSError as exc:
                failure = failure or exc
        return rest, failure

    def release(self, file: int, offset: int, length: int) -> None:
        """Give every placed piece inside [offset, offset+length) back to the file. Raises
        OSError if one cannot be; that piece then stays placed, its bytes still right."""
        for start, _size, placed in split_pieces(offset, offset + length, self.page):
            if placed:
                self._unplace(file, start)

    def _unplace(self, file: int, offset: int) -> None:
        raise NotImplementedError

    def _complete(self, file: int, offset: int, got: int, length: int) -> bool:
        """Whether a read of ``length`` that gave ``got`` has all there is: the file may end
        inside the last page."""
        return got == length or offset + got >= os.fstat(self._file_fds[file]).st_size


class DirectPlacer(PlacedParts):
    """Reads whole pages of the model files with O_DIRECT (where the file system refuses it,
    through the page cache) into pooled anonymous buffers and
    moves them into the model's mapping; ``release`` gives the range back to the file."""

    # A read that finds the pool spent waits this long for a buffer on its way back from a
    # release (the dropper runs beside compute) before it goes through the page cache instead.
    WAIT_FOR_BUFFER_S = 0.5
    pages_in = True
    # A prompt's experts are scattered slices with short gaps between them (a 32-token prompt
    # routes to about 40% of a small-expert layer). Where a disk serves such reads at a tenth of
    # its sequential rate, a request costs what some hundred KiB cost in sequence (about 300 KiB
    # here, 200 KiB on a 1 GB/s link), so a gap of up to this much is read into scratch memory.
    gap_bytes = 128 * 2**10
    # Arena parts from this size on have spare pages moved under them (below it the mapping
    # call, which flushes every CPU's TLB, costs more than the faults it saves).
    spare_from = 256 * 2**10
    # Parts with spare pages moved under them at once at most: each is an area of the process's
    # own (and splits the arena's) while resident, and Linux allows 65,530 areas in all.
    moved_most = 8192

    def __init__(self, paths: list[str], space, file_fds: dict[int, int], capacity: int) -> None:
        self.page = os.sysconf("SC_PAGE_SIZE")
        self._libc = Libc()
        self.space = space  # addressing.WholeFiles or Windows: where each byte of the model is
        # The file is mapped back through these: best the very open file that llama.cpp mapped,
        # whose mapping the range then merges back into. Any other open file of it works, but
        # leaves a kernel mapping per range (Linux allows 65,530), ruinous on a terabyte model.
        self._file_fds = file_fds
        self._direct_fds: dict[int, int] = {}
        self._buffered: set[int] = set()  # files read through the page cache (no O_DIRECT there)
        self._retired: list[int] = []  # O_DIRECT descriptors replaced by buffered ones, closed at close()
        self._switch = threading.Lock()  # held while a file's descriptor is replaced
        self._capacity = capacity  # pool buffers at most
        # A pool smaller than its window needs (the budget holds no more): a piece that finds it
        # spent goes through the page cache at once instead of waiting for a buffer.
        self.short = False
        # Buffer addresses, faulted in, ready for a read: huge pages for whole pieces, which
        # move into the (2 MiB-aligned, see loadhooks) mapping as whole huge pages; small pages
        # for the partial pieces at shard ends, whose moves would split a huge page for good.
        self._free: dict[bool, list[int]] = {True: [], False: []}
        self._made = 0
        # (file, offset) -> (buffer, where in it, length, whole)
        self._placed: dict[tuple[int, int], tuple[int, int, int, bool]] = {}
        # (file, offset) -> the same, for the pieces of a layer read whole in the arena
        self._pieces: dict[tuple[int, int], tuple[int, int, int, bool]] = {}
        # (file, offset) -> (address, length): parts read in place, moved out of a slot another
        # layer has taken (the bounded layout), until theirs takes it again
        self._parked: dict[tuple[int, int], tuple[int, int]] = {}
        self._lock = threading.Lock()
        self._returned = threading.Condition(self._lock)
        # Held across each move into the mapping and its record, and across blank_file_backed:
        # a blank that read /proc/self/maps just before a move would map zeros over the pages
        # just moved there, and their release would take the zeros' read-only memory into the pool.
        self._moves = threading.Lock()
        self._scratch: int | None = None  # where gaps are read to (below)
        self.spare = SparePages(self._libc)
        self._moved: set[int] = set()  # addresses of the parts spare pages were moved under
        self._paths = paths
        # file -> (sorted starts, ends) of the arena's segments (see make_arena)
        self._arena: dict[int, tuple[list[int], list[int]]] = {}
        try:
            for i, path in enumerate(paths):
                try:
                    self._direct_fds[i] = self._open(path, file_fds.get(i), os.O_DIRECT)
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    self._direct_fds[i] = self._buffered_fd(path, file_fds.get(i))
                    self._buffered.add(i)
        except OSError:
            self.close()
            raise
        # Where gaps are read to (page-aligned for O_DIRECT; their bytes are never used, so
        # concurrent reads share it).
        scratch = self._libc.mmap(None, self.gap_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
        if scratch in (None, MAP_FAILED):
            err = ctypes.get_errno()
            self.close()
            raise OSError(err, f"mmap of the gap buffer: {os.strerror(err)}")
        self._scratch = scratch

    @staticmethod
    def _open(path: str, mapped_fd: int | None, flags: int) -> int:
        """The same file as ``mapped_fd`` (what the mapping holds, even if the path now names a
        new file), opened again with ``flags``; by path where /proc is not there."""
        if mapped_fd is not None:
            try:
                return os.open(f"/proc/self/fd/{mapped_fd}", os.O_RDONLY | flags)
            except FileNotFoundError:
                pass
        return os.open(path, os.O_RDONLY | flags)

    @classmethod
    def _buffered_fd(cls, path: str, mapped_fd: int | None) -> int:
        """A descriptor through the page cache with the kernel's read-ahead off: it would turn a
        5.85 MB expert slice into megabytes more, read for nothing."""
        fd = cls._open(path, mapped_fd, 0)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        except OSError:
            os.close(fd)
            raise
        return fd

    @property
    def direct(self) -> bool:
        """Whether every file is read with O_DIRECT (else some go through the page cache)."""
        return not self._buffered

    def _read(self, file: int, views: list, offset: int) -> int:
        """preadv into ``views``. A file system that took O_DIRECT at open but refuses the read
        (EINVAL) has the file read through the page cache from then on: the first reader to
        meet it opens the buffered descriptor, and readers that failed on the old one meanwhile
        retry on it. A replaced descriptor stays open until ``close``, so a reader that picked
        its number just before never reads someone else's file."""
        fd = self._direct_fds.get(file)
        if fd is None:
            raise OSError(errno.EBADF, "this placer reads no more (done_reading)")
        try:
            got = os.preadv(fd, views, offset)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            with self._switch:
                if self._direct_fds.get(file) != fd:
                    pass  # another reader switched the file already
                elif file in self._buffered:
                    raise  # the buffered descriptor itself refuses: a real error
                else:
                    self._direct_fds[file] = self._buffered_fd(self._paths[file], self._file_fds.get(file))
                    self._retired.append(fd)
                    self._buffered.add(file)
            fd = self._direct_fds[file]
            got = os.preadv(fd, views, offset)
        if file in self._buffered and got > 0:
            # The copy is ours now: the cache's would be memory the budget does not see (on
            # tmpfs the cache is the file itself, and nothing is dropped).
            os.posix_fadvise(fd, offset, got, os.POSIX_FADV_DONTNEED)
        return got

    def done_reading(self) -> None:
        """Close the read descriptors of a placer that will read no more (the pinned set's, once
        every read has returned): what it placed is still given back through the mapping's own
        descriptors, and a split set of 46 files keeps 46 fewer open."""
        with self._switch:
            fds, self._direct_fds = list(self._direct_fds.values()) + self._retired, {}
            self._retired = []
        for fd in fds:
            os.close(fd)

    @classmethod
    def create(cls, paths: list[str], space, file_fds: dict[int, int], capacity: int) -> "DirectPlacer | None":
        """None where this system cannot do it (a kernel without MREMAP_DONTUNMAP, a file that
        cannot be opened again): the engine then reads through the page cache."""
        try:
            placer = cls(paths, space, file_fds, capacity)
        except OSError:
            return None
        if not placer._can_move():
            placer.close()
            return None
        return placer

    def _can_move(self) -> bool:
        """MREMAP_DONTUNMAP (Linux 5.7) on two scratch pages."""
        c, page = self._libc, self.page
        try:
            src = c.check(c.mmap(None, page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0), "mmap")
            dst = c.check(c.mmap(None, page, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0), "mmap")
        except OSError:
            return False
        ctypes.memset(src, 7, 1)
        moved = c.mremap(src, page, page, MREMAP_MAYMOVE | MREMAP_FIXED | MREMAP_DONTUNMAP, dst)
        ok = moved == dst and ctypes.string_at(dst, 1) == b"\x07"
        c.munmap(src, page)
        c.munmap(dst, page)
        return ok

    # -- the pool -----------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self._capacity

    @capacity.setter
    def capacity(self, buffers: int) -> None:
        """A smaller pool gives its spare buffers back to the system at once."""
        with self._lock:
            self._capacity = buffers
            spare = []
            for free in self._free.values():
                while free and self._made > buffers:
                    spare.append(free.pop())
                    self._made -= 1
            self._returned.notify_all()
        for buf in spare:
            self._libc.munmap(buf, PIECE_BYTES)

    def _take(self, whole: bool) -> int | None:
        free, other = self._free[whole], self._free[not whole]
        with self._returned:
            if not free and not other and self._made >= self._capacity and not self.short:
                self._returned.wait_for(lambda: free or other or self._made < self._capacity, self.WAIT_FOR_BUFFER_S)
            if free:
                return free.pop()
            if self._made < self._capacity:
                self._made += 1
            elif other:  # room only in the other kind: one of it makes way for one of ours
                self._libc.munmap(other.pop(), PIECE_BYTES)
            else:
                return None
        c = self._libc
        try:
            buf = huge_buffer(c, PIECE_BYTES) if whole else small_page_buffer(c, PIECE_BYTES)
        except OSError:
            with self._returned:
                self._made -= 1
                self._returned.notify_all()
            return None
        fault_in(c, buf, PIECE_BYTES)  # once: a buffer is read into again and again
        return buf

    def _give_back(self, buf: int, whole: bool) -> None:
        with self._returned:
            if self._made <= self._capacity:
                self._free[whole].append(buf)
                self._returned.notify_all()
                return
            self._made -= 1
        self._libc.munmap(buf, PIECE_BYTES)

    def free_idle_buffers(self) -> None:
        """The budget counts the pool as the streamed window's memory: where the window is paged
        in through the file instead (a prompt's trunk), buffers left idle by the last token go."""
        with self._lock:
            free = self._free[True] + self._free[False]
            for kind in self._free.values():
                kind.clear()
            self._made -= len(free)
            self._returned.notify_all()
        for buf in free:
            self._libc.munmap(buf, PIECE_BYTES)

    def buffer_spans(self) -> list[tuple[int, int]]:
        """Every pool buffer's address range, free or lent: what of them is resident is memory
        beside the model's pages (a placed piece's pages are in the mapping, not here)."""
        with self._lock:
            bufs = self._free[True] + self._free[False] + [entry[0] for entry in (*self._placed.values(), *self._pieces.values()) if entry[0]]
        return [(buf, buf + PIECE_BYTES) for buf in bufs]

    # -- the arena ---------------------------------------------------------------------------

    def make_arena(self, segments: dict[int, list[tuple[int, int]]]) -> bool:
        """Map anonymous memory over each segment (file offsets, whole pages no one has placed
        anything in yet). Where a call fails, that segment stays the file's and the ones done
        are the arena (each slice is placed by whichever way its pages lie); False then."""
        c = self._libc
        done: dict[int, list[tuple[int, int]]] = {}
        whole = True
        for file, spans in segments.items():
            for lo, hi in spans:
                at = self.space.at(file, lo)
                if c.mmap(at, hi - lo, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0) != at:
                    self._refill(file, lo, hi - lo, ctypes.get_errno())  # the kernel may have unmapped it first
                    whole = False
                    continue
                c.madvise(at, hi - lo, MADV_NOHUGEPAGE)  # even where THP is "always"
                done.setdefault(file, []).append((lo, hi))
        for file, spans in done.items():
            spans.sort()
            self._arena[file] = ([lo for lo, _ in spans], [hi for _, hi in spans])
        return whole and bool(done)

    @property
    def reads_in_place(self) -> bool:
        return bool(self._arena)

    def release_many(self, file: int, parts: list[tuple[int, int]]) -> tuple[list[tuple[int, int]], OSError | None]:
        """In the arena, parts that lie side by side are freed in one call and the records are taken
        under one lock (a prompt's chunk evicts hundreds of slices at once); the rest one by one."""
        with self._lock:
            taken = sorted(
                (offset, self._placed.pop((file, offset)))
                for offset, _ in parts
                if (entry := self._placed.get((file, offset))) is not None
                and entry[0] == 0
                and self._in_arena(file, offset, offset + entry[2])
            )
        spans: list[list] = []  # [start, end, the records taken]
        for offset, entry in taken:
            if spans and spans[-1][1] == offset:
                spans[-1][1] += entry[2]
                spans[-1][2].append((offset, entry))
            else:
                spans.append([offset, offset + entry[2], [(offset, entry)]])
        failure = None
        for start, end, records in spans:
            if self._free_in_arena(self.space.at(file, start), end - start, [self.space.at(file, offset) for offset, _ in records]):
                continue
            # Each on its own then: only a part that cannot be given back stays placed (counted
            # in placed_bytes until it is read again or the placer closes).
            for offset, entry in records:
                if not self._free_in_arena(self.space.at(file, offset), entry[2]):
                    err = ctypes.get_errno()
                    with self._lock:
                        self._placed[(file, offset)] = entry
                    failure = failure or OSError(err, f"freeing {entry[2]} bytes of the arena: {os.strerror(err)}")
        taken_offsets = {offset for offset, _ in taken}
        rest, other = super().release_many(file, [part for part in parts if part[0] not in taken_offsets])
        return rest, failure or other

    def in_arena(self, file: int, lo: int, hi: int) -> bool:
        """Whether [lo, hi) of ``file`` lies in one segment of the arena."""
        return self._in_arena(file, lo, hi)

    def place_in_arena(self, file: int, offset: int, length: int) -> int:
        """``place`` for a piece of a layer read whole, in the arena: a whole piece through a pool
        buffer (huge pages, moved into place), a partial one, or one that finds the pool spent,
        read in place. Kept apart from the slices' records (a slice's own pages may start where a
        piece does) until ``release_pieces``. Returns the bytes read; OSError for a failed read."""
        with self._lock:
            if (file, offset) in self._pieces:
                return length
        whole = length == PIECE_BYTES
        buf = self._take(True) if whole else None
        c, target = self._libc, self.space.at(file, offset)
        at = offset % PIECE_BYTES
        views = [memoryview((ctypes.c_char * length).from_address((buf + at) if buf else target)).cast("B")]
        try:
            got = self._read(file, views, offset)
        except OSError:
            if buf:
                self._give_back(buf, whole)
            else:
                c.madvise(target, length, MADV_DONTNEED)
            raise
        if not buf:
            with self._lock:
                self._pieces[(file, offset)] = (0, 0, length, False)
            return got
        if got != length:
            self._give_back(buf, whole)
            return got
        with self._moves:
            if c.mremap(buf + at, length, length, MREMAP_MAYMOVE | MREMAP_FIXED | MREMAP_DONTUNMAP, target) != target:
                err = ctypes.get_errno()
                self._give_back(buf, whole)
                self._arena_over(target, length, replace=False)  # where the kernel unmapped it first
                raise OSError(err, f"mremap: {os.strerror(err)}")
            with self._lock:
                self._pieces[(file, offset)] = (buf, at, length, whole)
        return length

    def _move_spare(self, target: int, length: int) -> None:
        """Spare pages under [target, target+length) of the arena, as many as there are (the rest
        faults in as the read lands). Moved pages are an area of their own until the part is
        freed: past ``moved_most`` parts holding them, the rest fault in instead."""
        with self._lock:
            if len(self._moved) >= self.moved_most:
                return
        runs = self.spare.take(length)
        if not runs:
            return
        with self._lock:
            self._moved.add(target)
        c, at = self._libc, target
        for address, size in runs:
            if c.mremap(address, size, size, MREMAP_MAYMOVE | MREMAP_FIXED, at) != at:
                c.munmap(address, size)
                self._arena_over(at, size, replace=False)  # into a hole the failed call may have left
            at += size

    def _free_in_arena(self, target: int, length: int, starts: Iterable[int] = ()) -> bool:
        """Free the pages of [target, target+length) (the parts starting at ``starts``, all of
        it by default), the arena empty there. Where spare pages were moved under a part it is an
        area of its own: fresh arena memory over it merges it back (else each would stay one, and
        Linux allows 65,530); elsewhere one madvise frees the pages."""
        c = self._libc
        with self._lock:
            moved = [at for at in (starts or (target,)) if at in self._moved]
            self._moved.difference_update(moved)
        if moved and self._arena_over(target, length):
            return True
        return c.madvise(target, length, MADV_DONTNEED) == 0

    def _arena_over(self, target: int, length: int, replace: bool = True) -> bool:
        """Fresh arena memory (anonymous, no huge pages) at [target, target+length): over the area
        there (``replace``: ours), or only into a hole a failed call left (never over another's
        mapping). True where the range is the arena's now."""
        c = self._libc
        flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE
        if not replace or c.mmap(target, length, PROT_READ | PROT_WRITE, flags | MAP_FIXED, -1, 0) != target:
            got = c.mmap(target, length, PROT_READ | PROT_WRITE, flags | MAP_FIXED_NOREPLACE, -1, 0)
            if got not in (None, MAP_FAILED, target):  # a kernel before 4.17 took the flag as a hint
                c.munmap(got, length)
            if got != target:
                return False
        return c.madvise(target, length, MADV_NOHUGEPAGE) == 0

    def release_pieces(self, file: int, lo: int, hi: int) -> None:
        """Give back the pieces ``place_in_arena`` placed inside [lo, hi) of ``file``: each pool
        buffer's pages back to it, a piece read in place freed; the arena is empty anonymous
        memory there again. Each piece is tried; the first failure is raised after (that piece
        stays placed)."""
        c = self._libc
        with self._lock:
            pieces = [
                (start, entry) for start, _size, placed in split_pieces(lo, hi, self.page)
                if placed and (entry := self._pieces.pop((file, start), None)) is not None
            ]
        failure = None
        for start, entry in pieces:
            buf, at, length, whole = entry
            target = self.space.at(file, start)
            if not buf:
                if c.madvise(target, length, MADV_DONTNEED) != 0:
                    failure = failure or OSError(ctypes.get_errno(), f"madvise(MADV_DONTNEED) of {length} bytes")
                continue
            if c.mremap(target, length, length, MREMAP_MAYMOVE | MREMAP_FIXED | MREMAP_DONTUNMAP, buf + at) != buf + at:
                err = ctypes.get_errno()
                with self._lock:
                    self._pieces[(file, start)] = entry
                failure = failure or OSError(err, f"mremap: {os.strerror(err)}")
                continue
            # The range left behind is an area of its own, the pool buffer's, huge pages allowed:
            # fresh arena memory over it instead (no huge pages: a 30 KiB slice read there later
            # would fault in 2 MiB), which the kernel merges with the arena about it, so a long
            # prompt leaves no area per piece behind.
            if not self._arena_over(target, length):
                failure = failure or OSError(ctypes.get_errno(), f"mapping the arena again over {length} bytes")
            self._give_back(buf, whole)
        if failure is not None:
            raise failure

    def _in_arena(self, file: int, lo: int, hi: int) -> bool:
        spans = self._arena.get(file)
        if spans is None:
            return False
        i = bisect.bisect_right(spans[0], lo) - 1
        return i >= 0 and hi <= spans[1][i]

    def _gaps(self, offset: int, length: int, inners, edges) -> list[tuple[int, int]]:
        """What one read of several slices passes over between them, read into the scratch
        buffer; ValueError for a gap wider than it."""
        gaps = read_gaps(offset, length, inners, edges, self.page)
        if any(size > self.gap_bytes for _, size in gaps):
            raise ValueError(f"a read of {length} bytes at {offset} has a gap wider than {self.gap_bytes}")
        return gaps

    def _read_into(self, file: int, offset: int, length: int, targets, gaps, undo: Callable[[], None]) -> tuple[int, bool]:
        """One read of [offset, offset+length) into ``targets`` ((file offset, address, size))
        and ``gaps`` (into scratch): (bytes read, whether that is all there is). ``undo`` runs
        where the read fails or comes short."""
        pieces = sorted(targets + [(start, self._scratch, size) for start, size in gaps])
        views = [memoryview((ctypes.c_char * n).from_address(address)).cast("B") for _, address, n in pieces]
        try:
            got = self._read(file, views, offset)
        except OSError:
            undo()
            raise
        whole = self._complete(file, offset, got, length)
        if not whole:
            undo()
        return got, whole

    def _read_in_arena(self, file: int, offset: int, length: int, inners, edges) -> int | None:
        """``place_slice`` where the slices' own pages lie in the arena: one read straight into
        place, with no mapping call, but for a shared end page outside it (next to a trunk
        tensor), which is read into a page of its own and moved in after, as ``copy_in`` does."""
        c, page = self._libc, self.page
        base = self.space.at(file, offset) - offset
        gaps = self._gaps(offset, length, inners, edges)
        buffers: dict[int, int] = {}
        in_place = [(start, size) for start, size in inners]
        for edge in edges:
            if self._in_arena(file, edge, edge + page):
                in_place.append((edge, page))
            else:
                buf = c.mmap(None, page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
                if buf in (None, MAP_FAILED):
                    err = ctypes.get_errno()
                    for b in buffers.values():
                        c.munmap(b, page)
                    raise OSError(err, f"mmap: {os.strerror(err)}")
                buffers[edge] = buf

        def undo() -> None:  # nothing half-read stays resident
            for b in buffers.values():
                c.munmap(b, page)
            for start, size in in_place:
                self._free_in_arena(base + start, size)

        for start, size in in_place:
            if size >= self.spare_from:
                self._move_spare(base + start, size)
        targets = [(start, base + start, size) for start, size in in_place] + [(edge, buf, page) for edge, buf in buffers.items()]
        got, whole = self._read_into(file, offset, length, targets, gaps, undo)
        if not whole:
            return got
        if buffers:
            with self._moves:
                for edge, buf in list(buffers.items()):
                    del buffers[edge]
                    if c.mremap(buf, page, page, MREMAP_MAYMOVE | MREMAP_FIXED, base + edge) != base + edge:
                        err = ctypes.get_errno()
                        c.munmap(buf, page)
                        self._refill(file, edge, page, err)  # the kernel may have unmapped the target first
                        undo()
                        raise OSError(err, f"mremap: {os.strerror(err)}")
                    with self._lock:  # in place, the file's bytes: given back as any placed page
                        self._placed[(file, edge)] = (0, 0, page, False)
        with self._lock:
            for start, size in in_place:
                self._placed[(file, start)] = (0, 0, size, False)
        return length

    # -- placing and releasing -------------------------------------------------------------

    def place(self, file: int, offset: int, length: int) -> int | None:
        """Read [offset, offset+length) (whole pages, within one piece) into the mapping.
        Returns the bytes read (short at the end of the file), or None where the caller must
        read through the page cache instead (the pool spent, no mapping left to split). Raises
        OSError for a failed read."""
        with self._lock:
            if (file, offset) in self._placed:
                return length  # still there: a release was cancelled by a read asked for again
        whole = length == PIECE_BYTES
        buf = self._take(whole)
        if buf is None:
            return None
        # The same place within the buffer as within the file's 4 MiB block, so that source
        # and target agree modulo a huge page and mremap can move huge pages whole.
        at = offset % PIECE_BYTES
        try:
            view = (ctypes.c_char * length).from_address(buf + at)
            got = self._read(file, [memoryview(view).cast("B")], offset)
        except OSError:
            self._give_back(buf, whole)
            raise
        if got != length:
            self._give_back(buf, whole)
            return got
        target = self.space.at(file, offset)
        c = self._libc
        with self._moves:
            moved = c.mremap(buf + at, length, length, MREMAP_MAYMOVE | MREMAP_FIXED | MREMAP_DONTUNMAP, target) == target
            err = ctypes.get_errno()
            if moved:
                with self._lock:
                    self._placed[(file, offset)] = (buf, at, length, whole)
                if not whole:  # the rest of a partial piece's buffer holds nothing: its pages go
                    for lo, hi in ((0, at), (at + length, PIECE_BYTES)):
                        if hi > lo:
                            c.madvise(buf + lo, hi - lo, MADV_DONTNEED)
            else:
                # ENOMEM, most likely (too many mappings, a memory limit). The kernel may have
                # unmapped the target before it failed: the file goes back there, never over another's.
                self._refill(file, offset, length, err)
        if not moved:
            self._give_back(buf, whole)
            return None
        return length

    def place_slice(self, file: int, offset: int, length: int, inners: list[tuple[int, int]], edges: list[int]) -> int | None:
        """One read of [offset, offset+length), the pieces of one expert slice or of several
        that follow each other in the file: each slice's own whole pages (``inners``) straight
        into fresh anonymous memory at their place (huge pages asked for; they read as zeros
        only while this read runs, and no one computes with them before it is done), the shared
        end pages ``edges`` into memory of their own, moved into place after the read in one
        step each (as ``copy_in``), so a shared page never reads as zeros. One request for all
        of them. Returns the bytes read, or None where the caller must read through the page
        cache (no mapping to be had)."""
        if self._arena and all(self._in_arena(file, start, start + size) for start, size in inners):
            return self._read_in_arena(file, offset, length, inners, edges)
        c, page = self._libc, self.page
        base = self.space.at(file, offset) - offset  # the slices lie in one run of their layer: offsets map linearly
        gaps = self._gaps(offset, length, inners, edges)
        mapped: list[tuple[int, int]] = []
        buffers: dict[int, int] = {}

        def undo() -> None:
            for b in buffers.values():
                c.munmap(b, page)
            for start, size in mapped:
                self._map_file(file, start, size)

        for start, size in inners:
            if c.mmap(base + start, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) in (None, MAP_FAILED):
                err = ctypes.get_errno()
                undo()
                self._refill(file, start, size, err)
                return None
            mapped.append((start, size))
            c.madvise(base + start, size, MADV_HUGEPAGE)
        for edge in edges:
            buf = c.mmap(None, page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
            if buf in (None, MAP_FAILED):
                undo()
                return None
            buffers[edge] = buf
        targets = [(edge, buf, page) for edge, buf in buffers.items()] + [(start, base + start, size) for start, size in inners]
        got, whole = self._read_into(file, offset, length, targets, gaps, undo)
        if not whole:
            return got
        with self._moves:
            for edge, buf in list(buffers.items()):
                if c.mremap(buf, page, page, MREMAP_MAYMOVE | MREMAP_FIXED, base + edge) != base + edge:
                    err = ctypes.get_errno()
                    c.munmap(buf, page)
                    self._refill(file, edge, page, err)  # the kernel may have unmapped the target first
                    raise OSError(err, f"mremap: {os.strerror(err)}")
            with self._lock:
                for start, size in inners:
                    self._placed[(file, start)] = (0, 0, size, False)
                for edge in buffers:
                    self._placed[(file, edge)] = (0, 0, page, False)
        return length

    def copy_in(self, file: int, offset: int, length: int) -> int | None:
        """Read the whole pages [offset, offset+length) with O_DIRECT into memory of their own, then
        move them over their place in the mapping in one step: the range never reads as zeros,
        for pages that a computing neighbour may share (a shard's end pages). Given back with
        ``release_in_place``."""
        c = self._libc
        buf = c.check(c.mmap(None, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0), "mmap")
        try:
            view = (ctypes.c_char * length).from_address(buf)
            got = self._read(file, [memoryview(view).cast("B")], offset)
        except OSError:
            c.munmap(buf, length)
            raise
        if not self._complete(file, offset, got, length):
            c.munmap(buf, length)
            return got
        target = self.space.at(file, offset)
        with self._moves:
            if c.mremap(buf, length, length, MREMAP_MAYMOVE | MREMAP_FIXED, target) != target:
                err = ctypes.get_errno()
                c.munmap(buf, length)
                # The kernel may have unmapped the target before it failed: map the file there again.
                self._refill(file, offset, length, err)
                raise OSError(err, f"mremap: {os.strerror(err)}")
            with self._lock:
                self._placed[(file, offset)] = (0, 0, length, False)
        return length

    def blank_file_backed(self) -> list[tuple[int, int, int]]:
        """Map zeros over every part of the model's mappings that is still the file's (per
        /proc/self/maps, matched by device and inode): reading there then cannot fault on the
        file. Returns the (file, offset, length) parts, for ``map_file`` to give back."""
        with self._moves:
            return self._blank_file_backed()

    def _blank_file_backed(self) -> list[tuple[int, int, int, int]]:
        c = self._libc
        ids = {self._identity(file): file for file in self._file_fds}
        blanked = []
        for lo, hi, identity, file_offset in mapped_areas():
            file = ids.get(identity) if identity is not None else None
            if file is None or not self.space.holds(file, lo, hi):
                continue  # some other mapping of the same file, not the model's
            if c.mmap(lo, hi - lo, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) in (None, MAP_FAILED):
                err = ctypes.get_errno()
                raise OSError(err, f"mmap: {os.strerror(err)}")
            blanked.append((file, file_offset, hi - lo, lo))
        return blanked

    def map_file(self, file: int, offset: int, length: int, address: int | None = None) -> None:
        """The file again at [offset, offset+length), at ``address`` (after ``blank_file_backed``)."""
        self._map_file(file, offset, length, address)

    def _refill(self, file: int, offset: int, length: int, err: int) -> None:
        """After a failed mmap or mremap onto [offset, offset+length) of the mapping, which may or
        may not have unmapped it first: the file goes back where there is now a hole, and where
        there is none (the call failed before it unmapped anything) the range is left as it was.
        Never MAP_FIXED: a hole in the mapping may have been given to another mmap meanwhile, and
        mapping over it would corrupt someone else's memory. OSError if the range was lost."""
        c = self._libc
        target = self.space.at(file, offset)
        got = c.mmap(target, length, PROT_READ, MAP_SHARED | MAP_FIXED_NOREPLACE, self._file_fds[file], offset)
        if got == target:
            return
        if got not in (None, MAP_FAILED):  # a kernel before 4.17 took the flag as a hint and mapped elsewhere
            c.munmap(got, length)
        if not self._mapped(file, target, length):  # else: nothing was unmapped, the range is as it was
            raise OSError(err, f"the model's mapping lost bytes {offset}..{offset + length} of file {file}: {os.strerror(err)}")

    def _identity(self, file: int) -> tuple[int, int] | None:
        try:
            st = os.fstat(self._file_fds[file])
        except OSError:
            return None
        return st.st_dev, st.st_ino

    def _mapped(self, file: int, address: int, length: int) -> bool:
        """Whether [address, address+length) is wholly mapped, by this file or anonymous memory (ours)."""
        ours = self._identity(file)
        covered = address
        for lo, hi, identity, _ in mapped_areas():
            if hi <= covered or lo > covered:
                continue
            if identity is not None and identity != ours:
                return False
            covered = hi
            if covered >= address + length:
                return True
        return False

    def _map_file(self, file: int, offset: int, length: int, address: int | None = None) -> None:
        """The file over a range of the mapping that is ours (placed or blanked memory)."""
        c = self._libc
        if c.mmap(self.space.at(file, offset) if address is None else address, length, PROT_READ, MAP_SHARED | MAP_FIXED, self._file_fds[file], offset) in (None, MAP_FAILED):
            err = ctypes.get_errno()
            raise OSError(err, f"mmap: {os.strerror(err)}")

    def park(self, file: int, offset: int) -> bool:
        """Move the pages of a part read in place (an expert slice's own pages) to an address
        the kernel picks; its place stays mapped (MREMAP_DONTUNMAP): no hole in the slot that
        another mmap could be given before the slot is taken over."""
        c = self._libc
        with self._moves:
            with self._lock:
                entry = self._placed.get((file, offset))
            if entry is None or entry[0] != 0:
                return False
            length = entry[2]
            got = c.mremap(self.space.at(file, offset), length, length, MREMAP_MAYMOVE | MREMAP_DONTUNMAP, None)
            if got in (None, MAP_FAILED):
                return False
            with self._lock:
                del self._placed[(file, offset)]
                self._parked[(file, offset)] = (got, length)
        return True

    def unpark(self, file: int, offset: int) -> bool:
        c = self._libc
        with self._moves:
            with self._lock:
                entry = self._parked.pop((file, offset), None)
            if entry is None:
                return False
            address, length = entry
            target = self.space.at(file, offset)
            if c.mremap(address, length, length, MREMAP_MAYMOVE | MREMAP_FIXED, target) != target:
                err = ctypes.get_errno()
                c.munmap(address, length)
                self._refill(file, offset, length, err)  # the kernel may have unmapped the target first
                return False
            with self._lock:
                self._placed[(file, offset)] = (0, 0, length, False)
        return True

    def _unplace(self, file: int, offset: int) -> None:
        with self._lock:
            parked = self._parked.pop((file, offset), None)
            entry = self._placed.pop((file, offset), None) if parked is None else None
        if parked is not None:  # its slot holds another layer: only its own pages go
            self._libc.munmap(*parked)
            return
        if entry is None:
            return
        buf, at, length, whole = entry
        if buf == 0 and self._in_arena(file, offset, offset + length):  # its pages are freed, the arena stays
            if not self._free_in_arena(self.space.at(file, offset), length):
                err = ctypes.get_errno()
                with self._lock:
                    self._placed[(file, offset)] = entry
                raise OSError(err, f"freeing {length} bytes of the arena: {os.strerror(err)}")
            return
        if buf == 0:  # read in place: the file goes back over its pages, which the kernel frees
            try:
                self._map_file(file, offset, length)
            except OSError:
                with self._lock:
                    self._placed[(file, offset)] = entry
                raise
            return
        c = self._libc
        target = self.space.at(file, offset)
        moves = MREMAP_MAYMOVE | MREMAP_FIXED | MREMAP_DONTUNMAP
        try:
            c.check(c.mremap(target, length, length, moves, buf + at), "mremap")
        except OSError:
            with self._lock:
                self._placed[(file, offset)] = entry
            raise
        try:
            self._map_file(file, offset, length)
        except OSError as exc:
            err = exc.errno
            # A hole the failed mmap left is filled with the file (OSError if another took it).
            self._refill(file, offset, length, err)
            if self._file_maps(file, target):
                self._give_back(buf, whole)
                return
            # Still our empty memory (the mmap failed before it unmapped): the pages go back there.
            c.mremap(buf + at, length, length, moves, target)
            with self._lock:
                self._placed[(file, offset)] = entry
            raise OSError(err, f"mmap: {os.strerror(err)}")
        self._give_back(buf, whole)

    def _file_maps(self, file: int, address: int) -> bool:
        """Whether the page at ``address`` maps this file (not anonymous memory)."""
        ours = self._identity(file)
        return any(lo <= address < hi and identity is not None and identity == ours for lo, hi, identity, _ in mapped_areas())

    def forget_within(self, file: int, lo: int, hi: int) -> None:
        """Drop the records of placed pieces in [lo, hi) of ``file`` without touching their
        place (the bounded layout maps its slot over them); pool buffers go back to the pool."""
        with self._lock:
            gone = [key for key in self._placed if key[0] == file and lo <= key[1] < hi]
            entries = [self._placed.pop(key) for key in gone]
        for buf, _at, _length, whole in entries:
            if buf:
                self._give_back(buf, whole)

    @property
    def placed_bytes(self) -> int:
        with self._lock:
            return sum(entry[2] for entry in (*self._placed.values(), *self._pieces.values()))

    def close(self) -> None:
        """Give every range back to the file, free the pool. A range that cannot be given back
        keeps its (right) bytes as anonymous memory until llama.cpp unmaps the model."""
        for file, offset in list(self._placed) + list(self._parked):
            try:
                self._unplace(file, offset)
            except OSError:
                pass
        with self._lock:
            pieces, self._pieces = self._pieces, {}
        for buf, _at, _length, whole in pieces.values():  # their place becomes the file's below
            if buf:
                self._give_back(buf, whole)
        arena, self._arena = self._arena, {}
        for file, (starts, ends) in arena.items():  # the mapping is the file's again
            for lo, hi in zip(starts, ends):
                try:
                    self._map_file(file, lo, hi - lo)
                except OSError:
                    pass
        self.free_idle_buffers()
        self.spare.close()
        if self._scratch is not None:
            self._libc.munmap(self._scratch, self.gap_bytes)
            self._scratch = None
        self.done_reading()
