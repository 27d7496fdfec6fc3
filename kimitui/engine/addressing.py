"""Where the model's bytes live in this process's address space.

``WholeFiles``: llama.cpp maps each model file whole, and a byte of the model sits at its file's
mapping plus its offset. That needs as much address space as the files are large, and iOS ends
a process's at 63 GiB: Kimi K3 (1.5 TB) cannot be mapped there at all.

``Windows``, the bounded layout, used where the files are larger than the address space the
model may take (``engine.address_space``). llama.cpp's mapping of each file is a phantom: the
load hooks hand it an address range above every user address (nothing is mapped there, so
nothing is reserved), and llama.cpp sets each weight's data pointer into it. Before ggml first
computes with a weight, the eval callback points it (and any view of it) at the weight's place
in a few real regions instead (``WeightPointers``):

- the non-layer tensors (embeddings, output) in a fixed region of their own;
- layer L's tensors in slot L mod S, at their offset within the layer, so that every layer's
  pointers stay put while the slot is filled with one layer after another. Taking a slot for a
  layer (``claim``) maps that layer's file range over the slot (read-only, random access: no
  fault-around) and the layer's pinned pages over that; the streamer then places streamed
  pages in it exactly as in a whole mapping. A slot is only claimed once every page placed for
  the layer before has been given back.
- the pinned set in a store of its own (``PinnedStore``: memory that can be mapped twice, a
  memfd on Linux, POSIX shared memory on Darwin), read and locked once: pinned bytes are never
  read twice. A weight the store holds whole is pointed at the store itself (its pages stay
  mapped whoever holds its slot); the rest is mapped into a slot each time its layer takes one.

Every run of consecutive same-layer tensors keeps its file offset modulo 2 MiB, so direct reads
still move whole huge pages in. A routed expert tensor spans its slot whole, but only the routed
experts' pages are placed there. What S is, and what it costs, is in docs/design.md.
"""

from __future__ import annotations

import bisect
import ctypes
import os
import sys
from dataclasses import dataclass

from kimitui.engine.platform import (
    HUGE_ALIGN, IOS_ADDRESS_CEILING, LIBC_NAME, MAP_FAILED, MAP_FIXED, MAP_SHARED, PROT_NONE, PROT_READ, PROT_WRITE,
    address_space_limit, anon_noreserve, bind_mmap, is_ios, reserve_aligned,
)
from kimitui.engine.state import EngineError
from kimitui.model.gguf_map import ByteRange, ModelMap
from kimitui.units import format_bytes

# Phantom mappings start here: above every user address on x86-64 (47 bits), arm64 Linux (48)
# and iOS (63 GiB), so a stray use of one faults at once instead of reading someone's memory.
PHANTOM_BASE = 1 << 48
MADV_RANDOM = 1  # Linux and Darwin: no read-around, and (Linux) no fault-around
MIN_SLOTS = 2  # one layer computing, the next one arriving
# Layer tensors ggml may read before their layer starts: Kimi K3's residual attention scores the
# banked stack with them (res_mix), an op whose inputs exist from the block's first layer on, so
# the graph may order it inside an earlier layer. They get a second place, in the fixed region.
FLOATING = ("attn_res_score", "ffn_res_score")


