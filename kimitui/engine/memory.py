"""How much memory this process may really use: MemAvailable capped by any cgroup limit, and on
iOS by jetsam's limit for this process.

MemAvailable alone ignores container and cgroup limits, which is how naive sizing gets a
process OOM-killed; both cgroup v1 and v2 files are read where present. On iOS the system's free
memory is not what kills a process: jetsam does, at a per-process limit far below the phone's
RAM, and libSystem says how far off it is (``os_proc_available_memory``, iOS 13 and later).
"""

from __future__ import annotations

import ctypes
import errno
import gc
import os
import sys
from pathlib import Path
from typing import Callable

import psutil

SAFE_SHARE = 0.75
_NO_LIMIT = 1 << 60  # cgroup v1 reports "unlimited" as a huge page-rounded number


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value >= _NO_LIMIT else value


def _own_cgroup_dirs(proc_root: Path, cgroup_root: Path) -> list[tuple[Path, str]]:
    """(directory, version) of this process's memory cgroup(s)."""
    try:
        lines = (proc_root / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        if controllers == "":
            found.append((cgroup_root / rel.lstrip("/"), "v2"))
        elif "memory" in controllers.split(","):
            found.append((cgroup_root / "memory" / rel.lstrip("/"), "v1"))
    return found


def cgroup_headroom(proc_root: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> tuple[int, int] | None:
    """(limit, usage) of the tightest memory cgroup above this process, or None."""
    best: tuple[int, int] | None = None
    for directory, version in _own_cgroup_dirs(proc_root, cgroup_root):
        d = directory
        while True:
            if version == "v1":
                limit, usage = _read_int(d / "memory.limit_in_bytes"), _read_int(d / "memory.usage_in_bytes")
            else:
                limit, usage = _read_int(d / "memory.max"), _read_int(d / "memory.current")
            if limit is not None and (best is None or limit - (usage or 0) < best[0] - best[1]):
                best = (limit, usage or 0)
            if d == cgroup_root or d.parent == d or cgroup_root not in d.parents:
                break
            d = d.parent
    return best


MEMORYSTATUS_CMD_GET_MEMLIMIT_PROPERTIES = 8  # xnu bsd/sys/kern_memorystatus.h


class _MemlimitProperties(ctypes.Structure):
    _fields_ = [("active", ctypes.c_int32), ("active_attr", ctypes.c_uint32),
                ("inactive", ctypes.c_int32), ("inactive_attr", ctypes.c_uint32)]


def jetsam_limit_mb(lib) -> int | None:
    """This process's jetsam limit in MB (memorystatus_control); None where it has none (-1) or
    the call is refused."""
    try:
        call = lib.memorystatus_control
    except AttributeError:
        return None
    call.restype = ctypes.c_int
    call.argtypes = (ctypes.c_uint32, ctypes.c_int32, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t)
    props = _MemlimitProperties()
    if call(MEMORYSTATUS_CMD_GET_MEMLIMIT_PROPERTIES, os.getpid(), 0, ctypes.byref(props), ctypes.sizeof(props)) != 0:
        return None
    return props.active if props.active > 0 else None


def jetsam_headroom(platform: str = sys.platform, libsystem: Callable[[], ctypes.CDLL] | None = None,
                    machine: str | None = None) -> int | None:
    """Bytes this process may still take before jetsam kills it (iOS); None elsewhere, or where
    jetsam sets it no limit. ``os_proc_available_memory`` returns 0 both for a process past its
    limit and for one that is not an app (kimitui started over SSH): the limit itself
    (memorystatus_control) tells the two apart, and 0 under a limit is no headroom at all."""
    from kimitui.engine.platform import is_ios

    if not is_ios(platform, machine):
        return None
    try:
        lib = (libsystem or (lambda: ctypes.CDLL(None)))()
        call = lib.os_proc_available_memory
    except (OSError, AttributeError):
        return None
    call.restype, call.argtypes = ctypes.c_size_t, ()
    room = int(call())
    if room:
        return room
    return 0 if jetsam_limit_mb(lib) is not None else None


TASK_VM_INFO = 22  # xnu osfmk/mach/task_info.h
PHYS_FOOTPRINT_OFFSET = 144  # task_vm_info's rev1 field, after 2 + 17 eight-byte sizes (4-byte packed)
TASK_VM_INFO_REV1_COUNT = 38  # its length in natural_t: what every iOS since 9 answers


def darwin_footprint(platform: str = sys.platform, libsystem: Callable[[], ctypes.CDLL] | None = None,
                     task: int | None = None) -> tuple[int, int] | None:
    """(resident size, physical footprint) of this process from Mach's task_info (TASK_VM_INFO);
    None off Darwin or where the call is refused. The footprint is what jetsam weighs against
    its limit (anonymous and wired memory, compressed pages included; file pages that can be
    dropped excluded), so on iOS it, not RSS, is the figure that ends a process."""
    from kimitui.engine.platform import is_darwin

    if not is_darwin(platform):
        return None
    try:
        lib = (libsystem or (lambda: ctypes.CDLL(None)))()
        call = lib.task_info
        if task is None:  # mach_task_self() is a macro for this global: our own task's port
            task = ctypes.c_uint.in_dll(lib, "mach_task_self_").value
    except (OSError, AttributeError, ValueError):
        return None
    call.restype = ctypes.c_int
    call.argtypes = (ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint))
    info = (ctypes.c_uint32 * TASK_VM_INFO_REV1_COUNT)()
    count = ctypes.c_uint(TASK_VM_INFO_REV1_COUNT)
    if call(task, TASK_VM_INFO, ctypes.addressof(info), ctypes.byref(count)) != 0 or count.value < TASK_VM_INFO_REV1_COUNT:
        return None
    raw = bytes(info)
    resident = int.from_bytes(raw[16:24], "little")
    return resident, int.from_bytes(raw[PHYS_FOOTPRINT_OFFSET:PHYS_FOOTPRINT_OFFSET + 8], "little")


def jetsam_limit_bytes(platform: str = sys.platform, libsystem: Callable[[], ctypes.CDLL] | None = None,
                       machine: str | None = None) -> int | None:
    """This process's jetsam limit (iOS), None where it has none or off iOS."""
    from kimitui.engine.platform import is_ios

    if not is_ios(platform, machine):
        return None
    try:
        lib = (libsystem or (lambda: ctypes.CDLL(None)))()
    except OSError:
        return None
    limit = jetsam_limit_mb(lib)
    return None if limit is None else limit * 2**20


def memory_sources() -> list[tuple[str, int]]:
    """What each source says this process may still take: the OS's free memory, a cgroup's
    limit, jetsam's (iOS). The smallest is what the budget may use."""
    sources = [("free memory", int(psutil.virtual_memory().available))]
    cg = cgroup_headroom()
    if cg is not None:
        limit, usage = cg
        sources.append(("memory cgroup", max(0, limit - usage)))
    jetsam = jetsam_headroom()
    if jetsam is not None:
        sources.append(("jetsam", jetsam))
    return sources


def available_memory() -> int:
    return min(room for _, room in memory_sources())


def default_budget(room: int | None = None) -> int:
    """engine.budget "auto": a safe share of ``room``, by default of what is really available;
    the streaming engine sizes its pinned set from it."""
    return int((available_memory() if room is None else room) * SAFE_SHARE)


def resolve_budget(setting: int | str, room: int | None = None) -> int:
    """engine.budget in bytes: as given, or "auto" (``default_budget``)."""
    return default_budget(room) if setting == "auto" else int(setting)


def mapped_resident_bytes(
    ranges: list[tuple[int, int]], smaps: Path = Path("/proc/self/smaps"), shared_name: str | None = None,
) -> int | None:
    """Resident bytes of this process inside the address ranges ``[(start, end), ...]``: the
    model's mappings, whatever backs each page there (the file, or anonymous pages a direct
    read moved in). From /proc/self/smaps (Linux); None where there is none.

    Only areas wholly inside a range count: llama.cpp unmaps the unused head and tail of a
    model's mapping after the load, and the allocator may then grow its own areas into that
    room (one seen here reached 1.7 MB into the span and held other memory).

    ``shared_name``: memory mapped twice (the bounded layout's pinned store) counts only in its
    own mapping, the last range: its other mappings inside the first ranges are the same pages."""
    try:
        text = smaps.read_text()
    except OSError:
        return None
    page = os.sysconf("SC_PAGE_SIZE")
    ranges = [(start, -(-end // page) * page) for start, end in ranges]  # areas end on pages
    total = 0
    inside = False
    for line in text.splitlines():
        head = line.split(" ", 1)[0]
        if "-" in head and not head.endswith(":"):
            lo, _, hi = head.partition("-")
            try:
                start, end = int(lo, 16), int(hi, 16)
            except ValueError:
                inside = False
                continue
            inside = any(r_start <= start and end <= r_end for r_start, r_end in ranges)
            if inside and shared_name is not None and shared_name in line:
                home = ranges[-1]
                inside = home[0] <= start and end <= home[1]
        elif inside and head == "Rss:":
            total += int(line.split()[1]) * 1024
    return total


def tensor_data_spans(model, space) -> list[tuple[int, int]]:
    """What of each whole-file mapping in ``space`` (addressing.WholeFiles) stays mapped after
    llama.cpp's load: it unmaps the pages wholly before the first tensor and after the last
    (llama_mmap::unmap_fragment), and the allocator may reuse that room, so only the pages
    holding ``model``'s tensor data are the model's."""
    page = os.sysconf("SC_PAGE_SIZE")
    bounds: dict[int, tuple[int, int]] = {}
    for t in model.tensors:
        lo, hi = bounds.get(t.file, (t.offset, t.offset + t.n_bytes))
        bounds[t.file] = (min(lo, t.offset), max(hi, t.offset + t.n_bytes))
    return [
        (space.at(file, lo // page * page), space.at(file, -(-hi // page) * page))
        for file, (lo, hi) in sorted(bounds.items()) if file in space.bases
    ]


# The most address range pagemap_resident_bytes reads (without PAGEMAP_SCAN, 8 bytes a page:
# 32 MiB of entries at 16 GiB; with it, still a walk of every page table there); beyond it smaps
# is cheaper, since a model that large has large experts and so fewer areas.
PAGEMAP_MOST = 16 * 2**30
_PAGEMAP_CHUNK = 1 << 16  # entries per read: 64 Ki read 4 GiB in 16-19 ms here, 1 Mi in 37 ms


class _ScanArgs(ctypes.Structure):  # struct pm_scan_arg (linux/fs.h)
    _fields_ = [(name, ctypes.c_uint64) for name in (
        "size", "flags", "start", "end", "walk_end", "vec", "vec_len", "max_pages",
        "category_inverted", "category_mask", "category_anyof_mask", "return_mask",
    )]


class _PageRegion(ctypes.Structure):  # struct page_region
    _fields_ = [("start", ctypes.c_uint64), ("end", ctypes.c_uint64), ("categories", ctypes.c_uint64)]


_PAGEMAP_SCAN = (3 << 30) | (ctypes.sizeof(_ScanArgs) << 16) | (ord("f") << 8) | 16  # _IOWR('f', 16, ...)
_PAGE_IS_PRESENT = 1 << 3
_SCAN_REGIONS = 1024


def pagemap_resident_bytes(ranges: list[tuple[int, int]], pagemap: str = "/proc/self/pagemap") -> int | None:
    """Resident bytes of this process in the address ranges ``[(start, end), ...]``, each wholly
    mapped by us: the pages whose page-table entry is present, whatever backs them. Its cost is
    the ranges' length, not the number of areas, where smaps walks and prints every area of the
    process: with a small-expert MoE's tens of thousands of placed slices one smaps read took
    0.8 s and held the mappings' lock meanwhile, stalling compute's page faults. Linux 6.7's
    PAGEMAP_SCAN hands back runs of present pages (4 GiB resident: 2-5 ms here); an older
    kernel has each page's entry read (16-19 ms). None where there is no pagemap."""
    try:
        fd = os.open(pagemap, os.O_RDONLY)
    except OSError:
        return None
    try:
        present = _scanned_present(fd, ranges)
        return present if present is not None else _entries_present(fd, ranges)
    except OSError:
        return None
    finally:
        os.close(fd)


def _scanned_present(fd: int, ranges: list[tuple[int, int]]) -> int | None:
    """Present bytes in ``ranges`` by PAGEMAP_SCAN; None where the kernel has no such ioctl."""
    import fcntl

    page = os.sysconf("SC_PAGE_SIZE")
    regions = (_PageRegion * _SCAN_REGIONS)()
    present = 0
    for start, end in ranges:
        at = start // page * page
        while at < end:
            args = _ScanArgs(
                size=ctypes.sizeof(_ScanArgs), start=at, end=end, vec=ctypes.addressof(regions),
                vec_len=_SCAN_REGIONS, category_mask=_PAGE_IS_PRESENT, return_mask=_PAGE_IS_PRESENT,
            )
            try:
                found = fcntl.ioctl(fd, _PAGEMAP_SCAN, args)
            except OSError as exc:
                if exc.errno in (errno.ENOTTY, errno.EINVAL, errno.EOPNOTSUPP):
                    return None
                raise
            present += sum(region.end - region.start for region in regions[:found])
            # A walk that did not fill the vector is complete, and its walk_end is not followed:
            # it may lag the last run (Linux 6.18 put one 1,024 pages before it).
            if found < _SCAN_REGIONS:
                break
            at = max(regions[found - 1].end, args.walk_end)
    return present


def _entries_present(fd: int, ranges: list[tuple[int, int]]) -> int:
    """Present bytes in ``ranges`` from each page's pagemap entry (bit 63)."""
    import numpy as np

    page = os.sysconf("SC_PAGE_SIZE")
    present = 0
    for start, end in ranges:
        first, last = start // page, -(-end // page)
        for at in range(first, last, _PAGEMAP_CHUNK):
            count = min(_PAGEMAP_CHUNK, last - at)
            entries = np.frombuffer(os.pread(fd, count * 8, at * 8), dtype=np.uint64)
            present += int(np.count_nonzero(entries >> np.uint64(63)))
    return present * page


MALLOC_ARENAS = 2
_M_ARENA_MAX = -8  # glibc's mallopt parameter


def cap_malloc_arenas(arenas: int = MALLOC_ARENAS) -> bool:
    """Cap glibc's malloc arenas (one per thread that allocates at once, up to eight per core).

    Every API request decodes on a thread of its own, and each new thread may get an arena of
    its own whose freed memory glibc keeps: in `kimitui bench-soak` the process outside the
    model's pages grew 50 MiB over 1,080 requests and was still growing, against 17 MiB, flat
    after the first 180, with two arenas. Compute allocates little (llama.cpp's buffers are made
    at load), so fewer arenas cost nothing measurable. A MALLOC_ARENA_MAX the user set wins.
    True where the cap was set (glibc)."""
    if "MALLOC_ARENA_MAX" in os.environ or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others: no mallopt, no per-thread arenas to cap
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return mallopt(_M_ARENA_MAX, arenas) == 1


# Python's default: a young-generation collection every 700 new container objects.
YOUNG_COLLECTION_EVERY = 20_000


def settle_collector() -> None:
    """Keep Python's cyclic garbage collector off a streamed model's critical path.

    A streamed prompt makes and drops tens of thousands of small objects (reads, their futures,
    expert units) while compute waits on the eval callback, and each collection holds the GIL
    the I/O threads need. At the default rate (one every 700 new objects, the older generations
    walking the model's map too) collections took 11% of the CPU of a 128-token prompt on the
    README's MoE example; collecting the young generation every 20,000 objects took that prompt
    from 2.51-2.75 s to 2.10-2.41 s (in process, three alternating pairs). Freezing what the load
    made out of collections as well gained little more, and would keep whatever a re-pin leaves
    behind uncollected."""
    young, middle, old = gc.get_threshold()
    if young:  # 0: collection was turned off
        gc.set_threshold(max(young, YOUNG_COLLECTION_EVERY), middle, old)
