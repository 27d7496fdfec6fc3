"""Darwin/iOS placement: streamed bytes reach the model's mapping without the unified buffer cache.

Without it, every streamed byte on Darwin is read through the unified buffer cache (UBC) into a
throwaway buffer, only so that compute's page faults find it cached: per 16 KiB page a cache
insert, a copy out, later an eviction, and a fault to map it. On paper, per GiB (65,536 pages):
the copy ~0.05-0.1 s at 10-20 GB/s, the cache's insert and eviction ~0.1 s at ~1.5 us a page,
the faults ~0.07 s at ~1 us: ~0.2-0.3 s of CPU per GiB, against 1.0-3.3 s per GiB of USB
transfer at 0.3-1.0 GB/s. On the iPhone's six cores (two fast, four efficiency) the reader
threads do that work on cores compute does not use, so decode gains little, a few percent;
on two cores, as on this development machine, it comes straight out of compute (Linux measured
~0.3 s per GiB of system time there: direct.py). What placement buys on the phone is the
budget and the cable:
  - the bytes compute uses are this process's anonymous memory, which jetsam counts and the
    budget holds, not UBC pages the kernel keeps or drops as it likes;
  - a drive unplugged mid-reply cannot SIGBUS compute on pages already read.

So each read lands in anonymous memory at its place in llama.cpp's mapping: the range is
mapped anew (MAP_FIXED, anonymous) and read into with ``pread`` on a descriptor with F_NOCACHE,
which moves the device's bytes into those pages without the cache. A shared end page, which a
computing neighbour may read, is read into memory of its own and moved over its place in one
step with ``mach_vm_remap`` (VM_FLAGS_OVERWRITE), Mach's twin of Linux's mremap; the source is
then deallocated, so the mapping alone holds the page. Releasing maps the file there again;
XNU puts the old entries back when an overwriting map fails, so no failure leaves a hole.

There is no pool of pre-faulted buffers, as Linux has: a remap without copy shares the pages
with the source rather than moving them, so a pooled buffer would need fresh memory after each
move, and the zero-fill it meant to save is paid anyway; Darwin gives anonymous memory no huge
pages for the move to keep whole either.

A read that fails or comes up short leaves its range as zeros, so a node ggml runs after the
abort reads zeros rather than fault on a cut drive's file (a SIGBUS), and is not counted as
placed, so a read asked for again reads it. The streamer's shield takes such ranges
(``blank_file_backed``) and gives them back to the file once the token is over. Darwin has no
/proc/self/maps to find the mapping's other file-backed pages, so the shield covers no more.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Protocol

from kimitui.engine.direct import PlacedParts
from kimitui.engine.platform import (
    DARWIN_MAP_ANON, F_GETPATH, F_NOCACHE, F_RDAHEAD, MAP_FAILED, MAP_FIXED, MAP_PRIVATE, MAP_SHARED, PROT_READ, PROT_WRITE,
    bind_mmap,
)

VM_FLAGS_FIXED, VM_FLAGS_OVERWRITE = 0x0, 0x4000
VM_INHERIT_DEFAULT = 1
KERN_SUCCESS = 0


class PlacementCalls(Protocol):
    """What the placer asks of the system; ``DarwinCalls`` is libSystem's. Each raises OSError."""

    page: int

    def open_uncached(self, path: str, mapped_fd: int | None) -> int: ...
    def map_anonymous(self, address: int, length: int) -> None: ...
    def map_file(self, address: int, length: int, fd: int, offset: int) -> None: ...
    def allocate(self, length: int) -> int: ...
    def free(self, address: int, length: int) -> None: ...
    def pread(self, fd: int, address: int, length: int, offset: int) -> int: ...
    def move(self, source: int, target: int, length: int) -> None: ...