class Calls:
    """libc's mmap, munmap, madvise and mlock, errors as OSError."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(LIBC_NAME, use_errno=True)
        self._mmap, self._munmap = bind_mmap(libc)
        self._madvise = libc.madvise
        self._madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        self._mlock = libc.mlock
        self._mlock.argtypes = (ctypes.c_void_p, ctypes.c_size_t)

    @staticmethod
    def _failed(what: str) -> OSError:
        err = ctypes.get_errno()
        return OSError(err, f"{what}: {os.strerror(err)}")

    def mmap(self, address, length: int, prot: int, flags: int, fd: int, offset: int) -> int:
        got = self._mmap(address, length, prot, flags, fd, offset)
        if got in (None, MAP_FAILED):
            raise self._failed(f"mmap of {format_bytes(length)}")
        return got

    def munmap(self, address: int, length: int) -> None:
        self._munmap(address, length)

    def madvise(self, address: int, length: int, advice: int) -> None:
        self._madvise(address, length, advice)

    def mlock(self, address: int, length: int) -> str | None:
        if self._mlock(address, length) != 0:
            return os.strerror(ctypes.get_errno())
        return None

    def reserve(self, length: int) -> int:
        """Address space for the windows, no access and no memory: counted against the limit
        now, so that running out is said at load, not mid-reply."""
        got = reserve_aligned(self._mmap, self._munmap, length, HUGE_ALIGN, PROT_NONE, anon_noreserve())
        if got is None:
            raise self._failed(f"reserving {format_bytes(length)} of address space")
        return got


def _up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class Run:
    """Consecutive tensors of one file and one layer (None: outside the layers), file bytes
    [lo, hi), placed ``place`` bytes into its region: congruent to ``lo`` modulo 2 MiB."""

    file: int
    lo: int
    hi: int
    layer: int | None
    place: int


def _runs(model: ModelMap) -> list[tuple[int, int, int, int | None]]:
    runs: list[list] = []
    for t in sorted(model.tensors, key=lambda t: (t.file, t.offset)):
        if runs and runs[-1][0] == t.file and runs[-1][3] == t.layer:
            runs[-1][2] = t.offset + t.n_bytes
        else:
            runs.append([t.file, t.offset, t.offset + t.n_bytes, t.layer])
    return [tuple(r) for r in runs]


def _placed(runs, page: int) -> tuple[list[Run], int]:
    """``runs`` one after another from 0, each on its own 2 MiB-aligned stretch; the extent."""
    out, cursor = [], 0
    for file, lo, hi, layer in runs:
        place = cursor + lo % HUGE_ALIGN
        out.append(Run(file, lo, hi, layer, place))
        cursor = _up(place + _up(hi, page) - lo, HUGE_ALIGN)
    return out, cursor


def is_floating(tensor) -> bool:
    """A layer tensor ggml may read before its layer starts (``FLOATING``)."""
    parts = tensor.name.split(".")
    return tensor.layer is not None and len(parts) > 2 and parts[2] in FLOATING


def _floating(model: ModelMap) -> list[tuple[int, int, int, None]]:
    return [
        (t.file, t.offset, t.offset + t.n_bytes, None)
        for t in sorted(model.tensors, key=lambda t: (t.file, t.offset))
        if is_floating(t)
    ]


@dataclass(frozen=True)
class WindowPlan:
    fixed: tuple[Run, ...]  # the non-layer tensors' runs, in the fixed region
    floating: tuple[Run, ...]  # layer tensors read outside their layer (FLOATING): their second place
    layers: tuple[tuple[Run, ...], ...]  # each layer's runs, placed within a slot
    fixed_bytes: int
    slot_bytes: int
    n_slots: int
    store_bytes: int  # room the pinned set may take (its own region)
    tensors: tuple[tuple[int, int, int], ...] = ()  # (file, lo, hi) of each layer tensor, in file order

    @property
    def total_bytes(self) -> int:
        return self.fixed_bytes + self.n_slots * self.slot_bytes + self.store_bytes


def plan_windows(model: ModelMap, bound: int, budget: int, page: int | None = None) -> WindowPlan:
    """Room for a pinned set as large as the budget (or what ``bound`` bytes of address space
    leave beside the fixed region and two slots), then as many slots as the rest holds, one per
    layer at most. EngineError if not two."""
    page = page or os.sysconf("SC_PAGE_SIZE")
    runs = _runs(model)
    fixed, fixed_bytes = _placed([r for r in runs if r[3] is None] + _floating(model), page)
    n_fixed = sum(1 for r in runs if r[3] is None)
    fixed, floating = fixed[:n_fixed], fixed[n_fixed:]
    layers, slot_bytes = [], 0
    for layer in range(model.n_layers):
        placed, extent = _placed([r for r in runs if r[3] == layer], page)
        layers.append(tuple(placed))
        slot_bytes = max(slot_bytes, extent)
        spread = extent - model.layers[layer].n_bytes
        if spread > max(model.layers[layer].n_bytes, 64 * 2**20):
            raise EngineError(
                f"layer {layer}'s tensors are scattered over the file ({format_bytes(extent)} of windows for "
                f"{format_bytes(model.layers[layer].n_bytes)}): rewrite it with `kimitui shard` to stream it in a bounded address space"
            )
    least = min(MIN_SLOTS, model.n_layers)
    store_bytes = max(0, min(budget, bound - fixed_bytes - least * slot_bytes))
    room = bound - fixed_bytes - store_bytes
    n_slots = min(model.n_layers, max(0, room // slot_bytes if slot_bytes else model.n_layers))
    if n_slots < least:
        need = fixed_bytes + least * slot_bytes
        raise EngineError(
            f"the model's windows need at least {format_bytes(need)} ({format_bytes(fixed_bytes)} outside the "
            f"layers, two layers of {format_bytes(slot_bytes)}) and {format_bytes(bound)} may be taken"
        )
    tensors = tuple(sorted((t.file, t.offset, t.offset + t.n_bytes) for t in model.tensors if t.layer is not None))
    return WindowPlan(tuple(fixed), tuple(floating), tuple(layers), fixed_bytes, slot_bytes, n_slots, store_bytes, tensors)


class WholeFiles:
    """Each file mapped whole by llama.cpp (the layout when the address space allows it)."""

    bounded = False

    def __init__(self, bases: dict[int, int], lengths: dict[int, int]) -> None:
        self.bases = bases
        self.lengths = lengths

    def at(self, file: int, offset: int) -> int:
        return self.bases[file] + offset

    def owns(self, layer: int | None) -> bool:
        return True

    def spans(self) -> list[tuple[int, int]]:
        return [(base, base + self.lengths[file]) for file, base in self.bases.items()]

    def holds(self, file: int, lo: int, hi: int) -> bool:
        """Whether [lo, hi) lies in ``file``'s place (an area /proc/self/maps lists)."""
        base = self.bases.get(file)
        return base is not None and base <= lo and hi <= base + _up(self.lengths[file], os.sysconf("SC_PAGE_SIZE"))


