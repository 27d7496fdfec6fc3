"""Fast start: stop llama.cpp from reading the whole model when it maps it.

Stock llama.cpp maps each model file with MAP_POPULATE and advises WILLNEED over all of it,
which reads the entire file before the first token (most of an hour for a 1.5 TB model over
USB) and floods the page cache the engine manages. Without forking llama.cpp, kimitui rebinds
libllama's own imported ``mmap``, ``posix_madvise`` and ``posix_fadvise`` to wrappers:
MAP_POPULATE is dropped, whole-file WILLNEED and SEQUENTIAL advice are skipped, and every
mapping of a file is recorded, so the engine knows each model file's address and length
without /proc/self/maps (which iOS lacks).

The rebinding is per-platform (a ``SlotFinder``, symbol_slots.py): ELF GOT slots on Linux
(elf.py), Mach-O symbol pointers on Darwin (macho.py). If it cannot be installed the caller falls back to the stock load.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from kimitui.engine.platform import (
    F_GETPATH, HUGE_ALIGN, MAP_FAILED, MAP_FIXED, PROT_READ, PROT_WRITE, is_darwin, reserve_aligned,
)
from kimitui.engine.symbol_slots import CachedSlotFinder, HookUnavailable, Slot, SlotFinder, default_slot_cache

HOOKED = ("mmap", "munmap", "posix_madvise", "posix_fadvise")

MAP_POPULATE = 0x8000 if sys.platform.startswith("linux") else 0
POSIX_MADV_WILLNEED = 3
POSIX_FADV_SEQUENTIAL = 2

MMAP_T = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64)
MUNMAP_T = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t)
MADVISE_T = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
FADVISE_T = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int)


@dataclass(frozen=True)
class Mapping:
    path: str
    address: int
    length: int
    # A duplicate of llama.cpp's descriptor (it closes its own after the load), -1 if none:
    # a range mapped again through the same open file merges back into llama.cpp's mapping
    # instead of leaving a kernel mapping per streamed piece (see direct.py). The engine that
    # takes the mapping closes it.
    fd: int = -1
    phantom: bool = False  # an address range handed to llama.cpp with nothing mapped there (addressing.py)


def _fd_path(fd: int) -> str:
    if sys.platform.startswith("linux"):
        try:
            return os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return f"fd:{fd}"
    if is_darwin():
        import fcntl

        try:
            return fcntl.fcntl(fd, F_GETPATH, b"\0" * 1024).split(b"\0", 1)[0].decode()
        except OSError:
            return f"fd:{fd}"
    return f"fd:{fd}"


def libc_function(prototype, name: str, libc: ctypes.CDLL):
    """``name`` from ``libc`` as ``prototype``; None where this libc has no such symbol (Darwin's
    has no posix_fadvise: xnu exports posix_madvise only)."""
    try:
        return prototype((name, libc))
    except AttributeError:
        return None


class LoadHooks:
    """The installed wrappers. One per process: the library's slots point at this object's callbacks."""

    def __init__(self, libc: ctypes.CDLL, *, fd_path: Callable[[int], str] = _fd_path) -> None:
        self._real_mmap = libc_function(MMAP_T, "mmap", libc)
        self._real_madvise = libc_function(MADVISE_T, "posix_madvise", libc)
        if self._real_mmap is None or self._real_madvise is None:
            raise HookUnavailable("this libc has no mmap or posix_madvise")
        # Optional: llama.cpp calls it on Linux only, and a libllama that imports none is not rebound there.
        self._real_fadvise = libc_function(FADVISE_T, "posix_fadvise", libc)
        self._mprotect = libc.mprotect
        self._mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        self._munmap = libc.munmap
        self._munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
        self._munmap.restype = ctypes.c_int
        # Set by the engine for a load whose files the address space cannot hold: each model
        # file's mapping is then a phantom range from here up, which llama.cpp's unmaps skip.
        self.phantom_next: int | None = None
        self.align = HUGE_ALIGN if sys.platform.startswith("linux") else 0
        self._fd_path = fd_path
        self._lock = threading.Lock()
        self.mappings: list[Mapping] = []
        self.skipped_willneed_bytes = 0
        self.enabled = True
        # Kept as attributes: the C side holds raw pointers to these callbacks.
        self.mmap_cb = MMAP_T(self._mmap)
        self.munmap_cb = MUNMAP_T(self._munmap_hook)
        self.madvise_cb = MADVISE_T(self._madvise)
        self.fadvise_cb = FADVISE_T(self._fadvise)

    def _mmap(self, addr, length, prot, flags, fd, offset):
        result = None
        if self.enabled and fd >= 0 and self.phantom_next is not None and not addr:
            return self._phantom(length, fd)
        if self.enabled and fd >= 0:
            flags &= ~MAP_POPULATE
            if not addr and self.align and length >= self.align and not flags & MAP_FIXED:
                result = self._aligned_mmap(length, prot, flags, fd, offset)
        if result is None:
            result = self._real_mmap(addr, length, prot, flags, fd, offset)
        if fd >= 0 and result not in (None, MAP_FAILED):
            kept = -1
            if self.enabled:
                try:
                    kept = os.dup(fd)
                except OSError:
                    pass  # out of descriptors: streamed pieces go back through the engine's own
            with self._lock:
                self.mappings.append(Mapping(self._fd_path(fd), int(result), int(length), kept))
        return result

    def _phantom(self, length: int, fd: int) -> int:
        result = self.phantom_next
        self.phantom_next = result + -(-length // HUGE_ALIGN) * HUGE_ALIGN
        try:
            kept = os.dup(fd)
        except OSError:
            kept = -1  # the engine opens the file itself then
        with self._lock:
            self.mappings.append(Mapping(self._fd_path(fd), result, int(length), kept, phantom=True))
        return result

    def _munmap_hook(self, addr, length):
        if addr and self._is_phantom(addr, length):
            return 0  # llama.cpp giving back part of a phantom mapping: there is nothing to unmap
        return self._munmap(addr, length)

    def _is_phantom(self, addr: int, length: int) -> bool:
        with self._lock:
            return any(m.phantom and m.address <= addr and addr + length <= m.address + m.length for m in self.mappings)

    def _aligned_mmap(self, length, prot, flags, fd, offset):
        """The model's mapping on a 2 MiB boundary, so that its offsets that are multiples of
        2 MiB are too: the engine's direct reads then move whole huge pages into it (one
        page-table entry each, kept huge for compute's TLB). None if the room cannot be had."""
        start = reserve_aligned(self._real_mmap, self._munmap, length, self.align)
        if start is None:
            return None
        result = self._real_mmap(start, length, prot, flags | MAP_FIXED, fd, offset)
        if result in (None, MAP_FAILED):
            self._munmap(start, length)  # the reservation
        return result

    def _madvise(self, addr, length, advice):
        if addr and self._is_phantom(addr, length):
            return 0
        if self.enabled and advice == POSIX_MADV_WILLNEED and self._is_model_range(addr or 0, length):
            self.skipped_willneed_bytes += length
            return 0
        return self._real_madvise(addr, length, advice)

    def _fadvise(self, fd, offset, length, advice):
        # SEQUENTIAL doubles readahead: on a streamed model that drags in bytes nobody asked for.
        if (self.enabled and advice == POSIX_FADV_SEQUENTIAL) or self._real_fadvise is None:
            return 0
        return self._real_fadvise(fd, offset, length, advice)

    def _is_model_range(self, addr: int, length: int) -> bool:
        with self._lock:
            return any(m.address <= addr and addr + length <= m.address + m.length for m in self.mappings)

    def mark(self) -> int:
        """Where the next load's mappings will start; see ``close_unclaimed``."""
        with self._lock:
            return len(self.mappings)

    def claim(self, path: Path, since: int = 0) -> Mapping | None:
        """The newest mapping of ``path`` made since ``mark()`` returned ``since``, its
        descriptor now the caller's to close; the record stays (WILLNEED over it is still
        skipped), without it. Older loads' mappings may be gone: they are never answered."""
        target = os.path.realpath(path)
        with self._lock:
            for i in range(len(self.mappings) - 1, since - 1, -1):
                m = self.mappings[i]
                if m.path == target:
                    self.mappings[i] = replace(m, fd=-1)
                    return m
        return None

    def close_unclaimed(self, since: int) -> None:
        """Close the descriptors of mappings made since ``mark()`` that nobody claimed (a load
        that failed, or a file that is not the model's)."""
        with self._lock:
            for i in range(since, len(self.mappings)):
                m = self.mappings[i]
                if m.fd >= 0:
                    os.close(m.fd)
                    self.mappings[i] = replace(m, fd=-1)

    def pointer_for(self, name: str) -> int:
        return ctypes.cast({"mmap": self.mmap_cb, "munmap": self.munmap_cb, "posix_madvise": self.madvise_cb, "posix_fadvise": self.fadvise_cb}[name], ctypes.c_void_p).value

    def write_slot(self, slot: Slot, value: int) -> None:
        page = os.sysconf("SC_PAGE_SIZE")
        start = slot.address & ~(page - 1)
        if self._mprotect(start, page, PROT_READ | PROT_WRITE) != 0:
            raise HookUnavailable(f"cannot make the {slot.name} slot writable (mprotect failed)")
        ctypes.c_void_p.from_address(slot.address).value = value
        if slot.read_only_after:
            self._mprotect(start, page, PROT_READ)


