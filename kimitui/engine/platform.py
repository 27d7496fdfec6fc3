"""Platform reads: how the engine reads ahead, drops and measures model bytes per OS.

Linux: positional reads populate the page cache that the model's mapping shares; dropping a
streamed range is MADV_DONTNEED on our mapping plus POSIX_FADV_DONTNEED on the file.
Darwin/iOS (no O_DIRECT, no posix_fadvise, no /proc): the same positional reads, F_RDADVISE
to start read-ahead, and dropping with MADV_DONTNEED then msync(MS_INVALIDATE), which releases
the cached pages of a clean file range. The syscall layer is injectable so the Darwin path is
tested on Linux.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
import sys
from typing import Protocol

MADV_DONTNEED = 4
MADV_POPULATE_READ = 22  # Linux 5.14+: fault a range in, reading what is missing, no copy
POSIX_FADV_RANDOM = 1
POSIX_FADV_WILLNEED = 3
POSIX_FADV_DONTNEED = 4
F_RDADVISE = 44  # Darwin fcntl: struct radvisory { off_t ra_offset; int ra_count; }
F_RDAHEAD = 45  # Darwin fcntl: read-ahead on (1) or off (0) for this descriptor
MS_INVALIDATE = 2  # Darwin msync flag


class Syscalls(Protocol):
    def madvise(self, address: int, length: int, advice: int) -> int: ...
    def msync(self, address: int, length: int, flags: int) -> int: ...
    def fadvise(self, fd: int, offset: int, length: int, advice: int) -> None: ...
    def fcntl(self, fd: int, cmd: int, arg: bytes | int) -> bytes | int: ...


class LibcSyscalls:
    def __init__(self) -> None:
        self._libc = ctypes.CDLL("libc.so.6" if sys.platform.startswith("linux") else None, use_errno=True)
        self._libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        self._libc.msync.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)

    def madvise(self, address: int, length: int, advice: int) -> int:
        return self._libc.madvise(address, length, advice)

    def msync(self, address: int, length: int, flags: int) -> int:
        return self._libc.msync(address, length, flags)

    def fadvise(self, fd: int, offset: int, length: int, advice: int) -> None:
        os.posix_fadvise(fd, offset, length, advice)

    def fcntl(self, fd: int, cmd: int, arg: bytes | int) -> bytes | int:
        import fcntl

        return fcntl.fcntl(fd, cmd, arg)


def _inward(address: int, length: int, page: int) -> tuple[int, int]:
    """Whole pages inside [address, address+length): never touch a neighbour's (maybe pinned) page."""
    start = (address + page - 1) & ~(page - 1)
    end = (address + length) & ~(page - 1)
    return start, max(0, end - start)


class PlatformIO:
    """Per-OS read-ahead and drop of one model file's byte ranges."""

    def __init__(self, platform: str = sys.platform, syscalls: Syscalls | None = None) -> None:
        self.platform = platform
        self.sys = syscalls or LibcSyscalls()
        self.page = os.sysconf("SC_PAGE_SIZE")
        self._no_populate = False

    def populate(self, fd: int, mapping_address: int, offset: int, length: int) -> bool:
        """Read a range straight into our mapping (Linux): no copy, and compute meets no page
        faults later. False where unsupported; an I/O error raises OSError.

        WILLNEED first queues the whole range as large requests (up to the device's maximum);
        the populate's faults alone would read it in read-ahead windows, 128 KiB on many disks."""
        if not self.platform.startswith("linux") or self._no_populate:
            return False
        self.sys.fadvise(fd, offset, length, POSIX_FADV_WILLNEED)
        start = (mapping_address + offset) & ~(self.page - 1)
        if self.sys.madvise(start, mapping_address + offset + length - start, MADV_POPULATE_READ) == 0:
            return True
        err = ctypes.get_errno()
        if err == errno.EINVAL:  # kernel older than 5.14
            self._no_populate = True
            return False
        raise OSError(err, os.strerror(err))

    def placer(self, paths, addresses: dict[int, int], fds: dict[int, int], capacity: int):
        """Direct reads moved into the mapping (Linux, see direct.py); None elsewhere."""
        if not self.platform.startswith("linux") or not capacity:
            return None
        from kimitui.engine.direct import DirectPlacer

        return DirectPlacer.create([str(p) for p in paths], addresses, fds, capacity)

    def exact_reads(self, fd: int) -> None:
        """Reads on ``fd`` fetch what they ask for and no more: the kernel's read-ahead (8 MiB
        per read on some disks) would turn a 60 KiB expert slice into megabytes of waste."""
        if self.platform == "darwin":
            self.sys.fcntl(fd, F_RDAHEAD, 0)
        else:
            self.sys.fadvise(fd, 0, 0, POSIX_FADV_RANDOM)

    def advise_read(self, fd: int, offset: int, length: int) -> None:
        """Start the kernel reading a range without waiting (Darwin's F_RDADVISE)."""
        if self.platform == "darwin":
            self.sys.fcntl(fd, F_RDADVISE, struct.pack("qi4x", offset, min(length, 2**31 - 1)))

    def unmap_page(self, address: int) -> None:
        """One file-backed page out of our page tables (it stays in the cache for whoever shares
        it); a locked one refuses, which is fine."""
        self.sys.madvise(address, self.page, MADV_DONTNEED)

    def uncache(self, fd: int, offset: int, length: int) -> None:
        """Whole pages of a file out of the page cache, where the OS can be asked (not Darwin:
        its drop invalidates through the mapping)."""
        if self.platform != "darwin":
            self.sys.fadvise(fd, offset, length, POSIX_FADV_DONTNEED)

    def drop(self, fd: int, mapping_address: int, offset: int, length: int) -> None:
        """Release a streamed range: out of our page tables and, where possible, the cache.
        OSError when the OS refuses: the bytes would stay resident, counted nowhere."""
        start, size = _inward(mapping_address + offset, length, self.page)
        if size and self.sys.madvise(start, size, MADV_DONTNEED) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"madvise(MADV_DONTNEED) of {size} bytes: {os.strerror(err)}")
        if self.platform == "darwin":
            if size and self.sys.msync(start, size, MS_INVALIDATE) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"msync(MS_INVALIDATE) of {size} bytes: {os.strerror(err)}")
        else:
            file_start, file_size = _inward(offset, length, self.page)
            if file_size:
                self.sys.fadvise(fd, file_start, file_size, POSIX_FADV_DONTNEED)
