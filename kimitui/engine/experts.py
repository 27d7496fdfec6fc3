"""Just-in-time routed experts: read the experts the router picked, not the whole layer.

At each MoE layer llama.cpp computes the router's top-k (``ffn_moe_topk-L``, int32 expert ids
per token) before the expert matmuls. The engine's eval callback hands those ids here; every
(layer, expert) not resident is read with parallel positional reads (gate, up and down slices
of that expert) and compute waits only for those. A batch (prefill) asks for the union of its
tokens' experts once. Resident experts live in a cache under the budget (LRU, or LFU which
keeps the experts routed to most often); a usage heatmap per model is saved in the user cache
dir so the next run pins the hot experts from the start.

A micro-batch whose union of experts does not fit the cache is *staged*: llama.cpp computes a
layer's routed experts as one ``mul_mat_id`` node per matrix (gate, up, down), so the engine
reads one matrix's slices of the missed experts just before its node computes and gives them
back right after (``stage_matrix``, ``matrix_done``), reading the next matrix ahead into
the room left. A prompt is then evaluated in large chunks (each distinct expert of a chunk read
once, the trunk once per chunk) where whole experts would allow a token or two at a time.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kimitui.config import replace_file
from kimitui.engine.budget import stages_by_matrix
from kimitui.engine.expert_policies import ExpertPolicy, make_policy
from kimitui.model.gguf_map import ModelMap

if TYPE_CHECKING:
    from kimitui.engine.direct import SparePages

PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class ExpertUnit:
    """One expert's slices in one layer: what a read and a cache entry are about."""

    layer: int
    expert: int
    ranges: tuple  # ByteRange per routed tensor (gate, up, down)
    matrix: int | None = None  # a staged read: only this routed tensor's slice (ranges holds it alone)

    @property
    def length(self) -> int:
        return sum(r.length for r in self.ranges)

    @property
    def footprint(self) -> int:
        """The memory it takes once resident: its slices rounded out to whole pages (the end
        pages are read or locked whole), which for small experts is much more than ``length``."""
        return sum(-(-r.end // PAGE) * PAGE - r.offset // PAGE * PAGE for r in self.ranges)

    # The attributes a trace's read record uses, as on a Shard.
    @property
    def index(self) -> int:
        return -1

    @property
    def file(self) -> int:
        return self.ranges[0].file


class StagingError(Exception):
    """A staged micro-batch cannot go on: one matrix of its experts does not fit, or llama.cpp
    computed the layer without asking for a matrix that was read for it."""


@dataclass
class _Stage:
    """A layer's micro-batch computed matrix by matrix: ``experts`` are read one routed tensor
    at a time (the misses, and hits given up for room); ``held`` stay cached whole."""

    layer: int
    experts: list[int]
    held: set[tuple[int, int]]
    reads: dict[int, list[tuple[ExpertUnit, list[Future]]]] = field(default_factory=dict)  # matrix -> its reads
    computed: list[int] = field(default_factory=list)  # matrices in the order llama.cpp computed them


@dataclass
class _Early:
    """A prompt's staged layer whose first matrices started paging in at the layer's start, for
    every expert not in memory, before its router chose (``ExpertCache.read_first_matrices``)."""

    layer: int
    reads: dict[int, list[tuple[ExpertUnit, list[Future]]]]  # matrix -> its slices' reads

    def all_reads(self) -> list[tuple[ExpertUnit, list[Future]]]:
        return [read for reads in self.reads.values() for read in reads]


@dataclass
class _Deferred:
    """A prompt's layer whose missed experts are read whole and cached as usual, but waited for
    matrix by matrix, each just before its node: llama.cpp computes the gate projection while
    the up and down slices still arrive."""

    layer: int
    reads: list[tuple[ExpertUnit, list[Future]]]  # each missed expert, with all its reads
    by_matrix: dict[int, list[Future]]  # matrix -> the reads its node waits for
    asked: set[int] = field(default_factory=set)
    failed: bool = False  # a wait raised


def heatmap_path(model: ModelMap, cache_dir: Path) -> Path:
    """Keyed by what identifies the model's bytes (name, sizes, tensor layout), not its path."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(model.name.encode())
    for size in model.file_sizes:
        digest.update(str(size).encode())
    for t in model.tensors[:64]:
        digest.update(f"{t.name}:{t.offset}:{t.n_bytes}".encode())
    return cache_dir / "heatmaps" / f"{digest.hexdigest()}.json"


def load_heatmap(path: Path, n_layers: int, n_expert: int) -> list[list[int]]:
    try:
        data = json.loads(path.read_text())
        counts = data["counts"]
        if len(counts) == n_layers and all(len(row) == n_expert for row in counts):
            return [[int(c) for c in row] for row in counts]
    except (OSError, ValueError, KeyError, TypeError):
        pass  # no usable history: start cold
    return [[0] * n_expert for _ in range(n_layers)]


def save_heatmap(path: Path, counts: list[list[int]]) -> None:
    replace_file(path, json.dumps({"counts": counts}))


def hot_experts(model: ModelMap, counts: list[list[int]], byte_budget: int) -> list[ExpertUnit]:
    """The most used (layer, expert) pairs that fit ``byte_budget``; never-used ones are not hot."""
    ranked = sorted(
        ((c, layer, e) for layer, row in enumerate(counts) for e, c in enumerate(row) if c > 0 and model.layers[layer].is_moe),
        reverse=True,
    )
    chosen, left = [], byte_budget
    for _count, layer, e in ranked:
        unit = ExpertUnit(layer, e, tuple(model.expert_ranges(layer, e)))
        if unit.footprint > left:
            break
        chosen.append(unit)
        left -= unit.footprint
    return chosen


def _landed(futures: list[Future]) -> bool:
    """Whether every read of ``futures`` brought its bytes; waits for all of them first, so that
    nothing of a read that failed is still under way when its pages go back."""
    landed = True
    for f in futures:
        if f.cancelled() or f.exception() is not None:  # exception() waits for the read
            landed = False
    return landed


def _guesses_failed(futures: list[Future]) -> bool:
    """Whether each read of ``futures`` that failed was a guess's (the streamer's failure says
    so: ``StreamAbort.guess``), such as a shared end page a guess was bringing."""
    return all(
        not f.cancelled() and getattr(f.exception(), "guess", False) for f in futures if f.cancelled() or f.exception() is not None
    )


class ExpertCache:
    """Resident experts beyond the pinned hot set, within ``capacity`` bytes."""

    def __init__(
        self,
        model: ModelMap,
        capacity: int,
        pinned: Iterable[ExpertUnit],
        counts: list[list[int]],
        read_unit: Callable[[ExpertUnit], list[Future]],
        drop_unit: Callable[[ExpertUnit], None],
        policy: str = "lfu",
        read_ahead: Callable[[ExpertUnit], list[Future]] | None = None,
        read_units: Callable[[list[ExpertUnit]], list[list[Future]]] | None = None,
        cancel_reads: bool = True,
        page_in_units: Callable[[list[ExpertUnit]], list[list[Future]]] | None = None,
        sweep_layer: Callable[[int, set[int]], None] | None = None,
        drop_units: Callable[[list[ExpertUnit]], None] | None = None,
        spare: SparePages | None = None,
        fill_spare: Callable[[], None] | None = None,
        link_idle: Callable[[], bool] | None = None,
    ) -> None:
        """``policy``: the eviction policy's name (expert_policies.py). ``read_ahead`` reads what
        look-ahead guesses, apart from the reads compute waits for (default: ``read_unit``);
        ``read_units`` reads a layer's misses together, neighbours in the file as one request
        (default: ``read_unit`` each). ``cancel_reads``: an expert evicted before its read
        started has that read cancelled (not where one read may bring pages other experts
        wait for). ``page_in_units``: where given, a staged matrix's slices are paged into the
        mapping in compute order and its node is not held for them (see ``stage_matrix``);
        ``sweep_layer(layer, kept experts)`` then gives back, at the stage's end, the file pages
        its page-ins left mapped outside their slices. ``drop_units`` gives many experts back as
        one release (default: ``drop_unit`` each): the experts one call evicts. ``spare``: the
        placer's pages faulted in ahead, given the cache's free room once a prompt is done
        (``fill_spare`` starts faulting in what it was given) and room back as a miss needs it.
        ``link_idle``: whether nothing else has the link while a decoded token computes, so
        that the free room may be read into instead (``warm``)."""
        self.model = model
        self.capacity = capacity
        self.pinned = {(u.layer, u.expert) for u in pinned}
        self.counts = counts
        self._read_unit = read_unit
        self._read_ahead = read_ahead or read_unit
        self._read_units = read_units or (lambda units: [read_unit(unit) for unit in units])
        self._page_in_units = page_in_units
        self._sweep_layer = sweep_layer
        self._drop_unit = drop_unit
        self._drop_units = drop_units or (lambda units: [drop_unit(unit) for unit in units])
        self._cancel_reads = cancel_reads
        self._spare = spare
        self._fill_spare = fill_spare
        self._link_idle = link_idle
        # What every expert but the pinned ones would take: the most the spare pages can serve.
        self._unpinned_bytes = sum(
            layer.n_expert * layer.expert_bytes for layer in model.layers if layer.is_moe
        ) - sum(model.layers[layer].expert_bytes for layer, _ in self.pinned)
        # Whether the cache holds at least three quarters of them, by its own capacity (not what
        # it lends a prompt or borrows from the window): then what a prompt reads is kept for
        # decode, and the free room is read into.
        self.holds_most = 4 * capacity >= 3 * self._unpinned_bytes
        self._resident: OrderedDict[tuple[int, int], ExpertUnit] = OrderedDict()  # oldest use first
        self.policy: ExpertPolicy = make_policy(policy, self._resident, counts)
        self._resident_bytes = 0
        n = model.n_layers
        self.layer_hits = [0] * n
        self.layer_misses = [0] * n
        self.hits = self.misses = 0
        self.bytes_from_cache = 0
        self.bytes_needed = 0  # bytes compute used that were not resident before (read for it)
        self._in_use: set[tuple[int, int]] = set()  # the experts of the layer computing now
        # From a reply's start to its first token: the distinct experts the prompt used, and the
        # expert bytes read for it (a prefill reads each of them once at best).
        self.prefilling = False
        self.prefill_seen: set[tuple[int, int]] = set()
        self.prefill_read_bytes = 0
        self.prefill_gap_bytes = 0  # of those, read through between slices and never used (the streamer's)
        # What a prefill reads of experts with nothing cached before it: each micro-batch's
        # distinct unpinned ones, once (cached hits read less).
        self.prefill_bound_bytes = 0
        self.staged_layers = 0  # micro-batch layers computed matrix by matrix
        self._early: _Early | None = None
        self.whole_layers: set[int] = set()  # read whole by the streamer for a prompt's chunk (give_up_layer)
        self._stage: _Stage | None = None
        self._deferred: _Deferred | None = None
        self._matrices: dict[int, dict[bytes, int]] = {}  # layer -> routed tensor name -> its index
        self._stages = stages_by_matrix(model)
        self._matrix_order: list[int] = []  # the order llama.cpp computed a staged layer's matrices in
        # Look-ahead: the experts each layer chose last time, read early for the next token.
        self.last_choice: list[set[int]] = [set() for _ in range(n)]
        self._inflight: dict[tuple[int, int], list[Future]] = {}
        self._prefetched: set[tuple[int, int]] = set()
        self.prefetch_issued = self.prefetch_used = self.prefetch_wasted = 0
        self.prefetch_wasted_bytes = 0
        self._warm_order: list[tuple[int, int]] | None = None  # see ``warm``: the most used last
        self._warming: list[tuple[tuple[int, int], int, list[Future]]] = []  # its reads under way: (key, bytes, futures)
        self._smallest_expert = min((layer.expert_bytes for layer in model.layers if layer.is_moe), default=0)

    def set_policy(self, policy: str) -> None:
        """Switch the eviction policy live: the new one starts from the experts resident now."""
        if policy != self.policy.name:
            self.policy = make_policy(policy, self._resident, self.counts)

    def _unit(self, layer: int, expert: int) -> ExpertUnit:
        return ExpertUnit(layer, expert, tuple(self.model.expert_ranges(layer, expert)))

    def _touch(self, key: tuple[int, int], unit: ExpertUnit | None = None) -> None:
        """``key`` was just used (or, with ``unit``, just became resident)."""
        if unit is not None:
            self._resident[key] = unit
        self._resident.move_to_end(key)
        self.policy.used(key)

    def _make_room(self, length: int, protect: set[tuple[int, int]]) -> bool:
        spare = self._spare
        if spare is not None and spare.allowed:  # free room lent to the spare comes back first
            over = self._resident_bytes + spare.allowed + length - self.capacity
            if over > 0:
                spare.free(over)
        evicted: list[ExpertUnit] = []
        try:
            while self._resident and self._resident_bytes + length > self.capacity:
                victim = self.policy.victim(protect)
                if victim is None:
                    return False
                evicted.append(self._evict(victim))
            return self._resident_bytes + length <= self.capacity
        finally:
            if evicted:
                self._drop_units(evicted)

    def _evict(self, key: tuple[int, int]) -> ExpertUnit:
        """Out of the books (its release is the caller's): a read ahead still under way lands first."""
        unit = self._resident.pop(key)
        self.policy.forgot(key)
        self._settle(self._inflight.pop(key, None))
        if key in self._prefetched:  # read ahead and never used
            self._prefetched.discard(key)
            self.prefetch_wasted += 1
            self.prefetch_wasted_bytes += unit.length
        self._resident_bytes -= unit.footprint
        return unit

    def _settle(self, futures: list[Future] | None) -> None:
        """An expert read ahead is evicted before its read landed: cancel what has not started
        (where reads may be cancelled, see ``cancel_reads``) and wait for the rest, so that its
        release cannot run before its pages arrive (they would stay in memory, uncounted)."""
        for f in futures or () if self._cancel_reads else ():
            f.cancel()
        for f in futures or ():
            if not f.cancelled():
                f.exception()  # waits; a failed guess is nobody's error

    def prefetch(self, layer: int, experts: Iterable[int]) -> None:
        """Start reading ``experts`` of ``layer`` without waiting; only into free or colder room."""
        if self._stage is not None:  # the staged matrices need the room
            return
        if self._early is not None and self._early.layer == layer:  # its first matrix is on its way
            return
        if layer in self.whole_layers:  # read whole by the streamer
            return
        keys = {(layer, e) for e in experts}
        for key in sorted(keys):
            if key in self.pinned or key in self._resident:
                continue
            unit = self._unit(*key)
            # The layer computing now (the last ensure) keeps its experts: evicting them here
            # would leave its matmuls to fault them back in through the mapping.
            if not self._make_room(unit.footprint, keys | set(self._inflight) | self._in_use):
                return
            self._inflight[key] = self._read_ahead(unit)
            self._touch(key, unit)
            self._resident_bytes += unit.footprint
            self._prefetched.add(key)
            self.prefetch_issued += 1

    def ensure(self, layer: int, experts: Iterable[int]) -> float:
        """Make ``experts`` of ``layer`` resident; returns seconds waited on storage."""
        wanted = sorted(set(experts))
        self.last_choice[layer] = set(wanted)
        self.end_stage(strict=False)
        self._settle_warming()  # a guess whose read failed is a miss here, not the token's error
        unpinned = [e for e in wanted if (layer, e) not in self.pinned]
        # Every expert of a layer has slices of one size: a hit's books need no unit of its own.
        length = self.model.layers[layer].expert_bytes
        if self.prefilling:
            self.prefill_bound_bytes += length * len(unpinned)
        if (
            self._stages
            and len(unpinned) * (length + 2 * PAGE * self._matrix_count(layer)) > self.capacity  # at most a page more at each slice's ends
            and sum(self._unit(layer, e).footprint for e in unpinned) > self.capacity
        ):
            return self._begin_stage(layer, wanted)
        self._give_back_early()  # not staged after all
        pending: list[tuple[ExpertUnit, list[Future]]] = []
        guessed = 0  # the first ``guessed`` of ``pending`` were read ahead: one that fails is read again
        missed: list[ExpertUnit] = []  # read below, together
        needed = self._in_use = {(layer, e) for e in wanted}
        if self.prefilling:
            self.prefill_seen |= needed
        for e in wanted:
            key = (layer, e)
            self.counts[layer][e] += 1
            read_ahead = key in self._prefetched
            if read_ahead:
                self._prefetched.discard(key)
                self.prefetch_used += 1
            if key in self._inflight:
                futures = self._inflight.pop(key)
                # Read ahead but not in time, or failed: either way the wait below settles it.
                if not all(f.done() and not f.cancelled() and f.exception() is None for f in futures):
                    self.misses += 1
                    self.layer_misses[layer] += 1
                    self.bytes_needed += self._resident[key].length
                    pending.append((self._resident[key], futures))  # before any miss's: the first ``guessed``
                    guessed += 1
                    self._touch(key)
                    continue
            if key in self.pinned or key in self._resident:
                self.hits += 1
                self.layer_hits[layer] += 1
                self.bytes_from_cache += length
                if read_ahead:  # in memory in time, but read from storage for this token
                    self.bytes_needed += length
                if key in self._resident:
                    self._touch(key)
                continue
            self.misses += 1
            self.layer_misses[layer] += 1
            unit = self._unit(layer, e)  # a miss is never pinned
            self.bytes_needed += unit.length
            if self.prefilling:
                self.prefill_read_bytes += unit.length
            missed.append(unit)
        if missed:  # room for all of them at once: the experts it evicts go back as one release
            if self._spare is not None:  # spare pages their reads will take are theirs, not free room
                self._spare.earmark(sum(u.length for u in missed))
            self._make_room(sum(u.footprint for u in missed), needed)
        for unit in missed:
            self._touch((unit.layer, unit.expert), unit)
            self._resident_bytes += unit.footprint
        if missed and self.prefilling and self._stages:
            self._defer(layer, missed)  # waited for at each matrix's node (stage_matrix)
        elif missed:
            pending += zip(missed, self._read_units(missed))
        started = time.perf_counter()
        try:
            # A guess's failure is nobody's error: what it failed to bring is read now. A read
            # again may wait for a shared end page another guess is bringing, so it goes round
            # while only guesses fail (each a read started before this call: a few rounds).
            waited, rounds = pending, 0
            while waited:
                again = []
                for index, (unit, futures) in enumerate(waited):
                    if _landed(futures):
                        continue
                    a_guess = rounds == 0 and index < guessed  # its own reads failed, whatever the cause
                    if not a_guess and (rounds >= self.READ_AGAIN_ROUNDS or not _guesses_failed(futures)):
                        for f in futures:
                            f.result()  # a failed read raises here, before the expert matmuls run
                    again.append(unit)
                for unit in again:
                    self._forget((unit.layer, unit.expert))
                    self._touch((unit.layer, unit.expert), unit)
                    self._resident_bytes += unit.footprint
                if again and self._spare is not None:
                    self._spare.earmark(sum(u.length for u in again))
                waited = list(zip(again, self._read_units(again))) if again else []
                pending += waited
                rounds += 1
        except BaseException:
            # Nothing half-read may count as resident: the next reply reads it again. Every read
            # settles before any release (an expert read again is in ``pending`` twice).
            for _unit, futures in pending:
                self._settle(futures)
            for unit, _futures in pending:
                self._forget((unit.layer, unit.expert))
            raise
        finally:
            if self._spare is not None:
                self._spare.settle()  # the reads have landed: spare pages they did not take go
        if self._spare is not None and not self.prefilling and not self._warms():
            self._lend_spare()  # where the room is read into, its reads take fresh pages instead
        return time.perf_counter() - started if pending else 0.0

    # How many times a decoded layer reads again what failed guesses did not bring (``ensure``).
    READ_AGAIN_ROUNDS = 4

    # What ``warm`` has under way at most: a miss's read waits behind no more than this at the disk.
    WARM_IN_FLIGHT = 8 * 2**20

    def _warms(self) -> bool:
        """Whether ``warm`` reads into the free room now: a decoded token's, with the link idle,
        where most experts fit. There nearly every one read is used before it is evicted; where
        the cache holds a few, a guess from the routing counts competed with the misses (on the
        README's MoE example, a fifth cached, a decoded token stalled 33-38 ms against 29-32)."""
        return self._link_idle is not None and not self.prefilling and self.holds_most and self._link_idle()

    def warm(self) -> None:
        """Read experts not cached into the cache's free room, the most used first (the routing
        counts, the prompt's and the heatmap's), a few at a time on the look-ahead's lane. A
        model most of whose experts fit would otherwise miss its way to a full cache, a stall at
        a time, after a prompt that used some of them. Each counts as read ahead (used, or
        wasted where evicted unused); nothing is evicted for it, and one whose read failed is
        forgotten (read again when routed to). Its reads that landed were settled by the
        ``ensure`` just before."""
        if (
            self._stage is not None
            or self._early is not None
            or self.capacity - self._resident_bytes < self._smallest_expert
            or not self._warms()
        ):
            return
        if self._warm_order is None:
            counts = self.counts
            self._warm_order = sorted(
                (
                    (layer, e) for layer, info in enumerate(self.model.layers) if info.is_moe for e in range(info.n_expert)
                    if (layer, e) not in self.pinned and (layer, e) not in self._resident
                ),
                key=lambda key: (counts[key[0]][key[1]], -key[0], -key[1]),
            )
        order = self._warm_order
        in_flight = sum(length for _, length, _ in self._warming)
        while order and in_flight < self.WARM_IN_FLIGHT:
            key = order[-1]
            if key in self._resident:
                order.pop()
                continue
            unit = self._unit(*key)
            if self._resident_bytes + unit.footprint > self.capacity:
                return
            order.pop()
            self._make_room(unit.footprint, set())  # room lent to the spare comes back: nothing is evicted
            futures = self._read_ahead(unit)
            self._inflight[key] = futures
            self._warming.append((key, unit.length, futures))
            self._resident[key] = unit
            self._resident.move_to_end(key, last=False)  # a guess is older than any use (LRU's first victim)
            self.policy.used(key)
            self._resident_bytes += unit.footprint
            self._prefetched.add(key)
            self.prefetch_issued += 1
            in_flight += unit.length

    def _settle_warming(self) -> None:
        """``warm``'s reads that have landed leave the reads under way (a failed one is forgotten)."""
        under_way = []
        for key, length, futures in self._warming:
            if not all(f.done() for f in futures):
                under_way.append((key, length, futures))
            elif self._inflight.get(key) is futures:
                if any(f.cancelled() or f.exception() is not None for f in futures):
                    self._forget(key)
                else:
                    del self._inflight[key]
        self._warming = under_way

    # Free room is lent to the spare pages in steps of at least this much: the few pages an
    # eviction leaves free are not worth the faulting thread's start.
    SPARE_STEP = 64 * 2**20

    def _lend_spare(self) -> None:
        """Lend the free room to the spare pages, no more than the experts not cached could take
        (a budget far above the experts' bytes faults in no memory that no read would use)."""
        spare = self._spare
        uncached = self._unpinned_bytes - self._resident_bytes
        room = min(self.capacity - self._resident_bytes, uncached) - spare.allowed
        if room >= self.SPARE_STEP:
            spare.allow(room)
            if self._fill_spare is not None:
                self._fill_spare()

    def _defer(self, layer: int, missed: list[ExpertUnit]) -> None:
        """Read ``missed`` matrix by matrix in the order llama.cpp computes them, each matrix's
        slices of all of them as one batch of requests, and leave the waiting to each matrix's
        node. Measured on the README's MoE example (a 128-token prompt): the reads of a layer
        took about as long as its compute, and the first matrix's wait is a third of them."""
        reads: dict[tuple[int, int], list[Future]] = {(u.layer, u.expert): [] for u in missed}
        by_matrix: dict[int, list[Future]] = {}
        for matrix in self._compute_order(layer):
            parts = [ExpertUnit(u.layer, u.expert, (u.ranges[matrix],), matrix) for u in missed]
            futures = self._read_units(parts)
            by_matrix[matrix] = [f for part_futures in futures for f in part_futures]
            for unit, part_futures in zip(missed, futures):
                reads[(unit.layer, unit.expert)] += part_futures
        self._deferred = _Deferred(layer, [(u, reads[(u.layer, u.expert)]) for u in missed], by_matrix)

    def _end_deferred(self, strict: bool) -> None:
        """The deferred layer is over: every read waited for (one that failed leaves its expert
        uncached, read again when next routed). ``strict``: a matrix never asked for means
        llama.cpp computed it without waiting for its reads: the token stops."""
        deferred, self._deferred = self._deferred, None
        # Every matrix waited for without an error: every read landed (a layer's reads are its
        # matrices' reads). Otherwise each expert's are settled, and one that failed forgotten.
        landed = deferred.asked == set(deferred.by_matrix) and not deferred.failed
        for unit, futures in () if landed else deferred.reads:
            self._settle(futures)
            if any(f.cancelled() or f.exception() is not None for f in futures):
                self._forget((unit.layer, unit.expert))
        missing = len(deferred.by_matrix) - len(deferred.asked)
        if strict and missing:
            raise StagingError(
                f"layer {deferred.layer}: llama.cpp computed the routed experts without asking for "
                f"{missing} of their matrices (unsupported llama.cpp build?)"
            )

    def _compute_order(self, layer: int) -> list[int]:
        """``layer``'s routed matrices in the order llama.cpp computes them: learnt from the last
        staged layer; before that, file order with down last."""
        count = self._matrix_count(layer)
        down = self._down_matrix(layer)
        return [m for m in self._matrix_order if m < count] + sorted(
            (m for m in range(count) if m not in self._matrix_order), key=lambda m: m == down
        )

    # -- a micro-batch one matrix at a time ---------------------------------------------

    def _begin_stage(self, layer: int, wanted: list[int]) -> float:
        """``wanted``'s whole footprint passes the cache: keep its cached experts (as many as
        leave room for one matrix of the rest) and read the rest matrix by matrix."""
        self._in_use = needed = {(layer, e) for e in wanted}
        if self.prefilling:
            self.prefill_seen |= needed
        waited = 0.0
        held: set[tuple[int, int]] = set()
        staged: list[int] = []
        for e in wanted:
            key = (layer, e)
            self.counts[layer][e] += 1
            if key in self._prefetched:
                self._prefetched.discard(key)
                self.prefetch_used += 1
            if key in self._inflight:  # read ahead: use it if it landed whole
                futures = self._inflight.pop(key)
                started = time.perf_counter()
                self._settle(futures)
                waited += time.perf_counter() - started
                if any(f.cancelled() or f.exception() is not None for f in futures):
                    self._forget(key)
            if key in self.pinned or key in self._resident:
                self.hits += 1
                self.layer_hits[layer] += 1
                self.bytes_from_cache += (self._resident.get(key) or self._unit(layer, e)).length
                if key in self._resident:
                    self._touch(key)
                    held.add(key)
            else:
                self.misses += 1
                self.layer_misses[layer] += 1
                staged.append(e)
        stage = _Stage(layer, staged, held)

        def widest() -> int:  # the largest one-matrix footprint of the staged experts
            return max((self._matrix_footprint(stage, m) for m in range(self._matrix_count(layer))), default=0)

        # Cached hits that leave no room for a matrix of the rest are given up, coldest first.
        by_use = sorted(held, key=lambda key: self.counts[key[0]][key[1]])
        while by_use and widest() + sum(self._resident[k].footprint for k in held) > self.capacity:
            key = by_use.pop(0)
            held.discard(key)
            self.bytes_from_cache -= self._resident[key].length
            self._forget(key)
            staged.append(key[1])
            self.hits -= 1  # read again after all
            self.layer_hits[layer] -= 1
            self.misses += 1
            self.layer_misses[layer] += 1
        stage.experts.sort()
        self._stage = stage
        self.staged_layers += 1
        self._in_use = held
        self._take_early(stage)
        self._read_ahead_matrices()
        return waited

    def read_first_matrices(self, layer: int, n_tokens: int, room: int | None = None) -> None:
        """A prompt's layer starts, its graph computing ``n_tokens`` tokens: where they will
        likely route to most experts of the next MoE layer (from here on), and that layer is
        then staged, the first matrices llama.cpp computes start paging in now, for every expert
        not in memory, as many as fit ``room`` (the cache's bytes that stay its own until that
        layer's stage; default: all of it), and the reads run under this layer's compute (a
        dense layer's, or the MoE layer's attention) instead of after the router; where the
        trunk is pinned, nothing else is read then. The experts the router leaves out are given
        back."""
        if not self.prefilling or self._page_in_units is None or not self.stage_all_read():
            self._give_back_early()  # decoding asks at every layer: the cheap tests first
            return
        target = next(iter(self.model.moe_layers_from(layer)), None)
        if target is None:
            self._give_back_early()
            return
        if self._early is not None and self._early.layer == target:
            return
        self._give_back_early()
        n_expert = self.model.layers[target].n_expert
        union = n_expert * self.routes_to_most(target, n_tokens)
        pinned = sum(1 for key in self.pinned if key[0] == target)
        room = self.capacity if room is None else min(room, self.capacity)
        if not union or union * (n_expert - pinned) / n_expert * self.model.bytes_per_expert <= room:
            return  # not most of them, or not staged (the cache holds them whole)
        cached = {key for key in self._resident if key[0] == target}  # hits for its router, likely
        taken = sum(self._resident[key].footprint for key in cached)
        early = _Early(target, {})
        for matrix in self._compute_order(target):
            units = [
                self._matrix_unit(target, e, matrix)
                for e in range(n_expert)
                if (target, e) not in self.pinned and (target, e) not in self._resident
            ]
            footprint = sum(u.footprint for u in units)
            if not units or taken + footprint > room or not self._make_room(footprint, cached):
                break  # no room beside them (and the ones before)
            taken += footprint
            self._count_read(units)
            early.reads[matrix] = list(zip(units, self._page_in_units(units)))
        if early.reads:
            self._early = early

    def routes_to_most(self, layer: int, n_tokens: int) -> float:
        """The share of ``layer``'s experts that ``n_tokens`` tokens route to under flat routing,
        where that is two thirds or more (0.0 below): such a chunk's layer is best read whole."""
        n_expert, used = self.model.layers[layer].n_expert, self.model.n_expert_used
        share = 1 - (1 - used / n_expert) ** n_tokens if n_expert else 0.0
        return share if 3 * share >= 2 else 0.0

    # -- a prompt's layers read whole (the streamer's, in the arena) ---------------------------

    def lend(self, room: int) -> bool:
        """Give ``room`` bytes of the cache to the streamer for a while (a prompt's layers read
        whole), the coldest experts evicted for it; False where that would leave the cache less
        than half of it."""
        if 2 * room > self.capacity:
            return False
        self.capacity -= room
        if not self.shrink():
            self.capacity += room  # its experts are all in use: nothing lent
            return False
        return True

    def take_back(self, room: int) -> None:
        self.capacity += room

    def shrink(self, everything: bool = False) -> bool:
        """The capacity has been lowered: the coldest experts go until the rest fit (one release);
        False where they cannot (those in use stay, unless ``everything``: the layer that used
        them is done). An early read is given back before that fails."""
        if self._make_room(0, set() if everything else self._in_use):
            return True
        self._give_back_early()
        return self._make_room(0, set() if everything else self._in_use)

    @property
    def pages_in(self) -> bool:
        """Whether staged slices page in under compute (see ``stage_matrix``)."""
        return self._page_in_units is not None

    def clear_early(self) -> None:
        """An early read a stopped prompt left goes back."""
        self._give_back_early()

    def give_up_layer(self, layer: int) -> None:
        """``layer`` is about to be read whole by the streamer (its pieces cover the arena): its
        cached experts go back first (one release, which the pieces' reads wait for), and nothing
        of it is read here until the streamer's release. Keeping them, their pages copied back
        after the pieces, cost the MoE example's 128-token prompt 0.5-0.7 s on two cores."""
        evicted = [self._evict(key) for key in [key for key in self._resident if key[0] == layer]]
        if evicted:
            self._drop_units(evicted)
        self.whole_layers.add(layer)

    def routed_whole(self, layer: int, experts: Iterable[int], read_bytes: int) -> None:
        """The router of a layer read whole (``read_bytes``) chose ``experts``: counted as the
        cache counts a layer's hits (the pinned ones) and misses, what was read beyond the misses
        as read through."""
        wanted = sorted(set(experts))
        self.last_choice[layer] = set(wanted)
        self.end_stage(strict=False)
        self._in_use = set()
        size = self.model.layers[layer].expert_bytes
        pinned = sum(1 for e in wanted if (layer, e) in self.pinned)  # none cached (give_up_layer)
        used = (len(wanted) - pinned) * size
        for e in wanted:
            self.counts[layer][e] += 1
        self.hits += pinned
        self.layer_hits[layer] += pinned
        self.bytes_from_cache += pinned * size
        self.misses += len(wanted) - pinned
        self.layer_misses[layer] += len(wanted) - pinned
        self.bytes_needed += used
        if self.prefilling:
            self.prefill_seen |= {(layer, e) for e in wanted}
            self.prefill_bound_bytes += used
            self.prefill_read_bytes += read_bytes
            self.prefill_gap_bytes += max(0, read_bytes - used)

    def stage_all_read(self) -> bool:
        """No staged layer, or every matrix of it read or computed: its room frees from here on."""
        stage = self._stage
        return stage is None or set(stage.reads) | set(stage.computed) >= set(range(self._matrix_count(stage.layer)))

    def _take_early(self, stage: _Stage) -> None:
        """The staged layer's first matrices, paging in since the layer started: their reads of
        the staged experts become the stage's; the others go back."""
        early = self._early
        if early is None:
            return
        self._early = None
        if early.layer != stage.layer:
            self._give_back_reads(early.all_reads())
            return
        staged = set(stage.experts)

        def failed(futures: list[Future]) -> bool:
            return any(f.done() and (f.cancelled() or f.exception() is not None) for f in futures)

        # Reads of experts the router left out go first (read, but not needed): the room they
        # free may be needed below.
        for matrix, reads in early.reads.items():
            early.reads[matrix] = [(u, f) for u, f in reads if u.expert in staged]
            left_out = [(u, f) for u, f in reads if u.expert not in staged]
            self.bytes_needed -= sum(u.length for u, _ in left_out)
            self._give_back_reads(left_out)
        matrices = list(early.reads)
        for i, matrix in enumerate(matrices):
            reads = early.reads[matrix]
            # A read that failed is read again (its failure stopped the token it came in).
            kept = [(u, f) for u, f in reads if not failed(f)]
            self._give_back_reads([(u, f) for u, f in reads if failed(f)])
            missing = [self._matrix_unit(stage.layer, e, matrix) for e in sorted(staged - {u.expert for u, _ in kept})]
            if missing:  # cached when the layer started, given up for room since
                if not self._make_room(sum(u.footprint for u in missing), stage.held):
                    # Read when its node asks, as without the early start; the later ones too
                    # (they would hold its room).
                    self._give_back_reads(kept)
                    for later in matrices[i + 1 :]:
                        self._give_back_reads(early.reads[later])
                    return
                self._count_read(missing)
                kept += list(zip(missing, self._page_in_units(missing)))
            stage.reads[matrix] = kept

    def _give_back_early(self) -> None:
        early, self._early = self._early, None
        if early is not None:
            self._give_back_reads(early.all_reads())

    def _give_back_reads(self, reads: list[tuple[ExpertUnit, list[Future]]]) -> None:
        for unit, futures in reads:
            self._settle(futures)
            self._drop_unit(unit)
            self._resident_bytes -= unit.footprint

    def _matrix_unit(self, layer: int, expert: int, matrix: int) -> ExpertUnit:
        """One routed matrix's slice of an expert: what a staged read is about."""
        return ExpertUnit(layer, expert, (self.model.expert_ranges(layer, expert)[matrix],), matrix)

    def _matrix_units(self, stage: _Stage, matrix: int) -> list[ExpertUnit]:
        return [self._matrix_unit(stage.layer, e, matrix) for e in stage.experts]

    def _matrix_footprint(self, stage: _Stage, matrix: int) -> int:
        return sum(u.footprint for u in self._matrix_units(stage, matrix))

    def _routed_names(self, layer: int) -> dict[bytes, int]:
        """``layer``'s routed tensors by name, each with its index in ``expert_ranges``."""
        names = self._matrices.get(layer)
        if names is None:
            names = self._matrices[layer] = {t.name.encode(): i for i, t in enumerate(self.model.routed_tensors(layer))}
        return names

    def _matrix_count(self, layer: int) -> int:
        """How many routed tensors ``layer`` has: the matrices an expert's unit holds a range of."""
        return len(self._routed_names(layer))

    def _down_matrix(self, layer: int) -> int | None:
        """The routed down projection's index: computed last, on what gate and up gave (before any
        staged layer has taught the order, file order would read it first: converted K3 and
        DeepSeek files store down, gate, up)."""
        return next((i for name, i in self._routed_names(layer).items() if b"ffn_down_exps" in name), None)

    def _matrix_of(self, layer: int, name: bytes) -> int | None:
        return self._routed_names(layer).get(name)

    def _start_matrix(self, stage: _Stage, matrix: int, needed: bool) -> bool:
        """Read ``matrix``'s slices of the staged experts into room made for them; without room a
        read ahead (``needed`` False) waits, a needed one fails."""
        units = self._matrix_units(stage, matrix)
        footprint = sum(u.footprint for u in units)
        room = self._make_room(footprint, stage.held)
        if not room and needed:
            # llama.cpp asks for another matrix than was read ahead (the order is learnt from the
            # first staged layer): what it has not asked for yet is given back, read again later.
            for ahead in [m for m in stage.reads if m not in stage.computed]:
                self._give_back_matrix(stage, ahead)
            room = self._make_room(footprint, stage.held)
        if not room:
            if not needed:
                return False
            from kimitui.units import format_bytes

            raise StagingError(
                f"layer {stage.layer}: one matrix of the {len(units)} experts this micro-batch routes to takes "
                f"{format_bytes(footprint)}, more than the expert cache's {format_bytes(self.capacity)} beside its "
                f"{len(stage.held)} cached ones; lower model.n_batch or raise the budget"
            )
        self._count_read(units)
        stage.reads[matrix] = list(zip(units, (self._page_in_units or self._read_units)(units)))
        return True

    def _count_read(self, units: list[ExpertUnit]) -> None:
        """``units`` (one matrix's slices) are read into room made for them: counted."""
        self._resident_bytes += sum(u.footprint for u in units)
        read = sum(u.length for u in units)
        self.bytes_needed += read
        if self.prefilling:
            self.prefill_read_bytes += read

    def _read_ahead_matrices(self) -> None:
        """Start the staged matrices not yet read that fit beside those being read, in the order
        llama.cpp computes them (learnt from the last staged layer; file order at first)."""
        stage = self._stage
        for matrix in self._compute_order(stage.layer):
            if matrix in stage.computed or matrix in stage.reads:
                continue
            if not self._start_matrix(stage, matrix, needed=False):
                return

    def stage_matrix(self, name: bytes) -> float | None:
        """llama.cpp is about to compute with the routed tensor ``name``: when it is a staged
        matrix, its slices are made resident (seconds waited); None when nothing is staged for it.
        In a deferred layer, the reads of that matrix are waited for."""
        deferred = self._deferred
        if deferred is not None:
            matrix = self._matrix_of(deferred.layer, name)
            if matrix is None or matrix in deferred.asked:
                return None
            started = time.perf_counter()
            try:
                deferred.asked.add(matrix)  # asked: waited for, or failed
                for f in deferred.by_matrix.get(matrix, ()):
                    f.result()  # a failed read raises here, before the matmul runs
            except BaseException:
                deferred.failed = True
                self._end_deferred(strict=False)
                raise
            return time.perf_counter() - started
        stage = self._stage
        if stage is None:
            return None
        matrix = self._matrix_of(stage.layer, name)
        if matrix is None or matrix in stage.computed:
            return None
        stage.computed.append(matrix)
        started = time.perf_counter()
        try:
            if matrix not in stage.reads:
                self._start_matrix(stage, matrix, needed=True)
            for _unit, futures in stage.reads[matrix]:
                for f in futures:
                    # Paged in, the node computes while the slices arrive in the order it uses
                    # them (an expert's rows fault in what has not landed yet): at a budget with
                    # room for one matrix, reads and compute overlap instead of taking turns.
                    if self._page_in_units is None or f.done():
                        f.result()  # a failed read raises here, before the matmul runs
        except BaseException:
            self.end_stage(strict=False)
            raise
        return time.perf_counter() - started

    def matrix_done(self, name: bytes) -> None:
        """The node that used ``name`` has computed: give its staged slices back, read the next ahead."""
        stage = self._stage
        if stage is None:
            return
        matrix = self._matrix_of(stage.layer, name)
        if matrix is None or matrix not in stage.reads or matrix not in stage.computed:
            return
        reads = stage.reads[matrix]
        self._give_back_matrix(stage, matrix)
        if self._page_in_units is not None:
            for _unit, futures in reads:
                for f in futures:
                    if not f.cancelled():
                        f.result()  # a page-in that failed under compute stops the token
        self._read_ahead_matrices()

    def _give_back_matrix(self, stage: _Stage, matrix: int) -> None:
        self._give_back_reads(stage.reads.pop(matrix))

    def end_stage(self, strict: bool) -> None:
        """The staged layer is over (the next one starts, or a new graph): give back what is still
        read for it. ``strict``: a matrix read but never asked for means llama.cpp computed it
        without the engine, on pages nobody placed: the token stops."""
        if self._deferred is not None:
            self._end_deferred(strict)
        stage = self._stage
        if stage is None:
            return
        self._stage = None
        self._in_use = set()
        if len(stage.computed) == self._matrix_count(stage.layer):
            self._matrix_order = list(stage.computed)
        left = [m for m in stage.reads if m not in stage.computed]
        for matrix in list(stage.reads):
            self._give_back_matrix(stage, matrix)
        if self._page_in_units is not None and self._sweep_layer is not None:
            layer = stage.layer
            self._sweep_layer(layer, {e for (l, e) in self.pinned if l == layer} | {e for (l, e) in self._resident if l == layer})
        if strict and (left or len(stage.computed) < self._matrix_count(stage.layer)):
            raise StagingError(
                f"layer {stage.layer}: llama.cpp computed the routed experts without asking for "
                f"{self._matrix_count(stage.layer) - len(stage.computed)} of their matrices "
                "(unsupported llama.cpp build?)"
            )

    @property
    def staging(self) -> bool:
        """Whether llama.cpp's routed matrix nodes of the layer computing are waited on (staged
        or deferred)."""
        return self._stage is not None or self._deferred is not None

    def clear(self) -> None:
        """Forget every cached expert (the pinned hot ones stay): each is read again when next routed
        to. A staged layer's slices are waited for and given back too, and an early first matrix."""
        self.end_stage(strict=False)
        self._give_back_early()
        self._warm_order = None
        for key in list(self._resident):
            self._forget(key)

    def resident_of(self, layer: int) -> list[tuple[tuple[int, int], ExpertUnit]]:
        """``layer``'s cached experts (the pinned hot ones aside), their reads landed: one read
        ahead and still under way is waited for (a slot is about to change hands)."""
        out = []
        for key in [key for key in self._resident if key[0] == layer]:
            futures = self._inflight.pop(key, None)
            self._settle(futures)
            if any(f.cancelled() or f.exception() is not None for f in futures or ()):
                self._forget(key)  # a guess that failed or never ran: nothing of it to keep
            else:
                out.append((key, self._resident[key]))
        return out

    def forget(self, key: tuple[int, int]) -> None:
        """Forget one cached expert: it is read again when next routed to."""
        self._forget(key)

    def _forget(self, key: tuple[int, int]) -> None:
        unit = self._resident.pop(key, None)
        self.policy.forgot(key)
        self._settle(self._inflight.pop(key, None))
        self._prefetched.discard(key)
        if unit is not None:
            self._resident_bytes -= unit.footprint
            self._drop_unit(unit)

    def begin_prefill(self) -> None:
        self._give_back_early()  # one a reply that failed left
        if self._spare is not None:  # a prompt's layers and windows need the room
            self._spare.free(self._spare.allowed)
        self.prefilling = True
        self._warm_order = None  # this prompt's routing counts too
        self.prefill_seen = set()
        self.prefill_read_bytes = 0
        self.prefill_gap_bytes = 0
        self.prefill_bound_bytes = 0

    @property
    def resident_bytes(self) -> int:
        """Cached experts' bytes, the pinned hot ones aside: never above ``capacity``."""
        return self._resident_bytes

    def resident_keys(self) -> set[tuple[int, int]]:
        return set(self._resident) | self.pinned

    def holds(self, layer: int, experts: Iterable[int]) -> list[bool]:
        """Whether each of ``experts`` of ``layer`` is in memory or being read: pinned, cached,
        read ahead, or its layer read whole (its bytes are paid for either way)."""
        if layer in self.whole_layers:  # read whole by the streamer
            return [True for _ in experts]
        return [(layer, e) in self.pinned or (layer, e) in self._resident for e in experts]

    def layer_hit_rates(self) -> list[float | None]:
        return [h / (h + m) if h + m else None for h, m in zip(self.layer_hits, self.layer_misses)]


class RouterPredictor:
    """Guesses the next MoE layer's experts from this layer's hidden state.

    While layer L computes, the router of layer L+1 is applied to the input of layer L's FFN
    (the normed residual stream, which changes little from one layer to the next): the top-k
    of its scores are read ahead. On the Kimi-shaped synthetic model this guessed 80% of the
    experts layer L+1 then chose; the router bias alone guessed 19%. The router weights are
    small trunk tensors, read through the model's mapping (pinned with the trunk).
    """

    def __init__(self, routers: dict[int, tuple]) -> None:
        self.routers = routers  # layer -> (weights [n_expert, n_embd] float32, selection bias or None)

    @classmethod
    def from_mapping(cls, model: ModelMap, space) -> "RouterPredictor | None":
        """None where the router weights are not plain floats (nothing cheap to apply)."""
        import ctypes

        import numpy as np

        dtypes = {"F32": np.float32, "F16": np.float16}
        routers: dict[int, tuple] = {}
        for layer, info in enumerate(model.layers):
            if not info.is_moe:
                continue
            weight = bias = None
            for t in model.layer_tensors(layer):
                base = t.name.split(".")[-2] if t.name.count(".") >= 2 else t.name
                if t.role != "router" or t.ggml_type not in dtypes:
                    continue
                view = np.frombuffer((ctypes.c_char * t.n_bytes).from_address(space.at(t.file, t.offset)), dtype=dtypes[t.ggml_type])
                if base == "ffn_gate_inp" and len(t.shape) == 2:
                    weight = view.reshape(t.shape[1], t.shape[0])
                elif base == "exp_probs_b":
                    bias = view
            if weight is None:
                return None
            routers[layer] = (weight, bias)
        return cls(routers) if routers else None

    def predict(self, layer: int, hidden, k: int) -> list[int]:
        import numpy as np

        weight, bias = self.routers[layer]
        scores = weight.astype(np.float32, copy=False) @ hidden
        if bias is not None:  # DeepSeek-V3/Kimi: sigmoid scores, selected with a bias added
            scores = 1.0 / (1.0 + np.exp(-scores)) + bias
        return np.argpartition(-scores, k)[:k].tolist()
