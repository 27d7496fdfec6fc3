"""The iPhone path, tested on Linux by injection: iOS's platform name, a universal libllama with
arm64 and arm64e slices, jetsam's memory limit, the descriptor limit, the address space llama.cpp
maps, the SSD panel's engine-counted bytes, and the Darwin placer (F_NOCACHE reads moved in with
mach_vm_remap) running the real engine with an mremap stand-in for Mach."""

from __future__ import annotations

import ctypes
import os
import resource
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from kimitui.engine.addressing import WholeFiles
from kimitui.engine import loadhooks, memory, platform as plat
from kimitui.engine.darwin_placer import VM_FLAGS_OVERWRITE, DarwinCalls, DarwinPlacer
from kimitui.engine.macho import CPU_SUBTYPE_ARM64E, CPU_TYPE_ARM64, FAT_MAGIC, MachOSlotFinder
from kimitui.engine.platform import (
    DARWIN_MAP_ANON, F_NOCACHE, F_RDADVISE, F_RDAHEAD, MAP_FIXED, MAP_PRIVATE, MAP_SHARED, PlatformIO, is_darwin,
)

from helpers import peak_while
from test_fast_start import macho_image
from test_streaming import RecordingSyscalls


def test_ios_is_darwin_for_every_platform_path():
    assert is_darwin("ios") and is_darwin("darwin") and not is_darwin("linux")
    assert plat.is_ios("ios") and plat.is_ios("darwin", "iPhone17,1") and not plat.is_ios("darwin", "arm64")
    calls = RecordingSyscalls()
    io = PlatformIO("ios", calls)
    io.exact_reads(5)
    io.advise_read(5, 0, 4096)
    assert [c[2] for c in calls.calls] == [F_RDAHEAD, F_RDADVISE]


def test_ios_fast_start_takes_the_macho_path(tmp_path):
    image, got = macho_image(["_mmap", "_posix_madvise"])
    lib_file = tmp_path / "libllama.dylib"
    lib_file.write_bytes(image)
    memory_ = ctypes.create_string_buffer(got + 3 * os.sysconf("SC_PAGE_SIZE"))

    class FakeLibrary:
        _name = str(lib_file)
        _handle = 0

    # No finder given: rebind picks the Mach-O one for "ios" itself (the image's base injected).
    hooks = loadhooks.rebind(FakeLibrary, base_address=lambda _h: ctypes.addressof(memory_), platform="ios")
    assert struct.unpack_from("<Q", memory_.raw, got)[0] == hooks.pointer_for("mmap")


def _with_kind(image: bytes, cpusubtype: int) -> bytes:
    return image[:8] + struct.pack("<I", cpusubtype) + image[12:]


def universal(slices: list[tuple[int, bytes]]) -> bytes:
    """A fat file of arm64 slices (cpusubtype, thin image), each on a 16 KiB boundary."""
    header = struct.pack(">II", FAT_MAGIC, len(slices))
    offset = 0x4000
    arch, body = b"", b""
    for subtype, image in slices:
        arch += struct.pack(">IIIII", CPU_TYPE_ARM64, subtype, offset, len(image), 14)
        pad = -(offset + len(image)) % 0x4000
        body += image + b"\0" * pad
        offset += len(image) + pad
    head = header + arch
    return head + b"\0" * (0x4000 - len(head)) + body


@pytest.fixture
def fat_library(tmp_path) -> Path:
    """arm64 (subtype 0) first, arm64e (subtype 2, with the pointer-auth ABI bits set, as
    Apple's tools write it) second; their symbol pointers sit in different orders, so the slot
    addresses tell which slice was read."""
    arm64, _ = macho_image(["_mmap", "_posix_madvise"])
    arm64e, _ = macho_image(["_posix_madvise", "_mmap"])
    path = tmp_path / "libllama.dylib"
    path.write_bytes(universal([(0, arm64), (0x80000000 | CPU_SUBTYPE_ARM64E, _with_kind(arm64e, 0x80000000 | CPU_SUBTYPE_ARM64E))]))
    return path


