"""Fast start: a load reads metadata, not the model; same greedy tokens; Darwin by injection."""

from __future__ import annotations

import ctypes
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import stock_llama

from kimitui.benchmarks.cgroup import MemoryCgroups
from kimitui.benchmarks.common import drop_from_page_cache
from kimitui.engine import loadhooks
from kimitui.engine.elf import ElfSlotFinder
from kimitui.engine.macho import MachOSlotFinder
from kimitui.engine.symbol_slots import CachedSlotFinder, Slot
from kimitui.errors import UserError
from kimitui.model import synth
from kimitui.model.gguf_map import load_model_map

MIB = 2**20
FAST_LOAD_CGROUP = 192 * MIB  # the test model is 256 MiB

# Runs in a fresh process so the hooks, the I/O counters and RssFile belong to this load alone.
LOAD_SCRIPT = r"""
import json, sys, psutil
from pathlib import Path
from kimitui.engine.generation import Sampling
from kimitui.engine.session import Engine
def model_rss(path):
    # Resident bytes of the model file's own mappings (smaps), not of the shared libraries.
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:
            inside = len(head) >= 6 and head[-1] == str(path.resolve())
        elif inside and line.startswith("Rss:"):
            total += int(head[1]) * 1024
    return total
proc = psutil.Process()
path, fast = Path(sys.argv[1]), sys.argv[2] == "fast"
engine = Engine(path, n_ctx=256, fast_load=fast)
engine.inspect()
before, rss_before = proc.io_counters().read_bytes, proc.memory_info().rss
engine.load()
read = proc.io_counters().read_bytes - before
resident, rss_gain = model_rss(path), proc.memory_info().rss - rss_before
gen = engine.complete("Once upon a time", Sampling(temperature=0.0, max_tokens=12))
list(gen)
print(json.dumps({"read": read, "rss_file": resident, "rss_gain": rss_gain, "text": gen.result.text, "tokens": gen.result.completion_tokens,
                  "mapping": None if engine.mapping is None else [engine.mapping.path, engine.mapping.length],
                  "note": engine.fast_load_note}))
"""


def load_in_subprocess(path: Path, mode: str, memory_limit: int | None = None) -> dict:
    """``memory_limit``: run in a fresh memory cgroup of that size (root and a memory
    controller needed, as for `kimitui bench --cgroup-limit`)."""
    drop_from_page_cache(path)
    command = [sys.executable, "-c", LOAD_SCRIPT, str(path), mode]
    group = None
    if memory_limit is not None:
        try:
            group = MemoryCgroups.require().create(memory_limit)
        except UserError as exc:
            pytest.skip(str(exc))
        command = group.command(command)
    peak = None
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=300)
        if group is not None:
            peak = group.peak_bytes()
    finally:
        if group is not None:
            group.remove()
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["peak"] = peak
    return result


@pytest.fixture(scope="module")
def dense_model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fast") / "dense.gguf"
    spec = synth.plan_dense(256 * MIB, "q4_1", synth.default_tokenizer())
    return synth.write_model(spec, out, seed=3, progress=False).paths[0]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RssFile and ELF hooks are Linux's")
def test_load_reads_metadata_only_and_keeps_greedy_tokens(dense_model):
    size = dense_model.stat().st_size
    metadata = load_model_map(dense_model).tensors[0].offset  # header, tokenizer, tensor infos
    # The fast load runs in a memory cgroup smaller than the model (the interpreter and
    # llama.cpp take ~100 MiB of it, so the model is several times the page cache it has).
    fast = load_in_subprocess(dense_model, "fast", memory_limit=FAST_LOAD_CGROUP)
    stock = load_in_subprocess(dense_model, "stock")
    assert fast["note"] is None
    assert fast["mapping"] == [str(dense_model.resolve()), size]
    assert 0 < fast["peak"] <= FAST_LOAD_CGROUP  # it ran in the cgroup
    # The stock load holds the whole model (read into llama.cpp's own buffers: a model that fits
    # needs its file no more); fast start leaves the mapping to the engine.
    assert stock["rss_gain"] > 0.8 * size and stock["rss_file"] == 0
    assert fast["rss_file"] < 0.05 * size, fast
    # Bytes from storage during the load (the kernel counts this process's reads):
    # stock reads the model, fast start metadata plus at most 1% of it.
    assert stock["read"] > 0.5 * size, stock["read"]
    assert fast["read"] <= metadata + 0.01 * size, (fast["read"], metadata)
    assert fast["tokens"] == stock["tokens"] == 12
    assert fast["text"] == stock["text"]


