"""Linux half of fast start: find libllama's imported-symbol slots in its ELF image."""

from __future__ import annotations

import ctypes
import struct
from pathlib import Path

from kimitui.engine.symbol_slots import HookUnavailable, Slot


class ElfSlotFinder:
    """Linux: the GOT entries that the library's PLT relocations fill for each symbol.

    pyelftools finds the sections; the symbol and relocation tables are unpacked in bulk with
    struct, because walking libllama's thousands of entries one pyelftools object at a time
    cost a fifth of a second of every start."""

    def find(self, library_path: Path, base_address: int, names: tuple[str, ...]) -> dict[str, list[Slot]]:
        try:
            from elftools.common.exceptions import ELFError
            from elftools.elf.elffile import ELFFile
            from elftools.elf.relocation import RelocationSection
        except ImportError:
            raise HookUnavailable("pyelftools is not installed") from None
        found: dict[str, list[Slot]] = {}
        try:
            with open(library_path, "rb") as fh:
                elf = ELFFile(fh)
                dynsym = elf.get_section_by_name(".dynsym")
                if dynsym is None:
                    raise HookUnavailable(f"{library_path.name} has no dynamic symbol table (stripped?)")
                order = "<" if elf.little_endian else ">"
                wide = elf.elfclass == 64
                wanted = _symbol_indices(dynsym.data(), elf.get_section(dynsym["sh_link"]).data(), names, order, wide)
                relro = [
                    (seg["p_vaddr"], seg["p_vaddr"] + seg["p_memsz"])
                    for seg in elf.iter_segments()
                    if seg["p_type"] == "PT_GNU_RELRO"
                ]
                for section in elf.iter_sections():
                    if not isinstance(section, RelocationSection) or section["sh_link"] == 0:
                        continue
                    for offset, sym_index in _relocations(section.data(), section.is_RELA(), order, wide):
                        name = wanted.get(sym_index)
                        if name is not None:
                            in_relro = any(lo <= offset < hi for lo, hi in relro)
                            found.setdefault(name, []).append(Slot(name, base_address + offset, in_relro))
        except (OSError, ELFError, struct.error) as exc:
            raise HookUnavailable(f"cannot read {library_path.name}: {exc}") from None
        return found


def _symbol_indices(symtab: bytes, strtab: bytes, names: tuple[str, ...], order: str, wide: bool) -> dict[int, str]:
    """Index in the symbol table -> name, for the symbols called `names`."""
    by_offset = {}
    for name in names:
        # Any place the name ends a string: linkers share tails ("mmap" inside "xyz_mmap").
        needle = name.encode() + b"\0"
        at = strtab.find(needle)
        while at != -1:
            by_offset[at] = name
            at = strtab.find(needle, at + 1)
    entry = struct.Struct(order + ("IBBHQQ" if wide else "IIIBBH"))  # st_name comes first in both
    return {
        index: by_offset[fields[0]]
        for index, fields in enumerate(entry.iter_unpack(symtab[: len(symtab) // entry.size * entry.size]))
        if fields[0] in by_offset
    }


def _relocations(table: bytes, with_addend: bool, order: str, wide: bool):
    """(offset, symbol index) of every entry of a REL or RELA table."""
    fmt = ("QQq" if with_addend else "QQ") if wide else ("IIi" if with_addend else "II")
    entry, shift = struct.Struct(order + fmt), 32 if wide else 8
    for fields in entry.iter_unpack(table[: len(table) // entry.size * entry.size]):
        if fields[1] >> shift:
            yield fields[0], fields[1] >> shift


def elf_base_address(handle: int) -> int:
    # glibc's dlopen handle is the library's struct link_map; its first field is l_addr.
    return ctypes.cast(handle, ctypes.POINTER(ctypes.c_size_t))[0]