def test_a_universal_library_is_read_at_the_slice_that_runs(fat_library):
    base = 0x10_0000_0000
    finder = MachOSlotFinder("arm64", header_at=lambda address: (CPU_TYPE_ARM64, 0) if address == base else None)
    found = finder.find(fat_library, base, loadhooks.HOOKED)
    assert [s.address for s in found["mmap"]] == [base + 0x4000]  # arm64's order, not arm64e's
    assert [s.address for s in found["posix_madvise"]] == [base + 0x4000 + 8]


def test_arm64e_is_refused_with_how_to_build_for_arm64(fat_library):
    finder = MachOSlotFinder("arm64", header_at=lambda _a: (CPU_TYPE_ARM64, 0x80000000 | CPU_SUBTYPE_ARM64E))
    with pytest.raises(loadhooks.HookUnavailable, match="arm64e.*PAC-signed.*CMAKE_OSX_ARCHITECTURES=arm64"):
        finder.find(fat_library, 0x10_0000_0000, loadhooks.HOOKED)


def test_by_machine_name_a_universal_library_never_picks_arm64e(tmp_path):
    arm64e, _ = macho_image(["_mmap", "_posix_madvise"])
    path = tmp_path / "libllama.dylib"
    path.write_bytes(universal([(CPU_SUBTYPE_ARM64E, _with_kind(arm64e, CPU_SUBTYPE_ARM64E))]))
    with pytest.raises(loadhooks.HookUnavailable, match="no arm64 slice"):
        MachOSlotFinder("arm64", header_at=lambda _a: None).find(path, 0, loadhooks.HOOKED)


def test_jetsam_caps_the_memory_the_budget_comes_from(monkeypatch):
    class LibSystem:
        @staticmethod
        def os_proc_available_memory():
            return 3 * 2**30

    assert memory.jetsam_headroom("linux", lambda: LibSystem) is None
    assert memory.jetsam_headroom("ios", lambda: LibSystem) == 3 * 2**30
    # A jailbreak's Python says "darwin" on the phone: the machine name tells.
    assert memory.jetsam_headroom("darwin", lambda: LibSystem, machine="iPhone17,1") == 3 * 2**30
    assert memory.jetsam_headroom("darwin", lambda: LibSystem, machine="arm64") is None  # a Mac
    assert memory.jetsam_headroom("ios", lambda: object()) is None  # an iOS before 13: no such call
    monkeypatch.setattr(memory, "jetsam_headroom", lambda: 3 * 2**30)
    monkeypatch.setattr(memory, "cgroup_headroom", lambda: None)
    assert memory.available_memory() <= 3 * 2**30
    assert memory.default_budget() <= int(3 * 2**30 * memory.SAFE_SHARE)


def jetsam_stand_in(limit_mb: int):
    """libSystem past its jetsam limit (limit_mb > 0) or with none (-1, not an app): both answer 0."""

    class LibSystem:
        @staticmethod
        def os_proc_available_memory():
            return 0

        @staticmethod
        def memorystatus_control(command, pid, flags, buffer, size):
            assert command == memory.MEMORYSTATUS_CMD_GET_MEMLIMIT_PROPERTIES and pid == os.getpid() and size == 16
            buffer._obj.active = limit_mb
            return 0

    return LibSystem


def test_jetsam_answering_zero_is_no_headroom_under_a_limit_and_no_answer_without_one():
    assert memory.jetsam_headroom("ios", lambda: jetsam_stand_in(3072)) == 0  # past its limit: nothing left
    assert memory.jetsam_headroom("ios", lambda: jetsam_stand_in(-1)) is None  # started over SSH: free memory decides



class Limits:
    def __init__(self, soft, hard, refuse_above=None):
        self.soft, self.hard, self.refuse_above, self.set = soft, hard, refuse_above, []

    def get(self, _which):
        return self.soft, self.hard

    def put(self, _which, limits):
        if self.refuse_above is not None and limits[0] > self.refuse_above:
            raise ValueError("not allowed to raise maximum limit")
        self.set.append(limits)
        self.soft = limits[0]


