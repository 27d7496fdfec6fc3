"""Darwin/iOS half of fast start: find libllama's imported-symbol pointers in its Mach-O image.

The same walk fishhook does: each __got / __la_symbol_ptr section lists, through the indirect
symbol table, which symbol every pointer slot holds; a slot's run-time address is the image's
slide plus the section address. Parsed from the file on disk (thin or fat), so it is tested on
Linux with a synthetic image.
"""

from __future__ import annotations

import ctypes
import platform
import struct
from pathlib import Path
from typing import Callable

from kimitui.engine.symbol_slots import HookUnavailable, Slot

MH_MAGIC_64 = 0xFEEDFACF
FAT_MAGIC = 0xCAFEBABE
LC_SEGMENT_64 = 0x19
LC_SYMTAB = 0x2
LC_DYSYMTAB = 0xB
S_NON_LAZY_SYMBOL_POINTERS = 0x6
S_LAZY_SYMBOL_POINTERS = 0x7
INDIRECT_SYMBOL_LOCAL = 0x80000000
INDIRECT_SYMBOL_ABS = 0x40000000
CPU_TYPES = {"arm64": 0x0100000C, "x86_64": 0x01000007}
CPU_TYPE_ARM64 = CPU_TYPES["arm64"]
CPU_SUBTYPE_MASK = 0xFF000000  # capability bits (arm64e's pointer-auth ABI version), not the slice's kind
CPU_SUBTYPE_ARM64E = 2


def _slice_kind(cputype: int, cpusubtype: int) -> tuple[int, int]:
    return cputype, cpusubtype & ~CPU_SUBTYPE_MASK & 0xFFFFFFFF


def loaded_header(base_address: int) -> tuple[int, int] | None:
    """(cputype, cpusubtype) of the Mach-O header the loader mapped at ``base_address``: the
    slice of a universal library that is really running. None where no header is there."""
    magic, cputype, cpusubtype = struct.unpack("<Iii", ctypes.string_at(base_address, 12))
    return (cputype & 0xFFFFFFFF, cpusubtype & 0xFFFFFFFF) if magic == MH_MAGIC_64 else None


def _thin_image(data: bytes, running: tuple[int, int] | None, machine: str) -> bytes:
    """The slice of ``data`` the process runs: the one whose kind matches the loaded header
    (a library with arm64 and arm64e slices has two of CPU type arm64), else by machine name."""
    (magic,) = struct.unpack_from(">I", data, 0)
    if magic != FAT_MAGIC:
        return data
    (count,) = struct.unpack_from(">I", data, 4)
    slices = [struct.unpack_from(">IIIII", data, 8 + i * 20) for i in range(count)]
    if running is not None:
        wanted = _slice_kind(*running)
        for cputype, cpusubtype, offset, size, _align in slices:
            if _slice_kind(cputype, cpusubtype) == wanted:
                return data[offset : offset + size]
        raise HookUnavailable(f"the universal library has no slice of the running kind (CPU type {wanted[0]:#x}, subtype {wanted[1]})")
    for cputype, cpusubtype, offset, size, _align in slices:
        if cputype == CPU_TYPES.get(machine) and _slice_kind(cputype, cpusubtype)[1] != CPU_SUBTYPE_ARM64E:
            return data[offset : offset + size]
    raise HookUnavailable(f"the universal library has no {machine} slice")