class StoreTooLarge(Exception):
    """The bounded layout's pinned set would pass the address space kept for it."""


class PinnedStore:
    """The pinned set's memory: whole pages of the model, each range at its own offset in a
    memory object that can be mapped twice (a memfd on Linux, POSIX shared memory elsewhere).
    Mapped once whole at ``home`` (its room in the windows' reservation: the address space it
    needs was taken at load), read into and locked there, and into a slot whenever its layer
    takes one."""

    NAME = "kimitui-pinned"

    def __init__(self, ranges: list[ByteRange], page: int, calls: Calls, home: int, room: int) -> None:
        self.calls = calls
        # (the range, rounded out to whole pages, where in the store those pages are)
        self.pieces: list[tuple[ByteRange, ByteRange, int]] = []
        at = 0
        for r in ranges:
            lo, hi = r.offset // page * page, _up(r.end, page)
            self.pieces.append((r, ByteRange(r.file, lo, hi - lo), at))
            at += hi - lo
        self.size = at
        if at > room:
            raise StoreTooLarge(
                f"the pinned set ({format_bytes(at)}) is larger than the address space left for it "
                f"({format_bytes(room)}): lower the budget or raise engine.address_space"
            )
        self.address = home
        self.fd = self._open(max(at, page))
        try:
            if at:
                calls.mmap(home, at, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, self.fd, 0)
        except OSError:
            os.close(self.fd)
            raise

    @classmethod
    def _open(cls, size: int) -> int:
        if hasattr(os, "memfd_create"):
            fd = os.memfd_create(cls.NAME, os.MFD_CLOEXEC)
        else:
            import _posixshmem
            import secrets

            name = f"/{cls.NAME}-{os.getpid()}-{secrets.token_hex(4)}"
            fd = _posixshmem.shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            _posixshmem.shm_unlink(name)  # nothing but this process's descriptor keeps it
        try:
            os.ftruncate(fd, size)
        except OSError:
            os.close(fd)
            raise
        return fd

    def lock(self) -> str | None:
        why = self.calls.mlock(self.address, self.size) if self.size else None
        return None if why is None else f"cannot lock the pinned set in memory ({why}); it stays unlocked"

    def close(self) -> None:
        """Its room goes back to the reservation (no access, no memory): never a hole another
        mmap could be given."""
        if self.size:
            self.calls.mmap(self.address, self.size, PROT_NONE, anon_noreserve() | MAP_FIXED, -1, 0)
        os.close(self.fd)


