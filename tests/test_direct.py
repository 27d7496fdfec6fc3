"""Direct placement on Linux: O_DIRECT reads moved into a file mapping with mremap, the bytes
compute sees are the file's, the page cache stays out of it, and release maps the file back."""

from __future__ import annotations

import ctypes
import fcntl
import os
import random
import sys
from pathlib import Path

import pytest

from helpers import takes_direct_reads
from kimitui.engine.addressing import WholeFiles
from kimitui.benchmarks.common import cached_bytes, drop_from_page_cache
from kimitui.engine.direct import MAP_SHARED, PIECE_BYTES, PROT_READ, DirectPlacer, Libc, split_pieces

MIB = 2**20
PAGE = os.sysconf("SC_PAGE_SIZE")

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="O_DIRECT and mremap are Linux's")


@pytest.mark.parametrize(
    "offset,end",
    [(0, 10 * MIB), (100, 10 * MIB + 7), (PAGE - 1, PAGE + 1), (5, 900), (3 * MIB + 17, 3 * MIB + 2 * PAGE + 5)],
)
def test_pieces_cover_the_range_with_whole_pages_placed(offset, end):
    pieces = split_pieces(offset, end, PAGE)
    assert pieces[0][0] == offset and sum(length for _, length, _ in pieces) == end - offset
    for (start, length, placed), following in zip(pieces, pieces[1:] + [(end, 0, False)]):
        assert start + length == following[0]  # contiguous
        if placed:
            assert start % PAGE == 0 and length % PAGE == 0 and 0 < length <= PIECE_BYTES
            # a piece never crosses a PIECE_BYTES boundary of the file: the same split every time
            assert start // PIECE_BYTES == (start + length - 1) // PIECE_BYTES
    # only the two ends may be partial pages, read through the page cache
    assert all(placed for _, _, placed in pieces[1:-1])


def _mapped_ranges(path: Path) -> list[tuple[int, int]]:
    """This process's mappings of ``path`` (start, end), from /proc/self/maps."""
    out = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == str(path):
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            out.append((lo, hi))
    return out


@pytest.fixture
def mapped_file(tmp_path):
    path = tmp_path / "weights.bin"
    data = random.Random(1).randbytes(20 * MIB + 123)
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)  # dirty pages would stay in the page cache whatever we advise
    libc = Libc()
    address = libc.check(libc.mmap(None, len(data), PROT_READ, MAP_SHARED, fd, 0), "mmap")
    if not takes_direct_reads(path):
        libc.munmap(address, len(data))
        os.close(fd)
        pytest.skip(f"{tmp_path} takes no O_DIRECT (the buffered placement is tested by injection below)")
    placer = DirectPlacer.create([str(path)], WholeFiles({0: address}, {0: os.fstat(fd).st_size}), {0: fd}, capacity=8)
    assert placer is not None, "O_DIRECT works here, so direct placement must"
    yield path, data, address, placer
    placer.close()
    libc.munmap(address, len(data))
    os.close(fd)


def test_placed_bytes_are_the_files_and_skip_the_page_cache(mapped_file):
    path, data, address, placer = mapped_file
    drop_from_page_cache(path)
    offset, end = 3 * MIB + 77, 13 * MIB + 5
    placed = [(s, n) for s, n, p in split_pieces(offset, end, PAGE) if p]
    assert sum(n for _, n in placed) > 9 * MIB
    for start, length in placed:
        assert placer.place(0, start, length) == length
    assert placer.placed_bytes == sum(n for _, n in placed)
    first, last = placed[0][0], placed[-1][0] + placed[-1][1]
    assert ctypes.string_at(address + first, last - first) == data[first:last]
    cached = cached_bytes(path)
    assert cached is not None and cached < MIB, "O_DIRECT reads must not fill the page cache"
    # The placed range is anonymous memory inside the file's mapping: the file's own VMAs skip it.
    assert not any(lo < address + last and address + first < hi for lo, hi in _mapped_ranges(path))

    placer.release(0, offset, end - offset)
    assert placer.placed_bytes == 0
    # Mapped back: the file covers the whole range again, and reading it faults the file's bytes in.
    covered = sum(min(hi, address + last) - max(lo, address + first) for lo, hi in _mapped_ranges(path) if lo < address + last and address + first < hi)
    assert covered == last - first
    # Mapped back through the open file of the original mapping, the pieces merge back into it:
    # one kernel mapping again, not one per piece (a terabyte model would run out of them).
    assert len(_mapped_ranges(path)) == 1
    assert ctypes.string_at(address, len(data)) == data