def rebind(
    library: ctypes.CDLL,
    *,
    finder: SlotFinder | None = None,
    base_address: Callable[[int], int] | None = None,
    platform: str = sys.platform,
) -> LoadHooks:
    """Point ``library``'s imported mmap/posix_madvise/posix_fadvise at new wrappers."""
    if finder is None:
        # Each OS's finder imported in its branch: start-up loads only the one it runs.
        if platform.startswith("linux"):
            from kimitui.engine.elf import ElfSlotFinder, elf_base_address

            finder, base_address = CachedSlotFinder(ElfSlotFinder(), default_slot_cache()), base_address or elf_base_address
        elif is_darwin(platform):
            from kimitui.engine.macho import MachOSlotFinder, macho_base_address

            finder, base_address = MachOSlotFinder(), base_address or macho_base_address
        else:
            raise HookUnavailable(f"no fast-start support on {platform}")
    path = Path(library._name)
    if not path.is_file():
        raise HookUnavailable(f"cannot find the llama library file ({library._name})")
    try:
        libc = ctypes.CDLL("libc.so.6" if platform.startswith("linux") else None)
    except OSError as exc:
        raise HookUnavailable(f"cannot open libc: {exc}") from None
    hooks = LoadHooks(libc)
    slots = finder.find(path, base_address(library._handle), HOOKED)
    missing = [n for n in ("mmap", "posix_madvise") if n not in slots]
    if missing:
        raise HookUnavailable(f"{path.name} imports no {', '.join(missing)} (llama.cpp changed?)")
    for name, entries in slots.items():
        for slot in entries:
            hooks.write_slot(slot, hooks.pointer_for(name))
    return hooks


_installed: LoadHooks | None = None
_install_lock = threading.Lock()


@contextmanager
def stock_loads():
    """Loads inside run as stock llama.cpp's (MAP_POPULATE, whole-file WILLNEED): a baseline
    loaded in the same process as the engine must not get the engine's fast start."""
    hooks = _installed
    if hooks is None:
        yield
        return
    hooks.enabled = False
    try:
        yield
    finally:
        hooks.enabled = True


def install() -> LoadHooks:
    """Rebind libllama once per process; raises HookUnavailable with the reason."""
    global _installed
    with _install_lock:
        if _installed is None:
            import llama_cpp.llama_cpp as C

            _installed = rebind(C._lib)
        return _installed
