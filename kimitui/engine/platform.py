"""Platform reads: how the engine reads ahead, drops and measures model bytes per OS.

Linux: positional reads populate the page cache that the model's mapping shares; dropping a
streamed range is MADV_DONTNEED on our mapping plus POSIX_FADV_DONTNEED on the file.
Darwin/iOS (no O_DIRECT, no posix_fadvise, no /proc): the same positional reads, F_RDADVISE
to start read-ahead, and dropping with MADV_DONTNEED then msync(MS_INVALIDATE), which releases
the cached pages of a clean file range; where the placer is made (darwin_placer.py) streamed
bytes skip the cache altogether. The syscall layer is injectable so the Darwin path is tested
on Linux. The limits a process meets there (descriptors, address space) are checked here too,
and mmap's constants per OS live here for every module that maps memory.
"""

from __future__ import annotations

import ctypes
import errno
import os
import resource
import struct
import sys
from dataclasses import dataclass
from typing import Callable, Protocol

MADV_DONTNEED = 4
MADV_POPULATE_READ = 22  # Linux 5.14+: fault a range in, reading what is missing, no copy
POSIX_FADV_RANDOM = 1
POSIX_FADV_WILLNEED = 3
POSIX_FADV_DONTNEED = 4
F_RDADVISE = 44  # Darwin fcntl: struct radvisory { off_t ra_offset; int ra_count; }
F_RDAHEAD = 45  # Darwin fcntl: read-ahead on (1) or off (0) for this descriptor
F_NOCACHE = 48  # Darwin fcntl: this descriptor's reads and writes skip the unified buffer cache
F_GETPATH = 50  # Darwin fcntl: the path of the file a descriptor holds
MS_INVALIDATE = 2  # Darwin msync flag


def is_darwin(platform: str = sys.platform) -> bool:
    """Apple's kernel under either of Python's names for it: "darwin" on macOS, "ios" on iOS
    (CPython 3.13 and later, PEP 730). Everything the engine does on macOS applies there."""
    return platform in ("darwin", "ios")


def is_ios(platform: str = sys.platform, machine: str | None = None) -> bool:
    """iOS, whatever Python says: "ios" from CPython 3.13's own iOS builds, "darwin" from the
    Pythons a jailbreak installs (Procursus), where the machine name tells ("iPhone17,1")."""
    if platform == "ios":
        return True
    return platform == "darwin" and (machine if machine is not None else os.uname().machine).startswith(("iPhone", "iPad", "iPod"))


LIBC_NAME = "libc.so.6" if sys.platform.startswith("linux") else None  # None: the process's own symbols (libSystem)

# -- mmap's protections and flags ---------------------------------------------------------------

PROT_NONE, PROT_READ, PROT_WRITE = 0x0, 0x1, 0x2
MAP_SHARED, MAP_PRIVATE, MAP_FIXED = 0x01, 0x02, 0x10  # the same on Linux and Darwin
MAP_ANONYMOUS, MAP_NORESERVE = 0x20, 0x4000  # Linux's: the load hooks align mappings there only
DARWIN_MAP_ANON, DARWIN_MAP_NORESERVE = 0x1000, 0x40
MAP_FAILED = ctypes.c_void_p(-1).value
HUGE_ALIGN = 2 * 2**20  # Linux x86-64/arm64 (4 KiB pages): one page-table entry maps 2 MiB


def anon_noreserve(platform: str = sys.platform) -> int:
    """MAP_PRIVATE | MAP_ANON(YMOUS) | MAP_NORESERVE as ``platform`` spells them: address space
    that takes no memory until it is touched."""
    if is_darwin(platform):
        return MAP_PRIVATE | DARWIN_MAP_ANON | DARWIN_MAP_NORESERVE
    return MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE


def bind_mmap(libc: ctypes.CDLL):
    """``libc``'s mmap and munmap, their C types declared (an address back, a 64-bit offset)."""
    mmap, munmap = libc.mmap, libc.munmap
    mmap.restype = ctypes.c_void_p
    mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64)
    munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    return mmap, munmap