def test_unavailable_hooks_fall_back_to_the_stock_load(monkeypatch, model_path):
    from kimitui.engine.generation import Sampling
    from kimitui.engine.session import Engine

    def refuse():
        raise loadhooks.HookUnavailable("libllama.so has no dynamic symbol table (stripped?)")

    monkeypatch.setattr(loadhooks, "install", refuse)
    engine = Engine(model_path, n_ctx=256)
    engine.load()
    assert engine.mapping is None
    assert "fast start unavailable (libllama.so has no dynamic symbol table" in engine.fast_load_note
    gen = engine.complete("Hello", Sampling(temperature=0.0, max_tokens=4))
    list(gen)
    assert gen.result.completion_tokens == 4
    engine.close()


def test_elf_finder_rejects_a_file_that_is_not_elf(tmp_path):
    bogus = tmp_path / "libllama.so"
    bogus.write_bytes(b"not an ELF file at all" * 10)
    with pytest.raises(loadhooks.HookUnavailable, match="cannot read libllama.so"):
        ElfSlotFinder().find(bogus, 0, loadhooks.HOOKED)


def macho_image(slots: list[str], segname: str = "__DATA") -> tuple[bytes, int]:
    """A minimal 64-bit Mach-O dylib: __TEXT, one symbol-pointer section, symtab, dysymtab."""
    names = sorted(set(slots) | {"_other"})
    strtab = b"\0" + b"".join(n.encode() + b"\0" for n in names)
    strx = {n: strtab.index(n.encode() + b"\0") for n in names}
    symbols = b"".join(struct.pack("<IBBHQ", strx[n], 0x01, 0, 0, 0) for n in names)
    indirect = [names.index(n) for n in slots]
    header_size, seg_size, sect_size = 32, 72, 80
    cmds_size = seg_size + (seg_size + sect_size) + 24 + 80
    symoff = header_size + cmds_size
    indoff = symoff + len(symbols)
    stroff = indoff + 4 * len(indirect)
    got_addr = 0x4000
    text = struct.pack("<II16sQQQQiiII", 0x19, seg_size, b"__TEXT", 0, 0x4000, 0, 0, 5, 5, 0, 0)
    data = struct.pack("<II16sQQQQiiII", 0x19, seg_size + sect_size, segname.encode(), got_addr, 0x1000, 0, 0, 3, 3, 1, 0)
    sect = struct.pack("<16s16sQQIIIIIIII", b"__got", segname.encode(), got_addr, 8 * len(slots), 0, 3, 0, 0, 0x6, 0, 0, 0)
    symtab = struct.pack("<IIIIII", 0x2, 24, symoff, len(names), stroff, len(strtab))
    dysym = struct.pack("<II18I", 0xB, 80, *([0] * 12), indoff, len(indirect), 0, 0, 0, 0)
    header = struct.pack("<IiiIIIII", 0xFEEDFACF, 0x0100000C, 0, 6, 4, cmds_size, 0, 0)
    body = header + text + data + sect + symtab + dysym + symbols + struct.pack(f"<{len(indirect)}I", *indirect) + strtab
    return body, got_addr




def test_macho_finder_maps_symbol_pointers(tmp_path):
    image, got = macho_image(["_other", "_posix_madvise", "_mmap"], segname="__DATA_CONST")
    lib = tmp_path / "libllama.dylib"
    lib.write_bytes(image)
    found = MachOSlotFinder("arm64").find(lib, 0x10_0000_0000, loadhooks.HOOKED)
    assert [s.address for s in found["posix_madvise"]] == [0x10_0000_0000 + got + 8]
    assert [s.address for s in found["mmap"]] == [0x10_0000_0000 + got + 16]
    assert found["mmap"][0].read_only_after  # __DATA_CONST goes back to read-only
    assert "posix_fadvise" not in found  # Darwin has none; llama.cpp only calls it on Linux


