"""Where a loaded library's imported-function pointers are: what fast start rewrites.

Each binary format has its finder (``elf.py`` on Linux, ``macho.py`` on Darwin); both answer
with ``Slot``s, and a ``CachedSlotFinder`` remembers what one found for the next start.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


class HookUnavailable(Exception):
    """Why fast start cannot be installed here; the message is shown as one line."""


@dataclass(frozen=True)
class Slot:
    """One imported-function pointer inside the loaded library, and the page range holding it."""

    name: str
    address: int
    read_only_after: bool  # in a RELRO / read-only segment: restore PROT_READ after writing


class SlotFinder(Protocol):
    def find(self, library_path: Path, base_address: int, names: tuple[str, ...]) -> dict[str, list[Slot]]: ...


class CachedSlotFinder:
    """Remembers where another finder found the slots, per library file (path, inode, size,
    mtime), as offsets from the load address: later starts skip reading the library file (the
    ELF read was a twelfth of the time to ready). A changed library is a new key and is read again."""

    def __init__(self, inner: SlotFinder, cache_file: Path) -> None:
        self.inner = inner
        self.cache_file = cache_file

    def find(self, library_path: Path, base_address: int, names: tuple[str, ...]) -> dict[str, list[Slot]]:
        import json

        from kimitui.config import replace_file

        try:
            st = library_path.stat()
            key = f"{library_path.resolve()}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{','.join(names)}"
        except OSError:
            return self.inner.find(library_path, base_address, names)
        try:
            cached = json.loads(self.cache_file.read_text())
        except (OSError, ValueError):
            cached = None
        if isinstance(cached, dict) and cached.get("key") == key:
            return {
                name: [Slot(name, base_address + offset, bool(relro)) for offset, relro in entries]
                for name, entries in cached["slots"].items()
            }
        found = self.inner.find(library_path, base_address, names)
        slots = {name: [(s.address - base_address, s.read_only_after) for s in entries] for name, entries in found.items()}
        try:
            replace_file(self.cache_file, json.dumps({"key": key, "slots": slots}))
        except OSError:
            pass  # a read-only cache dir costs the next start its ELF read, nothing more
        return found


def default_slot_cache() -> Path:
    from kimitui.config import cache_dir

    return cache_dir() / "libllama-slots.json"