def reserve_aligned(mmap, munmap, length: int, align: int, prot: int = PROT_NONE,
                    flags: int = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE) -> int | None:
    """Anonymous memory of ``length`` bytes that starts on an ``align`` boundary (mapped with
    room to spare, the slack either side given back), through the given mmap/munmap; None if
    the system has no room."""
    page = os.sysconf("SC_PAGE_SIZE")
    span = length + align
    room = mmap(None, span, prot, flags, -1, 0)
    if room in (None, MAP_FAILED):
        return None
    start = -(-room // align) * align
    end = -(-(start + length) // page) * page
    if start > room:
        munmap(room, start - room)
    if room + span > end:
        munmap(end, room + span - end)
    return start


class Syscalls(Protocol):
    def madvise(self, address: int, length: int, advice: int) -> int: ...
    def msync(self, address: int, length: int, flags: int) -> int: ...
    def fadvise(self, fd: int, offset: int, length: int, advice: int) -> None: ...
    def fcntl(self, fd: int, cmd: int, arg: bytes | int) -> bytes | int: ...


class LibcSyscalls:
    def __init__(self) -> None:
        self._libc = ctypes.CDLL(LIBC_NAME, use_errno=True)
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

    def exact_reads(self, fd: int) -> None:
        """Reads on ``fd`` fetch what they ask for and no more: the kernel's read-ahead (8 MiB
        per read on some disks) would turn a 60 KiB expert slice into megabytes of waste."""
        if is_darwin(self.platform):
            self.sys.fcntl(fd, F_RDAHEAD, 0)
        else:
            self.sys.fadvise(fd, 0, 0, POSIX_FADV_RANDOM)

    def advise_read(self, fd: int, offset: int, length: int) -> None:
        """Start the kernel reading a range without waiting (Darwin's F_RDADVISE)."""
        if is_darwin(self.platform):
            self.sys.fcntl(fd, F_RDADVISE, struct.pack("qi4x", offset, min(length, 2**31 - 1)))

    def uncache(self, fd: int, offset: int, length: int) -> None:
        """Whole pages of a file out of the page cache, where the OS can be asked (not Darwin:
        its drop invalidates through the mapping)."""
        if not is_darwin(self.platform):
            self.sys.fadvise(fd, offset, length, POSIX_FADV_DONTNEED)

    def drop(self, fd: int, mapping_address: int, offset: int, length: int) -> None:
        """Release a streamed range: out of our page tables and, where possible, the cache.
        OSError when the OS refuses: the bytes would stay resident, counted nowhere."""
        start, size = _inward(mapping_address + offset, length, self.page)
        if size and self.sys.madvise(start, size, MADV_DONTNEED) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"madvise(MADV_DONTNEED) of {size} bytes: {os.strerror(err)}")
        if is_darwin(self.platform):
            if size and self.sys.msync(start, size, MS_INVALIDATE) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"msync(MS_INVALIDATE) of {size} bytes: {os.strerror(err)}")
        else:
            file_start, file_size = _inward(offset, length, self.page)
            if file_size:
                self.sys.fadvise(fd, file_start, file_size, POSIX_FADV_DONTNEED)


# -- what a process may hold: descriptors and address space ---------------------------------

DARWIN_OPEN_MAX = 10240  # Darwin's setrlimit refuses a descriptor soft limit above OPEN_MAX


def descriptors_needed(n_files: int) -> int:
    """Descriptors a model of ``n_files`` files keeps open: llama.cpp's own, the mapping's
    duplicate the load hooks keep, and a direct-read one per file, plus the interpreter's,
    the UI's, the HTTP server's and the trace's."""
    return 3 * n_files + 128


def raise_descriptor_limit(
    needed: int,
    platform: str = sys.platform,
    getrlimit: Callable[[int], tuple[int, int]] | None = None,
    setrlimit: Callable[[int, tuple[int, int]], None] | None = None,
) -> tuple[int, int]:
    """Raise this process's soft descriptor limit to ``needed`` where it is lower (Darwin's is
    256 by default: a split set of 85 files would run out). Returns (soft limit now, hard limit);
    the caller says what to do where the soft limit is still below ``needed``."""
    getrlimit, setrlimit = getrlimit or resource.getrlimit, setrlimit or resource.setrlimit
    soft, hard = getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return soft, hard
    ceiling = needed if hard == resource.RLIM_INFINITY else min(hard, needed)
    if is_darwin(platform):
        ceiling = min(ceiling, DARWIN_OPEN_MAX)
    if ceiling <= soft:
        return soft, hard
    try:
        setrlimit(resource.RLIMIT_NOFILE, (ceiling, hard))
    except (ValueError, OSError):
        return soft, hard
    return ceiling, hard


class AddressSpace(Protocol):
    def mmap(self, address: int | None, length: int, prot: int, flags: int, fd: int, offset: int) -> int | None: ...
    def munmap(self, address: int, length: int) -> int: ...