class DarwinCalls:
    """libSystem through ctypes; ``lib`` and ``task`` are injectable, so the exact calls are
    checked on Linux by recording them."""

    def __init__(self, lib=None, task: int | None = None, page: int | None = None, fcntl_call=None) -> None:
        import fcntl

        self._fcntl = fcntl_call or fcntl.fcntl
        lib = lib if lib is not None else ctypes.CDLL(None, use_errno=True)
        self.page = page or os.sysconf("SC_PAGE_SIZE")
        self._mmap, self._munmap = bind_mmap(lib)
        self._pread = lib.pread
        self._pread.restype = ctypes.c_ssize_t
        self._pread.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64)
        self._remap, self._deallocate = lib.mach_vm_remap, lib.mach_vm_deallocate
        u64 = ctypes.c_uint64
        self._remap.argtypes = (
            ctypes.c_uint, ctypes.POINTER(u64), u64, u64, ctypes.c_int, ctypes.c_uint, u64, ctypes.c_int,
            ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int), ctypes.c_uint,
        )
        self._deallocate.argtypes = (ctypes.c_uint, u64, u64)
        # mach_task_self() is a macro for this global: the port naming our own address space.
        self._task = task if task is not None else ctypes.c_uint.in_dll(lib, "mach_task_self_").value

    @staticmethod
    def _failed(what: str) -> OSError:
        err = ctypes.get_errno()
        return OSError(err, f"{what}: {os.strerror(err)}")

    def open_uncached(self, path: str, mapped_fd: int | None) -> int:
        """The file the mapping holds (F_GETPATH of its descriptor: the path may name a new file
        by now), opened again, with the cache and read-ahead off for this descriptor."""
        if mapped_fd is not None:
            try:
                path = self._fcntl(mapped_fd, F_GETPATH, b"\0" * 1024).split(b"\0", 1)[0].decode()
            except OSError:
                pass
        fd = os.open(path, os.O_RDONLY)
        try:
            self._fcntl(fd, F_NOCACHE, 1)
            self._fcntl(fd, F_RDAHEAD, 0)
        except OSError:
            os.close(fd)
            raise
        return fd

    def _map(self, address: int, length: int, prot: int, flags: int, fd: int, offset: int, what: str) -> None:
        if self._mmap(address, length, prot, flags, fd, offset) != address:
            raise self._failed(what)

    def map_anonymous(self, address: int, length: int) -> None:
        self._map(address, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | DARWIN_MAP_ANON | MAP_FIXED, -1, 0, "mmap")

    def map_file(self, address: int, length: int, fd: int, offset: int) -> None:
        self._map(address, length, PROT_READ, MAP_SHARED | MAP_FIXED, fd, offset, "mmap of the model file")

    def allocate(self, length: int) -> int:
        address = self._mmap(None, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | DARWIN_MAP_ANON, -1, 0)
        if address in (None, MAP_FAILED):
            raise self._failed("mmap")
        return address

    def free(self, address: int, length: int) -> None:
        self._munmap(address, length)

    def pread(self, fd: int, address: int, length: int, offset: int) -> int:
        got = self._pread(fd, address, length, offset)
        if got < 0:
            raise self._failed("pread")
        return got

    def move(self, source: int, target: int, length: int) -> None:
        """The pages at ``source`` become the ones at ``target`` (what was there goes), and
        ``source`` is unmapped: shared, not copied (copy=FALSE), then the source's hold dropped."""
        at = ctypes.c_uint64(target)
        cur, most = ctypes.c_int(), ctypes.c_int()
        kr = self._remap(
            self._task, ctypes.byref(at), length, 0, VM_FLAGS_FIXED | VM_FLAGS_OVERWRITE,
            self._task, source, 0, ctypes.byref(cur), ctypes.byref(most), VM_INHERIT_DEFAULT,
        )
        if kr != KERN_SUCCESS or at.value != target:
            raise OSError(0, f"mach_vm_remap: kern_return {kr}")
        self._deallocate(self._task, source, length)