def mach_stand_in(resident: int, footprint: int, answer: int = 0, count: int = memory.TASK_VM_INFO_REV1_COUNT):
    """libSystem's task_info as Mach answers TASK_VM_INFO: the struct filled, its length in
    natural_t; ``answer`` a kern_return_t."""

    class LibSystem:
        asked: list = []

        @staticmethod
        def task_info(task, flavor, out, count_out):
            LibSystem.asked.append((task, flavor, count_out._obj.value))
            raw = bytearray(4 * memory.TASK_VM_INFO_REV1_COUNT)
            raw[16:24] = resident.to_bytes(8, "little")
            raw[memory.PHYS_FOOTPRINT_OFFSET:memory.PHYS_FOOTPRINT_OFFSET + 8] = footprint.to_bytes(8, "little")
            ctypes.memmove(out, bytes(raw), len(raw))
            count_out._obj.value = count
            return answer

    return LibSystem


def test_the_footprint_jetsam_weighs_comes_from_machs_task_info():
    lib = mach_stand_in(3 * 2**30, 5 * 2**30)
    assert memory.darwin_footprint("ios", lambda: lib, task=0x103) == (3 * 2**30, 5 * 2**30)
    assert lib.asked == [(0x103, memory.TASK_VM_INFO, memory.TASK_VM_INFO_REV1_COUNT)]
    assert memory.darwin_footprint("linux", lambda: lib, task=0x103) is None
    assert memory.darwin_footprint("ios", lambda: mach_stand_in(1, 2, answer=5), task=0x103) is None  # KERN_FAILURE
    assert memory.darwin_footprint("ios", lambda: mach_stand_in(1, 2, count=30), task=0x103) is None  # a kernel before rev1
    assert memory.darwin_footprint("ios", lambda: object(), task=0x103) is None  # no such call
    assert memory.jetsam_limit_bytes("ios", lambda: jetsam_stand_in(3072)) == 3072 * 2**20
    assert memory.jetsam_limit_bytes("ios", lambda: jetsam_stand_in(-1)) is None
    assert memory.jetsam_limit_bytes("linux", lambda: jetsam_stand_in(3072)) is None


def test_where_psutil_refuses_the_memory_figures_come_from_mach():
    import psutil

    from kimitui.engine.metrics import EngineMetrics, Sampler

    class Sandboxed:
        pid = -1

        def io_counters(self):
            raise AttributeError("io_counters")

        def memory_info(self):
            raise psutil.AccessDenied(os.getpid())

        def cpu_percent(self, interval):
            raise psutil.AccessDenied(os.getpid())

    sampler = Sampler(EngineMetrics(), process=Sandboxed(), device_of=lambda p: None,
                      footprint=lambda: (3 * 2**30, 5 * 2**30), footprint_limit=6 * 2**30)
    snap = sampler.sample()
    assert snap.rss_bytes == 3 * 2**30
    assert (snap.footprint_bytes, snap.footprint_limit_bytes) == (5 * 2**30, 6 * 2**30)
    assert snap.cpu_percent is None


def test_darwins_256_descriptors_are_raised_for_a_split_set():
    needed = plat.descriptors_needed(85)  # a K3 release split in 85 files
    limits = Limits(256, resource.RLIM_INFINITY)
    assert plat.raise_descriptor_limit(needed, "ios", limits.get, limits.put) == (needed, resource.RLIM_INFINITY)
    assert limits.set == [(needed, resource.RLIM_INFINITY)]
    huge = Limits(256, resource.RLIM_INFINITY)  # Darwin refuses more than OPEN_MAX
    assert plat.raise_descriptor_limit(20000, "darwin", huge.get, huge.put)[0] == plat.DARWIN_OPEN_MAX
    kept = Limits(1024, 4096)
    assert plat.raise_descriptor_limit(300, "linux", kept.get, kept.put) == (1024, 4096) and not kept.set