def _areas_within(lo: int, hi: int) -> int:
    """How many of this process's mappings overlap [lo, hi)."""
    count = 0
    for line in Path("/proc/self/maps").read_text().splitlines():
        a, b = (int(x, 16) for x in line.split(maxsplit=1)[0].split("-"))
        count += a < hi and lo < b
    return count


def _resident_pages(address: int, length: int) -> int:
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(address // PAGE * 8)
        entries = pagemap.read(length // PAGE * 8)
    return sum(int.from_bytes(entries[i : i + 8], "little") >> 63 for i in range(0, len(entries), 8))


def test_slices_in_the_arena_are_read_in_place_with_no_mapping_call_each(mapped_file):
    """Small slices in the arena: read straight into place (the file's bytes, shared end pages
    included), no kernel mapping made per slice, pages given back with the mapping intact, and
    the file mapped back whole when the placer closes."""
    path, data, address, placer = mapped_file
    drop_from_page_cache(path)
    lo, hi = 2 * MIB, 18 * MIB
    assert placer.make_arena({0: [(lo, hi)]}) and placer.reads_in_place
    areas = _areas_within(address, address + len(data))
    # 30 KiB slices, one after another, not page-aligned: neighbours share an end page.
    slices = [(lo + 100 + i * 30 * 1024, 30 * 1024) for i in range(200)]
    edges_read: set[int] = set()
    inners: list[int] = []
    for offset, length in slices:
        first, end = offset // PAGE * PAGE, -(-(offset + length) // PAGE) * PAGE
        inner = (first + PAGE, end - first - 2 * PAGE)
        inners.append(inner[0])
        fresh = [e for e in (first, end - PAGE) if e not in edges_read]
        edges_read.update(fresh)
        start = min([inner[0]] + fresh)
        stop = max([inner[0] + inner[1]] + [e + PAGE for e in fresh])
        assert placer.place_slice(0, start, stop - start, [inner], fresh) == stop - start
    span = slices[0][0], slices[-1][0] + slices[-1][1]
    assert ctypes.string_at(address + span[0], span[1] - span[0]) == data[span[0] : span[1]]
    assert _areas_within(address, address + len(data)) == areas, "a slice in the arena makes no mapping of its own"
    cached = cached_bytes(path)
    assert cached is not None and cached < MIB, "O_DIRECT reads must not fill the page cache"
    placed = _resident_pages(address + lo, hi - lo)
    assert placed * PAGE >= span[1] - span[0]

    for start in inners + sorted(edges_read):
        placer.release_in_place(0, start)
    assert placer.placed_bytes == 0
    assert _resident_pages(address + lo, hi - lo) == 0, "given back: no page of the arena stays resident"
    assert _areas_within(address, address + len(data)) == areas

    placer.close()  # the file is mapped back over the arena, through the mapping's own open file
    assert len(_mapped_ranges(path)) == 1
    assert ctypes.string_at(address, len(data)) == data


def test_neighbouring_slices_in_the_arena_go_back_in_one_call_and_a_failed_one_keeps_only_its_own(mapped_file, monkeypatch):
    """The slices one eviction gives back together: those side by side freed by one madvise, the
    others left as they were, a part the placer does not hold handed back to the caller. Where
    a run's call fails, each of its slices is tried on its own: only one that cannot be given
    back stays placed, and the failure is returned."""
    path, data, address, placer = mapped_file
    drop_from_page_cache(path)
    lo, hi = 2 * MIB, 18 * MIB
    assert placer.make_arena({0: [(lo, hi)]})
    size = 8 * PAGE
    pieces = [(lo + i * size, size) for i in range(40)]  # whole-page slices, side by side
    for start, length in pieces:
        assert placer.place_slice(0, start, length, [(start, length)], []) == length
    calls = []
    madvise = placer._libc.madvise
    monkeypatch.setattr(placer._libc, "madvise", lambda at, length, advice: calls.append(length) or madvise(at, length, advice))
    not_held = (hi + PAGE, PAGE)
    assert placer.release_many(0, pieces[:10] + pieces[20:30] + [not_held]) == ([not_held], None)
    assert sorted(calls) == [10 * size, 10 * size], "one call for each run of neighbours"
    assert _resident_pages(address + pieces[0][0], 10 * size) == 0
    assert _resident_pages(address + pieces[20][0], 10 * size) == 0
    kept = pieces[10][0], pieces[20][0]
    assert ctypes.string_at(address + kept[0], kept[1] - kept[0]) == data[kept[0] : kept[1]]
    assert placer.placed_bytes == 20 * size

    stuck = address + pieces[13][0]  # the one slice whose pages cannot be given back

    def failing(at, length, advice):
        if length > size or at == stuck:
            ctypes.set_errno(22)
            return -1
        return madvise(at, length, advice)

    monkeypatch.setattr(placer._libc, "madvise", failing)
    rest, failure = placer.release_many(0, pieces[10:20])
    assert rest == [] and isinstance(failure, OSError) and "freeing" in str(failure)
    assert placer.placed_bytes == 11 * size, "only the slice that could not be given back stays placed"
    assert placer.holds(0, pieces[13][0])
    assert _resident_pages(address + pieces[10][0], 3 * size) == 0
    monkeypatch.setattr(placer._libc, "madvise", madvise)
    assert placer.release_many(0, [pieces[13]] + pieces[30:]) == ([], None)
    assert placer.placed_bytes == 0


def test_pool_buffers_are_reused_and_a_spent_pool_says_so(mapped_file):
    path, data, address, placer = mapped_file
    pieces = [(s, n) for s, n, p in split_pieces(0, len(data), PAGE) if p]
    for start, length in pieces:
        assert placer.place(0, start, length) == length
    made = placer._made
    placer.release(0, 0, len(data))
    for start, length in pieces:
        placer.place(0, start, length)
    assert placer._made == made  # the same buffers again, no new memory
    placer.release(0, 0, len(data))
    fd = os.open(path, os.O_RDONLY)
    small = DirectPlacer.create([str(path)], WholeFiles({0: address}, {0: os.fstat(fd).st_size}), {0: fd}, capacity=1)
    try:
        (a, n), (b, m) = pieces[:2]
        assert small.place(0, a, n) == n
        assert small.place(0, a, n) == n  # still placed: nothing read again
        assert small.place(0, b, m) is None  # spent: the caller reads through the page cache instead
    finally:
        small.close()
        os.close(fd)
    assert ctypes.string_at(address, len(data)) == data


def test_a_short_file_gives_a_short_count_and_leaves_the_mapping_alone(mapped_file):
    path, data, address, placer = mapped_file
    os.truncate(path, 2 * MIB)
    assert placer.place(0, 4 * MIB, PAGE) == 0
    assert placer.placed_bytes == 0
    assert ctypes.string_at(address, 4096) == data[:4096]


def test_a_range_that_cannot_be_given_back_keeps_its_bytes(mapped_file):
    path, data, address, placer = mapped_file
    start, length = PIECE_BYTES, PIECE_BYTES
    assert placer.place(0, start, length) == length
    good_fd = placer._file_fds[0]
    placer._file_fds[0] = -1  # mapping the file back fails (EBADF)
    with pytest.raises(OSError):
        placer.release(0, start, length)
    assert placer.placed_bytes == length  # still placed, so still the file's bytes, not zeros
    assert ctypes.string_at(address + start, length) == data[start : start + length]
    placer._file_fds[0] = good_fd
    placer.release(0, start, length)
    assert placer.placed_bytes == 0 and ctypes.string_at(address, len(data)) == data


def test_a_smaller_pool_gives_its_spare_buffers_back(mapped_file):
    path, data, address, placer = mapped_file
    pieces = [(s, n) for s, n, p in split_pieces(0, len(data), PAGE) if p][:4]
    for start, length in pieces:
        assert placer.place(0, start, length) == length
    placer.release(0, 0, len(data))
    assert placer._made == 4 and sum(map(len, placer._free.values())) == 4
    placer.capacity = 1
    assert placer._made == 1 and sum(map(len, placer._free.values())) == 1


def test_a_failed_release_is_reported_and_the_dropper_lives_on():
    from kimitui.engine.streaming import Dropper

    errors: list[str] = []
    released: list[int] = []

    def release(r):
        if r == 1:
            raise OSError(12, "Cannot allocate memory")
        released.append(r)

    dropper = Dropper(release, errors.append)
    try:
        dropper.later("a", [1, 2])
        dropper.flush()  # returns: the thread survived the error
        dropper.later("b", [3])
        dropper.flush()
        assert released == [2, 3]
        assert len(errors) == 1 and "Cannot allocate memory" in errors[0]
    finally:
        dropper.close()


def test_a_hole_a_failed_call_left_is_refilled_and_another_mapping_there_is_never_mapped_over(mapped_file, tmp_path):
    path, data, address, placer = mapped_file
    libc = Libc()
    start = 2 * PIECE_BYTES
    libc.munmap(address + start, PAGE)  # what a failed mremap onto the range may leave
    placer._refill(0, start, PAGE, 12)
    assert ctypes.string_at(address + start, PAGE) == data[start : start + PAGE]  # the file again

    other = tmp_path / "other.bin"
    other.write_bytes(b"\x5a" * PAGE)
    fd = os.open(other, os.O_RDONLY)
    libc.munmap(address + start, PAGE)
    # Someone else's mmap took the hole before the engine could refill it.
    foreign = libc.mmap(address + start, PAGE, PROT_READ, MAP_SHARED | 0x10, fd, 0)  # MAP_FIXED
    assert foreign == address + start
    with pytest.raises(OSError, match="lost bytes"):
        placer._refill(0, start, PAGE, 12)
    assert ctypes.string_at(address + start, PAGE) == b"\x5a" * PAGE  # theirs, untouched
    placer._map_file(0, start, PAGE)  # the test's own clean-up: the mapping whole again
    os.close(fd)


def refuse_o_direct(monkeypatch, at: str) -> list[int]:
    """Make the placer meet a file system without O_DIRECT (Linux 6.6 and later serve it even
    on tmpfs): refused at open with EINVAL, as tmpfs did, or taken at open and refused at the
    first read, as some FUSE mounts do. Returns the descriptors refused at read."""
    refused: list[int] = []
    if at == "open":
        real_open = DirectPlacer._open

        def _open(path, mapped_fd, flags):
            if flags & os.O_DIRECT:
                raise OSError(22, "Invalid argument")
            return real_open(path, mapped_fd, flags)

        monkeypatch.setattr(DirectPlacer, "_open", staticmethod(_open))
    else:
        real_preadv = os.preadv

        def preadv(fd, buffers, offset):
            if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
                refused.append(fd)
                raise OSError(22, "Invalid argument")
            return real_preadv(fd, buffers, offset)

        monkeypatch.setattr(os, "preadv", preadv)
    return refused


@pytest.mark.parametrize("at", ["open", "read"])
def test_without_o_direct_the_bytes_come_through_the_page_cache_and_are_still_placed(tmp_path, monkeypatch, at):
    """Where the file system refuses O_DIRECT the placer reads through the page cache, drops
    the cache's copy and still moves the bytes into anonymous memory: the file cut short then
    cannot SIGBUS compute at a placed range, and the budget sees every byte."""
    refused = refuse_o_direct(monkeypatch, at)
    path = tmp_path / "weights.bin"
    data = random.Random(2).randbytes(12 * MIB + 5)
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    libc = Libc()
    address = libc.check(libc.mmap(None, len(data), PROT_READ, MAP_SHARED, fd, 0), "mmap")
    placer = DirectPlacer.create([str(path)], WholeFiles({0: address}, {0: os.fstat(fd).st_size}), {0: fd}, capacity=4)
    try:
        assert placer is not None
        assert placer.direct is (at == "read")  # learnt at the first read there
        drop_from_page_cache(path)
        assert placer.place(0, PIECE_BYTES, PIECE_BYTES) == PIECE_BYTES
        assert placer.copy_in(0, 2 * PIECE_BYTES, 2 * PAGE) == 2 * PAGE
        assert not placer.direct and (at == "open" or len(refused) == 1)
        cached = cached_bytes(path)
        assert cached is not None and cached < MIB, "the page cache's copy is dropped after the read"
        placed = (PIECE_BYTES, 2 * PIECE_BYTES + 2 * PAGE)
        assert not any(lo < address + placed[1] and address + placed[0] < hi for lo, hi in _mapped_ranges(path))
        os.truncate(path, PAGE)  # the drive cut: the file's pages past the end would SIGBUS
        assert ctypes.string_at(address + placed[0], placed[1] - placed[0]) == data[placed[0] : placed[1]]
        with open(path, "r+b") as f:  # back, as after a reconnect
            f.write(data)
        placer.release(0, PIECE_BYTES, PIECE_BYTES)
        placer.release_in_place(0, 2 * PIECE_BYTES)
        assert placer.placed_bytes == 0 and ctypes.string_at(address, len(data)) == data
    finally:
        if placer is not None:
            placer.close()
        libc.munmap(address, len(data))
        os.close(fd)


def test_readers_that_meet_the_refusal_together_all_switch_to_the_page_cache(tmp_path, monkeypatch):
    """Several I/O threads meet EINVAL on the same file at once: one opens the buffered
    descriptor, the others retry on it, and no read fails."""
    from concurrent.futures import ThreadPoolExecutor

    refuse_o_direct(monkeypatch, "read")
    path = tmp_path / "weights.bin"
    data = random.Random(3).randbytes(8 * PIECE_BYTES)
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    libc = Libc()
    address = libc.check(libc.mmap(None, len(data), PROT_READ, MAP_SHARED, fd, 0), "mmap")
    placer = DirectPlacer.create([str(path)], WholeFiles({0: address}, {0: os.fstat(fd).st_size}), {0: fd}, capacity=8)
    try:
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda i: placer.place(0, i * PIECE_BYTES, PIECE_BYTES), range(8)))
        assert got == [PIECE_BYTES] * 8 and not placer.direct
        assert ctypes.string_at(address, len(data)) == data
    finally:
        placer.close()
        libc.munmap(address, len(data))
        os.close(fd)


def test_a_large_slice_reads_onto_spare_pages_and_its_release_leaves_no_mapping_behind(mapped_file):
    """A slice from DirectPlacer.spare_from on lands on spare pages moved under it (faulted in
    before, so the read faults none), with the file's bytes; given back, its place is the arena's
    again, merged with the rest (no mapping of its own left), and none of its pages stay."""
    path, data, address, placer = mapped_file
    drop_from_page_cache(path)
    lo, hi = 2 * MIB, 6 * MIB
    assert placer.make_arena({0: [(lo, hi)]})
    areas = _areas_within(address, address + len(data))
    spare = placer.spare
    spare.allow(MIB)
    spare.fill()
    assert spare.held == MIB
    start, length = lo + 3 * PAGE, placer.spare_from
    assert placer.place_slice(0, start, length, [(start, length)], []) == length
    assert spare.held == MIB - length, "the read took its pages from the spare"
    assert ctypes.string_at(address + start, length) == data[start : start + length]
    placer.release_in_place(0, start)
    assert _resident_pages(address + start, length) == 0
    assert _areas_within(address, address + len(data)) == areas, "its place merged back into the arena"
    spare.close()
    assert spare.held == 0