class Windows:
    """The bounded layout (see the module's docstring)."""

    bounded = True

    def __init__(self, plan: WindowPlan, fds: dict[int, int], phantoms: dict[int, int], calls: Calls | None = None) -> None:
        self.plan = plan
        self.fds = fds
        self.phantoms = phantoms  # file -> where llama.cpp believes the file is mapped
        self.calls = calls or Calls()
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.n_slots = plan.n_slots
        self.size = plan.fixed_bytes + plan.n_slots * plan.slot_bytes  # the windows; the store's room follows
        self.region = self.calls.reserve(plan.total_bytes)
        self.store_home = self.region + self.size
        self.owner: list[int | None] = [None] * plan.n_slots
        self.store: PinnedStore | None = None
        self._store_pieces: dict[int | None, list[tuple[ByteRange, ByteRange, int]]] = {}
        self._direct: dict[tuple[int, int], int] = {}  # (file, offset) of a wholly pinned layer tensor -> its place in the store
        self.pointers: WeightPointers | None = None  # told when the store changes
        self.claims = 0  # slots taken over, each one a window mapped again
        runs = list(plan.fixed) + [r for layer in plan.layers for r in layer]
        self._index: dict[int, tuple[list[int], list[Run]]] = {}
        for file in {r.file for r in runs}:
            mine = sorted((r for r in runs if r.file == file), key=lambda r: r.lo)
            self._index[file] = ([r.lo for r in mine], mine)
        self._floating = {(r.file, r.lo): r for r in plan.floating}
        try:
            self._map_runs(plan.fixed + plan.floating)
            for slot in range(plan.n_slots):
                self._clear(slot)
        except BaseException:
            self.calls.munmap(self.region, self.plan.total_bytes)
            raise

    def _clear(self, slot: int) -> None:
        """Zeros over a slot: whatever a layer left there goes, and a slot no layer holds reads
        as zeros, never faults (a weight read before its layer took its slot, a bug that
        ``WeightPointers`` stops, cannot crash the process)."""
        start = self.region + self.plan.fixed_bytes + slot * self.plan.slot_bytes
        self.calls.mmap(start, self.plan.slot_bytes, PROT_READ, anon_noreserve() | MAP_FIXED, -1, 0)

    # -- where things are --------------------------------------------------------------

    def _run(self, file: int, offset: int) -> Run:
        los, runs = self._index[file]
        i = bisect.bisect_right(los, offset) - 1
        if i < 0 or offset >= _up(runs[i].hi, self.page):
            raise ValueError(f"byte {offset} of file {file} is in no tensor")
        return runs[i]

    def layer_of(self, file: int, offset: int) -> int | None:
        return self._run(file, offset).layer

    def _base(self, run: Run) -> int:
        """Where file offset ``run.lo`` sits."""
        if run.layer is None:
            return self.region + run.place
        return self.region + self.plan.fixed_bytes + self.slot_of(run.layer) * self.plan.slot_bytes + run.place

    def at(self, file: int, offset: int) -> int:
        run = self._run(file, offset)
        return self._base(run) + offset - run.lo

    def slot_of(self, layer: int) -> int:
        return layer % self.n_slots

    def owns(self, layer: int | None) -> bool:
        """Whether ``layer``'s bytes are where ``at`` says (non-layer tensors always are)."""
        return layer is None or self.owner[self.slot_of(layer)] == layer

    def occupant(self, layer: int) -> int | None:
        """The layer holding ``layer``'s slot now."""
        return self.owner[self.slot_of(layer)]

    def locate(self, phantom: int) -> tuple[int, int] | None:
        """(file, offset) of an address in llama.cpp's phantom mappings; None if in none."""
        for file, base in self.phantoms.items():
            if base <= phantom < base + self._phantom_length(file):
                return file, phantom - base
        return None

    def real_address(self, phantom: int, tensor_offset: int | None = None) -> tuple[int, int | None] | None:
        """The real place of an address in llama.cpp's phantom mapping and the layer whose slot
        it is in (None: the fixed region); None if it is in no phantom. ``tensor_offset``: where
        in the tensor the address is, to find a FLOATING tensor's second place."""
        found = self.locate(phantom)
        if found is None:
            return None
        file, offset = found
        run = self._floating.get((file, offset - (tensor_offset or 0)))
        if run is not None:
            return self._base(run) + offset - run.lo, None
        return self.at(file, offset), self.layer_of(file, offset)

    def window_at(self, file: int, offset: int) -> int:
        """The place in the windows of a tensor's byte (a FLOATING tensor's second place)."""
        tensors = self.plan.tensors
        i = bisect.bisect_right(tensors, (file, offset, 1 << 62)) - 1
        if i >= 0 and tensors[i][0] == file and tensors[i][1] <= offset < tensors[i][2]:
            run = self._floating.get((file, tensors[i][1]))
            if run is not None:
                return self._base(run) + offset - run.lo
        return self.at(file, offset)

    def direct_at(self, file: int, offset: int) -> int | None:
        """Where the layer tensor starting at ``offset`` is in the pinned store when the store
        holds it whole: compute reads it there, from the store's own mapping, so taking a slot
        over neither tears its pages down nor faults them in again. None otherwise."""
        return self._direct.get((file, offset))

    def _phantom_length(self, file: int) -> int:
        return self._index[file][1][-1].hi if file in self._index else 0

    def spans(self) -> list[tuple[int, int]]:
        """The model's areas: the windows, and the pinned store."""
        out = [(self.region, self.region + self.size)]
        if self.store is not None and self.store.size:
            out.append((self.store.address, self.store.address + self.store.size))
        return out

    def holds(self, file: int, lo: int, hi: int) -> bool:
        return self.region <= lo and hi <= self.region + self.size

    # -- taking slots --------------------------------------------------------------------

    def _map_runs(self, runs) -> None:
        """The file over each run's place: read-only, shared, random access."""
        page, c = self.page, self.calls
        for run in runs:
            lo = run.lo // page * page
            address = self._base(run) - (run.lo - lo)
            length = _up(run.hi, page) - lo
            self._map(address, length, MAP_SHARED | MAP_FIXED, self.fds[run.file], lo)
            c.madvise(address, length, MADV_RANDOM)

    def _map_store(self, layer: int | None) -> None:
        """The pinned pages of ``layer`` over its place. A page shared with a neighbour is the
        file's page either way: the store's copy serves both."""
        store = self.store
        for r, pages, at in self._store_pieces.get(layer, ()):
            run = self._run(r.file, r.offset)
            address = self._base(run) + pages.offset - run.lo
            self._map(address, pages.length, MAP_SHARED | MAP_FIXED, store.fd, at)

    def _map(self, address: int, length: int, flags: int, fd: int, offset: int) -> None:
        """MAP_FIXED inside the region only: past it is someone else's memory."""
        if address < self.region or address + length > self.region + self.size:
            raise EngineError(f"bug: a window of {format_bytes(length)} would pass the model's region")
        self.calls.mmap(address, length, PROT_READ, flags, fd, offset)

    def within_runs(self, ranges: list[ByteRange]) -> list[ByteRange]:
        """``ranges`` cut where one run ends and the next begins (each piece then has one place)."""
        out = []
        for r in ranges:
            los, runs = self._index[r.file]
            i = max(0, bisect.bisect_right(los, r.offset) - 1)
            while i < len(runs) and runs[i].lo < r.end:
                lo, hi = max(r.offset, runs[i].lo), min(r.end, runs[i].hi)
                if hi > lo:
                    out.append(ByteRange(r.file, lo, hi - lo))
                i += 1
        return out

    def claim(self, layer: int) -> None:
        """Map ``layer``'s file range and pinned pages over its slot. The caller has given back
        every page placed there for the layer it held. Held by no one until it succeeds."""
        slot = self.slot_of(layer)
        self.owner[slot] = None
        self._clear(slot)
        self._map_runs(self.plan.layers[layer])
        self._map_store(layer)
        self.owner[slot] = layer
        self.claims += 1

    def set_store(self, store: PinnedStore | None) -> None:
        """A new pinned set: the fixed region gets its pages, and each slot is taken again on
        its next use (the pages of the set before leave with the old store)."""
        if self.pointers is not None and self.store is not None:
            self.pointers.store_leaving(self.store)
        old, self.store = self.store, store
        self._store_pieces = {}
        self._direct = {}
        if store is not None:
            for piece in store.pieces:
                layer = self.layer_of(piece[0].file, piece[0].offset)
                self._store_pieces.setdefault(layer, []).append(piece)
                if layer is not None:
                    self._direct.update(self._held_whole(piece))
        self._map_runs(self.plan.fixed + self.plan.floating)
        if store is not None:
            self._map_store(None)
        self.owner = [None] * self.n_slots
        for slot in range(self.n_slots):
            self._clear(slot)  # the old store's pages leave the slots, and with its close, memory
        if old is not None:
            old.close()
        if self.pointers is not None and store is not None:
            self.pointers.store_arrived()

    def _held_whole(self, piece: tuple[ByteRange, ByteRange, int]) -> dict[tuple[int, int], int]:
        r, pages, at = piece
        tensors = self.plan.tensors
        i = bisect.bisect_left(tensors, (r.file, r.offset, 0))
        out = {}
        while i < len(tensors) and tensors[i][0] == r.file and tensors[i][2] <= r.end:
            file, lo, _hi = tensors[i]
            out[(file, lo)] = self.store.address + at + lo - pages.offset
            i += 1
        return out

    def close(self) -> None:
        self.set_store(None)
        self.calls.munmap(self.region, self.plan.total_bytes)