def test_darwin_rebind_by_injection_writes_the_slots(tmp_path):
    """The whole Darwin install path, with the library image's pointers living in our own buffer."""
    image, got = macho_image(["_mmap", "_posix_madvise"])
    lib_file = tmp_path / "libllama.dylib"
    lib_file.write_bytes(image)
    page = os.sysconf("SC_PAGE_SIZE")
    memory = ctypes.create_string_buffer(got + 3 * page)
    base = ctypes.addressof(memory)

    class FakeLibrary:  # a loaded library as ctypes shows it: a file name and a handle
        _name = str(lib_file)
        _handle = 0

    hooks = loadhooks.rebind(FakeLibrary, finder=MachOSlotFinder("arm64"), base_address=lambda _h: base, platform="darwin")
    written = struct.unpack_from("<QQ", memory.raw, got)
    assert written == (hooks.pointer_for("mmap"), hooks.pointer_for("posix_madvise"))

    # The wrappers themselves: record a mapping, skip WILLNEED over it, pass other advice through.
    fd = os.open(lib_file, os.O_RDONLY)
    try:
        mmap_fn = loadhooks.MMAP_T(written[0])
        addr = mmap_fn(None, len(image), loadhooks.PROT_READ, 0x1, fd, 0)  # MAP_SHARED
    finally:
        os.close(fd)
    mapping = hooks.claim(lib_file)
    assert mapping.address == addr and mapping.fd >= 0  # a duplicate of the descriptor mapped...
    assert os.fstat(mapping.fd).st_ino == os.stat(lib_file).st_ino
    os.close(mapping.fd)
    assert hooks.claim(lib_file).fd == -1  # ...handed over once
    madvise_fn = loadhooks.MADVISE_T(written[1])
    assert madvise_fn(addr, len(image) // page * page, loadhooks.POSIX_MADV_WILLNEED) == 0
    assert hooks.skipped_willneed_bytes == len(image) // page * page
    assert madvise_fn(addr, page, 1) == 0  # POSIX_MADV_RANDOM reaches libc
    assert hooks.skipped_willneed_bytes == len(image) // page * page


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ELF hooks are Linux's")
def test_stock_loads_turn_the_hooks_off_only_inside(model_path):
    """bench's in-process baseline loads as stock llama.cpp, beside an engine that loaded fast."""
    from kimitui.engine.session import Engine

    engine = Engine(model_path, n_ctx=256)
    engine.load()
    hooks = loadhooks.install()
    skipped = hooks.skipped_willneed_bytes
    with loadhooks.stock_loads():
        assert not hooks.enabled
        plain = stock_llama(model_path, n_ctx=256)
    assert hooks.enabled
    assert hooks.skipped_willneed_bytes == skipped  # stock llama.cpp's whole-file WILLNEED went through
    again = Engine(model_path, n_ctx=256)
    again.load()  # and the next fast load skips it again
    assert hooks.skipped_willneed_bytes > skipped
    again.close()
    del plain
    engine.close()


def test_an_engine_asked_for_a_stock_load_gets_one_though_the_hooks_are_in(model_path):
    """The hooks are process-wide: an Engine(fast_load=False) after a fast one must not go
    through them (WILLNEED skipped, a duplicated descriptor nobody claims)."""
    import os

    from kimitui.engine.session import Engine

    def open_on_model() -> int:
        """Descriptors of this process open on the model file (other threads' come and go)."""
        target = os.path.realpath(model_path)
        count = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                count += os.readlink(f"/proc/self/fd/{fd}") == target
            except OSError:
                pass
        return count

    engine = Engine(model_path, n_ctx=256)
    engine.load()
    hooks = loadhooks.install()
    skipped, fds = hooks.skipped_willneed_bytes, open_on_model()
    stock = Engine(model_path, n_ctx=256, fast_load=False)
    stock.load()
    assert hooks.skipped_willneed_bytes == skipped and stock.mapping is None
    assert open_on_model() == fds  # nothing duplicated and left open
    stock.close()
    engine.close()


def test_slot_cache_skips_the_elf_read_until_the_library_changes(tmp_path):
    lib = tmp_path / "libllama.so"
    lib.write_bytes(b"\x7fELF" + bytes(60))
    calls = []

    class Counting:
        def find(self, library_path, base_address, names):
            calls.append(base_address)
            return {"mmap": [Slot("mmap", base_address + 0x40, True)]}

    finder = CachedSlotFinder(Counting(), tmp_path / "cache" / "slots.json")
    first = finder.find(lib, 0x1000, loadhooks.HOOKED)
    again = finder.find(lib, 0x9000, loadhooks.HOOKED)  # loaded elsewhere this time: same offsets
    assert calls == [0x1000]
    assert first["mmap"][0].address == 0x1040 and again["mmap"][0].address == 0x9040
    assert again["mmap"][0].read_only_after is True
    os.utime(lib, ns=(1, 1))  # a different library file: read again
    finder.find(lib, 0x1000, loadhooks.HOOKED)
    assert calls == [0x1000, 0x1000]