def test_a_descriptor_limit_that_cannot_be_raised_is_one_line_saying_what_to_run(monkeypatch):
    limits = Limits(256, 300)
    monkeypatch.setattr(plat.resource, "getrlimit", limits.get)
    monkeypatch.setattr(plat.resource, "setrlimit", limits.put)
    line = plat.model_fits_limits([f"k3-{i:05d}.gguf" for i in range(85)], 0, "ios")
    assert limits.set == [(300, 300)]  # raised as far as the hard limit lets it
    assert line == (
        "the model's 85 files need about 383 open descriptors and this process may have 300 (hard limit 300): "
        "run `ulimit -n 383` first"
    )


class RefusingAddressSpace:
    def __init__(self):
        self.asked = []

    def mmap(self, address, length, prot, flags, fd, offset):
        self.asked.append((length, prot, flags))
        return ctypes.c_void_p(-1).value

    def munmap(self, address, length):
        raise AssertionError("nothing was mapped")


def test_an_address_space_too_small_says_so_and_what_applies_on_ios():
    space = RefusingAddressSpace()
    assert plat.can_reserve(1_560 * 10**9, "ios", space) is False
    assert space.asked == [(1_560 * 10**9, plat.PROT_NONE, plat.MAP_PRIVATE | 0x1000 | 0x40)]  # Darwin's MAP_ANON | MAP_NORESERVE
    # Past iOS's 63 GiB ceiling no entitlement helps: the entitlement raises the process to it,
    # and the model streams through windows inside it.
    line = plat.model_fits_limits(["k3.gguf"], 1_560 * 10**9, "ios", reserve=lambda n: False)
    assert "cannot map the model's 1452.9 GiB" in line and "out of address space, not a damaged file" in line
    assert "63 GiB at most" in line and plat.EXTENDED_VA_ENTITLEMENT in line and "through windows" in line
    # Below it, the entitlement is what raises a process to the ceiling.
    line = plat.model_fits_limits(["small.gguf"], 20 * 2**30, "ios", reserve=lambda n: False)
    assert plat.EXTENDED_VA_ENTITLEMENT in line and "ldid -S" in line


UNDER_LIMIT = r"""
import sys
from kimitui.engine.session import Engine
from kimitui.engine.state import EngineError
from kimitui.errors import UserError
engine = Engine(sys.argv[1], n_ctx=128, budget=1 << 30)
print("tensor bytes", engine.inspect().tensor_bytes)  # the header, through a bounded window
try:
    engine.load()
except (EngineError, UserError) as exc:
    print("refused:", exc)
"""