# -- weight pointers ----------------------------------------------------------------------

# ggml_tensor's fields (ggml.h, kept for years): src[10] at 152, view_src at 232, view_offs
# at 240, data at 248, name at 256.
# Checked against ggml's own accessors before any pointer is written (``WeightPointers.check``).
SRC_OFFSET, N_SRC, VIEW_SRC_OFFSET, VIEW_OFFS_OFFSET, DATA_OFFSET, NAME_OFFSET = 152, 10, 232, 240, 248, 256


class WeightPointers:
    """Points weights (and views of them) from llama.cpp's phantom mapping at their real place,
    from the eval callback's ask for each graph node: ggml asks about a node before it computes
    it, so no kernel ever sees a phantom address. Graphs built after a weight is pointed get
    its real address from the start (a view takes its source's pointer when it is made), so the
    check stops (``active``) once a whole graph that ends in the output head (``graph_started``,
    ``graph_ended``) found nothing left to point: not at the first quiet graph, as one may leave
    tensors out (a prefill micro-batch with no output rows skips the output head)."""

    def __init__(self, windows: Windows) -> None:
        self.windows = windows
        self.lo = min(windows.phantoms.values())
        self.hi = max(base + windows._phantom_length(f) for f, base in windows.phantoms.items())
        self.active = True
        self.pointed = 0
        self.direct = 0  # weights pointed at the pinned store itself (Windows.direct_at)
        self.stale_pointed = 0  # pointers found in a replaced store's room, pointed at their windows
        self._this_graph = 0
        self._weights: dict[int, tuple[int, int]] = {}  # weight tensor -> (file, offset): pointed again when the store changes
        # A store that was replaced while graphs llama.cpp keeps for reuse may still hold views
        # pointing into it: (address, size, its pieces by place). The new store takes the same
        # room, so until a whole graph finds none, no pointer goes into the new one.
        self._stale: tuple[int, int, list] | None = None
        windows.pointers = self

    def graph_started(self) -> None:
        self._this_graph = 0

    def graph_ended(self) -> None:
        """The output head is being asked about: this graph is a whole one."""
        if self._this_graph == 0 and self.pointed:
            self.active = False
            if self._stale is not None:
                self._stale = None
                self.store_arrived()  # nothing points into the old store's room any more

    def store_leaving(self, old: PinnedStore) -> None:
        """The pinned store is about to go: weights pointed into it go to their windows, and
        the check runs again until no graph holds a pointer into its room."""
        if not old.size:
            return
        self._point_weights(lambda file, offset: None)
        if self._stale is None:  # a store replaced before anything pointed into its successor: the first's pieces stand
            self._stale = (old.address, old.size, sorted(((at, pages) for _, pages, at in old.pieces), key=lambda p: p[0]))
        self.active = True

    def store_arrived(self) -> None:
        """Weights the new store holds whole point into it, once no graph points into the room
        of one before it (the new store takes the same room)."""
        if self._stale is None:
            self._point_weights(self.windows.direct_at)

    def _point_weights(self, store_place) -> None:
        """Every weight pointed so far, at ``store_place(file, offset)`` or else its window."""
        self.direct = 0
        for tensor, (file, offset) in self._weights.items():
            data = ctypes.c_void_p.from_address(tensor + DATA_OFFSET)
            place = store_place(file, offset)
            data.value = place if place is not None else self.windows.window_at(file, offset)
            self.direct += place is not None

    @staticmethod
    def check_layout(ggml) -> None:
        """EngineError if this ggml's tensor layout is not the one the offsets above describe
        (checked on a tensor of a context of our own, before any graph runs)."""

        class InitParams(ctypes.Structure):
            _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]

        ggml.ggml_init.restype = ctypes.c_void_p
        ggml.ggml_init.argtypes = (InitParams,)
        ggml.ggml_new_tensor_1d.restype = ctypes.c_void_p
        ggml.ggml_new_tensor_1d.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_int64)
        ggml.ggml_view_1d.restype = ctypes.c_void_p
        ggml.ggml_view_1d.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_size_t)
        ggml.ggml_set_name.argtypes = (ctypes.c_void_p, ctypes.c_char_p)
        ggml.ggml_free.argtypes = (ctypes.c_void_p,)
        ctx = ggml.ggml_init(InitParams(1 << 16, None, False))
        if not ctx:
            raise EngineError("ggml_init failed")
        try:
            tensor = ggml.ggml_new_tensor_1d(ctx, 0, 16)  # GGML_TYPE_F32
            view = ggml.ggml_view_1d(ctx, tensor, 4, 8)
            ggml.ggml_set_name(view, b"kimitui-layout")
            ok = (
                ctypes.c_void_p.from_address(view + DATA_OFFSET).value == ggml.ggml_get_data(view)
                and ctypes.c_void_p.from_address(view + SRC_OFFSET).value == tensor
                and ctypes.string_at(view + NAME_OFFSET) == b"kimitui-layout"
            )
        finally:
            ggml.ggml_free(ctx)
        if not ok:
            raise EngineError("this llama.cpp's ggml_tensor layout is not the one kimitui knows: it cannot bound the model's address space")

    def point(self, node: int) -> None:
        srcs = (ctypes.c_void_p * N_SRC).from_address(node + SRC_OFFSET)
        # A view node reads nothing itself (ggml may order one before its layer starts); the
        # nodes that read a weight are where the slot must be its layer's.
        reads = not ctypes.c_void_p.from_address(node + VIEW_SRC_OFFSET).value
        for i, tensor in enumerate((node, *srcs)):
            if tensor:
                self._point(tensor, check_owner=reads and i > 0)

    def _point(self, tensor: int, check_owner: bool) -> None:
        data = ctypes.c_void_p.from_address(tensor + DATA_OFFSET)
        value = data.value
        if value is None:
            return
        if not self.lo <= value < self.hi:
            if self._stale is not None and self._stale[0] <= value < self._stale[0] + self._stale[1]:
                self._point_stale(data, value, check_owner)
            return
        name = ctypes.string_at(tensor + NAME_OFFSET).decode(errors="replace")
        is_view = bool(ctypes.c_void_p.from_address(tensor + VIEW_SRC_OFFSET).value)
        if not is_view:  # a weight: its place is kept, for when the store changes
            found = self.windows.locate(value)
            if found is not None:
                self._weights[tensor] = found
                place = self.windows.direct_at(*found) if self._stale is None else None
                if place is not None:
                    data.value = place
                    self.pointed += 1
                    self.direct += 1
                    self._this_graph += 1
                    return
        try:
            found = self.windows.real_address(value, ctypes.c_size_t.from_address(tensor + VIEW_OFFS_OFFSET).value if is_view else 0)
        except (ValueError, KeyError):
            found = None
        if found is None:
            raise EngineError(f"graph tensor {name} points into the model's mapping outside every tensor")
        real, layer = found
        data.value = real
        self.pointed += 1
        self._this_graph += 1
        self._check_owner(name, layer, check_owner)

    def _check_owner(self, name: str, layer: int | None, check_owner: bool) -> None:
        if check_owner and not self.windows.owns(layer):
            raise EngineError(
                f"graph tensor {name} of layer {layer} is read while layer {self.windows.occupant(layer)} holds its "
                "slot: this model's graph reads a layer's weights outside it, which the bounded address space cannot stream"
            )

    def _point_stale(self, data: ctypes.c_void_p, value: int, check_owner: bool) -> None:
        """A pointer into a replaced store (a view in a graph llama.cpp reused) to its window."""
        address, _size, pieces = self._stale
        i = bisect.bisect_right(pieces, value - address, key=lambda p: p[0]) - 1
        at, pages = pieces[i]
        offset = pages.offset + value - address - at
        data.value = self.windows.window_at(pages.file, offset)
        self.pointed += 1
        self.stale_pointed += 1
        self._this_graph += 1
        self._check_owner("a view of a pinned weight", self.windows.layer_of(pages.file, offset), check_owner)


def address_bound(setting: int | str, working_bytes: int, platform: str = sys.platform) -> int | None:
    """The address space the model's weights may take; None: unbounded (each file mapped whole).

    "auto": where the process has a ceiling (iOS's 63 GiB, or `ulimit -v`), what is left under it
    after what the process has mapped so far, llama.cpp's KV cache and buffers
    (``working_bytes``) and room for the Python heap, the allocator's arenas and the threads'
    stacks (``PROCESS_ROOM``)."""
    if setting != "auto":
        return int(setting)
    ceiling = IOS_ADDRESS_CEILING if is_ios(platform) else address_space_limit()
    if ceiling is None:
        return None
    import psutil

    return max(0, ceiling - psutil.Process().memory_info().vms - working_bytes - PROCESS_ROOM)


# Measured here: the process's own mappings beside the windows and llama.cpp's buffers peaked at
# 0.44 GiB through a streamed reply (0.16 GiB before the load).
PROCESS_ROOM = 768 * 2**20