class MachOSlotFinder:
    """``header_at`` reads the running image's header (injected by tests: their "loaded image"
    is a buffer of their own)."""

    def __init__(self, machine: str | None = None, header_at: Callable[[int], tuple[int, int] | None] = loaded_header) -> None:
        self.machine = machine or platform.machine()
        self._header_at = header_at

    def find(self, library_path: Path, base_address: int, names: tuple[str, ...]) -> dict[str, list[Slot]]:
        try:
            data = library_path.read_bytes()
        except OSError as exc:
            raise HookUnavailable(f"cannot read {library_path.name}: {exc.strerror}") from None
        universal = len(data) >= 8 and struct.unpack_from(">I", data, 0)[0] == FAT_MAGIC
        image = _thin_image(data, self._header_at(base_address) if universal else None, self.machine)
        if len(image) >= 12 and struct.unpack_from("<I", image, 0)[0] == MH_MAGIC_64:
            kind = _slice_kind(*struct.unpack_from("<II", image, 4))
            if kind == (CPU_TYPE_ARM64, CPU_SUBTYPE_ARM64E):
                # Its imports sit in __auth_got, each pointer signed with a key of this process
                # and its own address: a plain address written there fails authentication at the
                # first call, and Python cannot sign one.
                raise HookUnavailable(
                    f"{library_path.name} runs as arm64e, whose imported pointers are PAC-signed and cannot be "
                    "rebound; build llama-cpp-python for arm64 (CMAKE_ARGS=-DCMAKE_OSX_ARCHITECTURES=arm64)"
                )
        if len(image) < 32 or struct.unpack_from("<I", image, 0)[0] != MH_MAGIC_64:
            raise HookUnavailable(f"{library_path.name} is not a 64-bit Mach-O image")
        ncmds = struct.unpack_from("<I", image, 16)[0]
        offset = 32
        text_vmaddr = None
        sections = []  # (segname, addr, size, flags, reserved1)
        symtab = dysymtab = None
        for _ in range(ncmds):
            cmd, cmdsize = struct.unpack_from("<II", image, offset)
            if cmd == LC_SEGMENT_64:
                segname = image[offset + 8 : offset + 24].rstrip(b"\0").decode()
                vmaddr = struct.unpack_from("<Q", image, offset + 24)[0]
                nsects = struct.unpack_from("<I", image, offset + 64)[0]
                if segname == "__TEXT":
                    text_vmaddr = vmaddr
                for i in range(nsects):
                    s = offset + 72 + i * 80
                    addr, size = struct.unpack_from("<QQ", image, s + 32)
                    flags, reserved1 = struct.unpack_from("<II", image, s + 64)
                    sections.append((segname, addr, size, flags, reserved1))
            elif cmd == LC_SYMTAB:
                symtab = struct.unpack_from("<IIII", image, offset + 8)
            elif cmd == LC_DYSYMTAB:
                dysymtab = struct.unpack_from("<18I", image, offset + 8)
            offset += cmdsize
        if text_vmaddr is None or symtab is None or dysymtab is None:
            raise HookUnavailable(f"{library_path.name} lacks __TEXT, a symbol table or an indirect symbol table")
        symoff, nsyms, stroff, _strsize = symtab
        indirectsymoff, nindirect = dysymtab[12], dysymtab[13]
        slide = base_address - text_vmaddr
        wanted = {"_" + n: n for n in names}  # C symbols carry a leading underscore in Mach-O
        found: dict[str, list[Slot]] = {}
        for segname, addr, size, flags, reserved1 in sections:
            if flags & 0xFF not in (S_NON_LAZY_SYMBOL_POINTERS, S_LAZY_SYMBOL_POINTERS):
                continue
            for i in range(size // 8):
                if reserved1 + i >= nindirect:
                    break
                sym_index = struct.unpack_from("<I", image, indirectsymoff + 4 * (reserved1 + i))[0]
                if sym_index & (INDIRECT_SYMBOL_LOCAL | INDIRECT_SYMBOL_ABS) or sym_index >= nsyms:
                    continue
                strx = struct.unpack_from("<I", image, symoff + 16 * sym_index)[0]
                end = image.index(b"\0", stroff + strx)
                name = image[stroff + strx : end].decode(errors="replace")
                if name in wanted:
                    found.setdefault(wanted[name], []).append(
                        Slot(wanted[name], slide + addr + 8 * i, read_only_after=segname == "__DATA_CONST")
                    )
        return found


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p), ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def macho_base_address(handle: int) -> int:
    """Where the library's Mach-O header is mapped: dladdr() of one of its own symbols."""
    libc = ctypes.CDLL(None)
    libc.dlsym.restype = ctypes.c_void_p
    libc.dlsym.argtypes = (ctypes.c_void_p, ctypes.c_char_p)
    symbol = libc.dlsym(handle, b"llama_backend_init")
    info = _DlInfo()
    if not symbol or not libc.dladdr(ctypes.c_void_p(symbol), ctypes.byref(info)) or not info.dli_fbase:
        raise HookUnavailable("dladdr cannot locate libllama's image")
    return int(info.dli_fbase)