class DarwinPlacer(PlacedParts):
    """The placer interface of direct.DirectPlacer (what the streamer and the pinned set call),
    with every read in place: see the module's text."""

    def __init__(self, paths: list[str], space, file_fds: dict[int, int], capacity: int,
                 calls: PlacementCalls | None = None) -> None:
        self._calls = calls or DarwinCalls()
        self.page = self._calls.page
        self.space = space  # addressing.WholeFiles or Windows: where each byte of the model is
        self._file_fds = file_fds
        self._capacity = capacity  # kept for the interface: there is no pool to size
        self._lock = threading.Lock()
        # (file, offset) -> length of anonymous memory there, ours until released
        self._placed: dict[tuple[int, int], int] = {}
        self._parked: dict = {}  # none: parking is Linux's (mremap); a slot taken over gives its parts back
        # (file, offset) -> length of zeros a failed read left there, not placed (see _failed_read)
        self._unread: dict[tuple[int, int], int] = {}
        self._fds: dict[int, int] = {}
        try:
            for i, path in enumerate(paths):
                self._fds[i] = self._calls.open_uncached(path, file_fds.get(i))
        except OSError:
            self.close()
            raise

    @classmethod
    def create(cls, paths, space, file_fds, capacity, calls: PlacementCalls | None = None) -> "DarwinPlacer | None":
        """None where a file cannot be opened again: the engine then reads through the cache."""
        try:
            return cls(paths, space, file_fds, capacity, calls)
        except (OSError, AttributeError):  # AttributeError: a libSystem without mach_vm_remap
            return None

    direct = True  # F_NOCACHE on every file

    @property
    def capacity(self) -> int:
        return self._capacity

    @capacity.setter
    def capacity(self, buffers: int) -> None:
        self._capacity = buffers

    def done_reading(self) -> None:
        fds, self._fds = list(self._fds.values()), {}
        for fd in fds:
            os.close(fd)

    def _fd(self, file: int) -> int:
        fd = self._fds.get(file)
        if fd is None:
            raise OSError(9, "this placer reads no more (done_reading)")
        return fd

    def _read_into(self, file: int, address: int, length: int, offset: int) -> int:
        got = 0
        while got < length:
            n = self._calls.pread(self._fd(file), address + got, length - got, offset + got)
            if n == 0:
                break
            got += n
        return got

    def _in_place(self, file: int, offset: int, length: int) -> int:
        """Fresh anonymous memory at [offset, offset+length) of the mapping, read into, and
        recorded once the read is whole. A failed or short read gives the range back to the
        file: a record of it would let the next read of the range take its zeros for data."""
        target = self.space.at(file, offset)
        self._calls.map_anonymous(target, length)
        try:
            got = self._read_into(file, target, length, offset)
        except OSError:
            self._failed_read(file, offset, length)
            raise
        if not self._complete(file, offset, got, length):
            self._failed_read(file, offset, length)
            return got
        with self._lock:
            self._placed[(file, offset)] = length
            self._unread.pop((file, offset), None)
        return got

    def _failed_read(self, file: int, offset: int, length: int) -> None:
        """The range stays zeros (a node ggml runs after the abort may read it, and the file
        there may be a cut drive's: a SIGBUS), but is not counted as placed: the next read of
        it reads. The shield takes it (``blank_file_backed``) and gives it back to the file."""
        with self._lock:
            self._unread[(file, offset)] = length

    def place(self, file: int, offset: int, length: int) -> int | None:
        with self._lock:
            if (file, offset) in self._placed:
                return length  # still there: a release was cancelled by a read asked for again
        return self._in_place(file, offset, length)

    def _copy_in(self, file: int, offset: int, length: int) -> int:
        c = self._calls
        buf = c.allocate(length)
        try:
            got = self._read_into(file, buf, length, offset)
            if not self._complete(file, offset, got, length):
                c.free(buf, length)
                return got
            c.move(buf, self.space.at(file, offset), length)
        except OSError:
            c.free(buf, length)
            raise
        with self._lock:
            self._placed[(file, offset)] = length
        return got

    def copy_in(self, file: int, offset: int, length: int) -> int | None:
        return self._copy_in(file, offset, length)

    def place_slice(self, file: int, offset: int, length: int, inners: list[tuple[int, int]], edges: list[int]) -> int | None:
        """[offset, offset+length), one slice or several that follow each other in the file:
        each slice's own pages (``inners``) read in place, each shared end page in ``edges``
        copied in. The bytes read (``length`` where the file ends inside the last page), short
        where the file ended before."""
        pieces = sorted([(edge, self.page, True) for edge in edges] + [(start, size, False) for start, size in inners])
        got, done = 0, []
        try:
            for start, size, shared in pieces:
                n = self._copy_in(file, start, size) if shared else self._in_place(file, start, size)
                got += n
                if not self._complete(file, start, n, size):
                    for placed in done:  # the slice is placed whole or not at all
                        self._unplace(file, placed)
                    return got
                done.append(start)
        except OSError:
            for placed in done:
                self._unplace(file, placed)
            raise
        return length

    def _unplace(self, file: int, offset: int) -> None:
        with self._lock:
            length = self._placed.pop((file, offset), None)
        if length is None:
            return
        try:
            self._calls.map_file(self.space.at(file, offset), length, self._file_fds[file], offset)
        except OSError:
            with self._lock:
                self._placed[(file, offset)] = length
            raise

    def blank_file_backed(self) -> list[tuple[int, int, int]]:
        """The ranges failed reads left as zeros, for ``map_file`` to give back once the token
        is over. The rest of the mapping is not shielded: Darwin has no /proc/self/maps to
        find its file-backed parts (see the module's text)."""
        with self._lock:
            taken, self._unread = self._unread, {}
        return [(file, offset, length) for (file, offset), length in taken.items()]

    def map_file(self, file: int, offset: int, length: int, address: int | None = None) -> None:
        self._calls.map_file(self.space.at(file, offset) if address is None else address, length, self._file_fds[file], offset)

    def forget_within(self, file: int, lo: int, hi: int) -> None:
        """Drop the records of placed or unread ranges in [lo, hi) of ``file`` (the bounded
        layout maps its slot over them)."""
        with self._lock:
            for table in (self._placed, self._unread):
                for key in [key for key in table if key[0] == file and lo <= key[1] < hi]:
                    del table[key]

    @property
    def placed_bytes(self) -> int:
        with self._lock:
            return sum(self._placed.values())

    def close(self) -> None:
        for file, offset, length in self.blank_file_backed():
            try:
                self.map_file(file, offset, length)
            except OSError:
                pass
        for file, offset in list(self._placed):
            try:
                self._unplace(file, offset)
            except OSError:
                pass
        self.done_reading()