class LibcAddressSpace:
    def __init__(self) -> None:
        self._mmap, self._munmap = bind_mmap(ctypes.CDLL(LIBC_NAME, use_errno=True))

    def mmap(self, address, length, prot, flags, fd, offset):
        return self._mmap(address, length, prot, flags, fd, offset)

    def munmap(self, address, length):
        return self._munmap(address, length)


def can_reserve(nbytes: int, platform: str = sys.platform, calls: AddressSpace | None = None) -> bool:
    """Whether this process can take ``nbytes`` of address space at once, as llama.cpp does when
    it maps each model file whole: reserved with no access and no memory, then given back. iOS
    caps a process's address space far below a terabyte unless its binary carries the
    extended-virtual-addressing entitlement."""
    calls = calls or LibcAddressSpace()
    address = calls.mmap(None, nbytes, PROT_NONE, anon_noreserve(platform), -1, 0)
    if address in (None, 2**64 - 1, -1):  # MAP_FAILED
        return False
    calls.munmap(address, nbytes)
    return True


EXTENDED_VA_ENTITLEMENT = "com.apple.developer.kernel.extended-virtual-addressing"


# Where iOS ends a process's user address space (xnu's MACH_VM_MAX_ADDRESS_RAW for arm64
# outside macOS): the extended-virtual-addressing entitlement raises a process to it, not past it.
IOS_ADDRESS_CEILING = 0x0FC0000000  # 63 GiB


def address_space_limit() -> int | None:
    """This process's address-space limit (RLIMIT_AS, `ulimit -v`), None where unlimited."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
    return None if soft == resource.RLIM_INFINITY else soft


# Past the jumbo ceiling only iOS 18-era kernels built with EXTENDED_USER_VA_SUPPORT go, for a
# binary that also carries this private entitlement: none a user can sign for.
IOS_LARGE_FILE_ENTITLEMENT = "com.apple.private.kernel.large-file-support"


def address_space_fix(platform: str = sys.platform, python: str = sys.executable, total_bytes: int = 0) -> str:
    """What to do when the model's weights need more address space than the process may take."""
    if is_ios(platform):
        return (
            f"iOS gives a process {IOS_ADDRESS_CEILING / 2**30:.0f} GiB at most, with the {EXTENDED_VA_ENTITLEMENT} "
            f"entitlement (ldid -S<entitlements.plist> {os.path.realpath(python)}, README, On the iPhone); a model larger "
            "streams through windows inside it: lower --budget or engine.address_space if it still does not fit"
        )
    limit = address_space_limit()
    has = f"this process may have {limit / 2**30:.1f} GiB (ulimit -v): " if limit is not None else ""
    return has + "raise `ulimit -v`, or lower --budget (the pinned set) or engine.address_space"


@dataclass(frozen=True)
class DescriptorLimit:
    needed: int
    soft: int
    hard: int

    @property
    def enough(self) -> bool:
        return self.soft == resource.RLIM_INFINITY or self.soft >= self.needed

    @staticmethod
    def shown(limit: int) -> str:
        return "unlimited" if limit == resource.RLIM_INFINITY else str(limit)


def descriptor_limit(n_files: int, platform: str = sys.platform) -> DescriptorLimit:
    """The soft limit raised for a model of ``n_files`` files where it can be, against what it needs."""
    needed = descriptors_needed(n_files)
    return DescriptorLimit(needed, *raise_descriptor_limit(needed, platform))


def model_fits_limits(files: list, total_bytes: int, platform: str = sys.platform, reserve: Callable[[int], bool] | None = None) -> str | None:
    """One line naming what this process's limits refuse the model, after raising what can be
    raised; None where both fit. Checked before llama.cpp maps anything: past that, an address
    space too small is a load that fails with no reason, and too few descriptors a read that
    fails halfway through a reply."""
    limit = descriptor_limit(len(files), platform)
    if not limit.enough:
        return (
            f"the model's {len(files)} files need about {limit.needed} open descriptors and this process may have "
            f"{limit.soft} (hard limit {limit.shown(limit.hard)}): run `ulimit -n {limit.needed}` first"
        )
    if total_bytes and not (reserve or (lambda n: can_reserve(n, platform)))(total_bytes):
        return (
            f"this process cannot map the model's {total_bytes / 2**30:.1f} GiB of files at once (out of address space, "
            f"not a damaged file): {address_space_fix(platform, total_bytes=total_bytes)}"
        )
    return None