def test_under_an_address_space_limit_the_header_reads_and_the_load_says_what_is_short(tmp_path):
    """`ulimit -v` of 8 GiB (the stand-in for iOS's ceiling) on a 30 GiB sparse Kimi K3 cut."""
    from kimitui.model import synth

    spec = synth.plan_like("kimi-k3", None, 1.0, "q4_1", synth.default_tokenizer(), synth.Cut(layers=2))
    path = synth.write_model(spec, tmp_path / "k3.gguf", seed=3, progress=False, sparse=True).paths[0]
    assert path.stat().st_size > 15 * 2**30  # nearly twice the limit
    proc = subprocess.run(
        ["bash", "-c", 'ulimit -v $((8 * 1024 * 1024)) && exec "$0" -c "$1" "$2"', sys.executable, UNDER_LIMIT, str(path)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "tensor bytes" in proc.stdout and "corrupt" not in proc.stdout, proc.stdout
    refused = proc.stdout.split("refused: ", 1)[1]
    assert "windows need at least" in refused and "out of address space, not a damaged file" in refused
    assert "this process may have 8.0 GiB (ulimit -v)" in refused

def test_this_machine_reserves_a_terabyte_and_a_half():
    assert plat.can_reserve(1_560 * 10**9)  # what a 64-bit Linux gives; iOS without the entitlement does not


def test_the_engine_refuses_in_one_line_where_descriptors_run_out(model_path):
    """A real load in a child whose hard descriptor limit is below what the model needs."""
    script = (
        "import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (100, 100))\n"
        "from kimitui.engine.session import Engine\nfrom kimitui.engine.state import EngineError\n"
        "try:\n"
        f"    Engine({str(model_path)!r}, n_ctx=128).load()\n"
        "except EngineError as exc:\n"
        "    print(exc); sys.exit(3)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert "need about 131 open descriptors" in proc.stdout and "ulimit -n 131" in proc.stdout


def test_the_ssd_panel_counts_the_engines_own_reads_where_the_os_has_none():
    import psutil

    from kimitui.engine.metrics import EngineMetrics, Sampler

    class NoCounters:
        pid = -1

        def __init__(self):
            self._real = psutil.Process()

        def io_counters(self):
            raise AttributeError("io_counters")  # psutil on Darwin

        def memory_info(self):
            return self._real.memory_info()

        def cpu_percent(self, interval):
            return 0.0

    metrics = EngineMetrics()
    read = [0]
    metrics.engine_read_source = lambda: read[0]
    sampler = Sampler(metrics, process=NoCounters(), device_of=lambda p: None)
    first = sampler.sample()
    read[0] = 64 * 2**20
    second = sampler.sample()
    assert first.read_counted_by == second.read_counted_by == "engine"
    assert second.process_read_bytes == 64 * 2**20 and second.process_read_rate > 0


# -- the Darwin placer -------------------------------------------------------------------------


class RecordingLib:
    """libSystem as DarwinCalls sees it: every call recorded, memory from the real libc."""

    def __init__(self):
        self.calls = []
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        self._libc_mmap = libc.mmap
        self._libc_mmap.restype = ctypes.c_void_p
        self._libc_mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64)
        lib = self

        class Fn:
            def __init__(self, name, body):
                self.name, self.body = name, body

            def __call__(self, *args):
                lib.calls.append((self.name, *[getattr(a, "_obj", a) for a in args]))
                return self.body(*args)

        def mmap(address, length, prot, flags, fd, offset):
            return address if flags & MAP_FIXED else 0x7000_0000

        def remap(task, target, size, mask, flags, src_task, src, copy, cur, most, inherit):
            return 0

        self.mmap = Fn("mmap", mmap)
        self.munmap = Fn("munmap", lambda a, n: 0)
        self.pread = Fn("pread", lambda fd, address, n, offset: n)
        self.mach_vm_remap = Fn("mach_vm_remap", remap)
        self.mach_vm_deallocate = Fn("mach_vm_deallocate", lambda task, a, n: 0)


def test_darwin_calls_are_libsystems_with_darwins_flags(tmp_path):
    lib, fcntls = RecordingLib(), []
    calls = DarwinCalls(lib, task=0x203, page=16384, fcntl_call=lambda fd, cmd, arg: fcntls.append((cmd, arg)) or arg)
    model = tmp_path / "k3.gguf"
    model.write_bytes(b"\0" * 65536)
    fd = calls.open_uncached(str(model), None)
    os.close(fd)
    assert fcntls == [(F_NOCACHE, 1), (F_RDAHEAD, 0)]  # the cache off, read-ahead off
    calls.map_anonymous(0x1_0000_0000, 32768)
    calls.map_file(0x1_0000_0000, 32768, 9, 16384)
    assert lib.calls[0] == ("mmap", 0x1_0000_0000, 32768, 3, MAP_PRIVATE | DARWIN_MAP_ANON | MAP_FIXED, -1, 0)
    assert lib.calls[1] == ("mmap", 0x1_0000_0000, 32768, 1, MAP_SHARED | MAP_FIXED, 9, 16384)
    lib.calls.clear()
    calls.move(0x7000_0000, 0x1_0000_4000, 16384)
    (name, task, _target, size, mask, flags, src_task, src, copy, *_rest, inherit), dealloc = lib.calls
    assert (name, task, size, mask, flags, src_task, src, copy) == ("mach_vm_remap", 0x203, 16384, 0, VM_FLAGS_OVERWRITE, 0x203, 0x7000_0000, 0)
    assert dealloc == ("mach_vm_deallocate", 0x203, 0x7000_0000, 16384)  # the source's hold dropped: a move


class MremapStandIn:
    """The placer's calls on Linux: mremap in Mach's place, a plain descriptor for F_NOCACHE's.
    Records what it is asked, to show the placer moved shared pages and read the rest in place."""

    def __init__(self):
        from kimitui.engine.direct import MREMAP_FIXED, MREMAP_MAYMOVE, Libc

        self.page = os.sysconf("SC_PAGE_SIZE")
        self._c, self._move = Libc(), MREMAP_MAYMOVE | MREMAP_FIXED
        self.counts = {"in place": 0, "moved": 0, "file": 0, "opened": 0}

    def open_uncached(self, path, mapped_fd):
        self.counts["opened"] += 1
        return os.open(path, os.O_RDONLY)

    def map_anonymous(self, address, length):
        self.counts["in place"] += 1
        self._c.check(self._c.mmap(address, length, 3, 0x22 | 0x10, -1, 0), "mmap")

    def map_file(self, address, length, fd, offset):
        self.counts["file"] += 1
        self._c.check(self._c.mmap(address, length, 1, 0x01 | 0x10, fd, offset), "mmap")

    def allocate(self, length):
        return self._c.check(self._c.mmap(None, length, 3, 0x22, -1, 0), "mmap")

    def free(self, address, length):
        self._c.munmap(address, length)

    def pread(self, fd, address, length, offset):
        return os.preadv(fd, [memoryview((ctypes.c_char * length).from_address(address)).cast("B")], offset)

    def move(self, source, target, length):
        self.counts["moved"] += 1
        self._c.check(self._c.mremap(source, length, length, self._move, target), "mremap")


@pytest.mark.parametrize("address_space", ["auto", 205 * 2**20], ids=["whole", "windows"])
def test_the_darwin_placer_streams_k3_with_the_stock_greedy_tokens(monkeypatch, tmp_path, address_space):
    """The real engine on a K3 cut under a budget a third of it, every streamed byte placed by
    the Darwin placer (mremap standing in for mach_vm_remap): the stock tokens, the budget held.
    Also in the bounded address space (four layers in two slots), where each slice's own pages
    are read in place and its end pages stay the window's."""
    from kimitui.engine.budget import minimum_budget
    from kimitui.model import synth
    from kimitui.model.gguf_map import load_model_map

    from test_kimi_k3 import reply_tokens, stock_reply

    # At three fiftieths of K3's widths an expert's slices span pages: read in place, with
    # shared end pages moved in.
    spec = synth.plan_like("kimi-k3", None, 0.06, "q4_1", synth.default_tokenizer(), synth.Cut(layers=4))
    path = synth.write_model(spec, tmp_path / "k3.gguf", seed=5, progress=False).paths[0]
    expected = stock_reply(path)
    stand_in, made = MremapStandIn(), []

    def darwin_placer(paths, addresses, fds, capacity, platform=None):
        placer = DarwinPlacer.create([str(p) for p in paths], addresses, fds, capacity, calls=stand_in)
        made.append(placer)
        return placer

    monkeypatch.setattr("kimitui.engine.pinning.make_placer", darwin_placer)
    monkeypatch.setattr("kimitui.engine.streaming.make_placer", darwin_placer)
    from kimitui.engine.session import Engine

    model = load_model_map(path)
    budget = minimum_budget(model) + 2 * 2**20
    engine = Engine(path, n_ctx=256, budget=budget, address_space=address_space)
    engine.load()
    engine.pin()
    try:
        assert engine.streamer.placer is not None and isinstance(engine.streamer.placer, DarwinPlacer)
        assert engine.space.bounded == (address_space != "auto")
        peak, tokens = peak_while(engine.metrics.model_resident_source, lambda: reply_tokens(engine))
        assert tokens == expected
        moved = stand_in.counts["moved"] > 0 or engine.space.bounded  # no end page is placed in a window
        assert stand_in.counts["in place"] > 0 and moved and stand_in.counts["file"] > 0, stand_in.counts
        assert engine.streamer.counters()["placement"] == "direct"
        assert 0 < peak <= budget
        assert reply_tokens(engine) == expected  # released pages are the file's again, read anew
    finally:
        engine.close()
    assert all(p is None or p.placed_bytes == 0 for p in made)  # everything given back to the file


class FailingOnce(MremapStandIn):
    """The stand-in whose first read of a range fails (a drive hiccup), then reads."""

    def __init__(self):
        super().__init__()
        self.failed = False

    def pread(self, fd, address, length, offset):
        if not self.failed:
            self.failed = True
            raise OSError(5, "Input/output error")
        return super().pread(fd, address, length, offset)


def test_a_read_that_failed_is_read_again_not_taken_for_data(tmp_path):
    """The streamer asks again for a range whose read failed: the placer must read it, not
    answer from a record of the zeros it mapped there."""
    page = os.sysconf("SC_PAGE_SIZE")
    path = tmp_path / "m.gguf"
    path.write_bytes(bytes(range(256)) * (4 * page // 256))
    fd = os.open(path, os.O_RDONLY)
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64)
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    mapped = libc.mmap(None, 4 * page, 1, 0x01, fd, 0)  # PROT_READ, MAP_SHARED: llama.cpp's mapping
    calls = FailingOnce()
    placer = DarwinPlacer.create([str(path)], WholeFiles({0: mapped}, {0: os.fstat(fd).st_size}), {0: fd}, 1, calls=calls)
    try:
        with pytest.raises(OSError, match="Input/output"):
            placer.place(0, page, page)
        assert not placer.holds(0, page)  # not taken for data...
        assert ctypes.string_at(mapped + page, 4) == b"\0" * 4  # ...but zeros, never a cut file's pages
        assert placer.place(0, page, page) == page  # asked again: read again
        assert placer.holds(0, page) and ctypes.string_at(mapped + page, 8) == bytes(range(8))
        assert placer.blank_file_backed() == []  # the re-read took it off the shield's list
        calls.failed = False  # the drive fails once more
        with pytest.raises(OSError):
            placer.place(0, 2 * page, page)
        assert placer.blank_file_backed() == [(0, 2 * page, page)]  # the shield gives it back to the file
    finally:
        placer.close()
        libc.munmap(mapped, 4 * page)
        os.close(fd)


NO_FADVISE = r"""
import sys
from kimitui.engine import loadhooks
real = loadhooks.libc_function
loadhooks.libc_function = lambda proto, name, libc: None if name == "posix_fadvise" else real(proto, name, libc)
from kimitui.engine.generation import Sampling
from kimitui.engine.session import Engine
engine = Engine(sys.argv[1], n_ctx=256)
engine.load()
assert engine.fast_load_note is None, engine.fast_load_note  # fast start, not the stock load
assert loadhooks.install()._real_fadvise is None
gen = engine.complete("The capital of France is", Sampling(temperature=0.0, max_tokens=6))
list(gen)
print(gen.result.text)
"""


def test_a_libc_without_posix_fadvise_still_loads_with_fast_start(model_path):
    """Darwin's libc has no posix_fadvise: the hooks go on without it (injected here)."""
    from helpers import stock_llama

    proc = subprocess.run([sys.executable, "-c", NO_FADVISE, str(model_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    stock = stock_llama(model_path, n_ctx=256)
    expected = stock("The capital of France is", max_tokens=6, temperature=0.0)["choices"][0]["text"]
    assert proc.stdout.rstrip("\n") == expected
