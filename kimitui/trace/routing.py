"""`kimitui trace routing`: the expert cache judged against the best any cache could do.

A trace's route records are the routing the engine met: for each micro-batch and MoE layer, the
experts chosen and how many of them were resident. Replaying that sequence through a cache of
the same number of expert slots gives the offline optimum (Belady: on a miss, evict the expert
whose next use is farthest away), and beside it LRU, LFU and the best fixed set in hindsight
(a frequency oracle). A layer's experts are
needed together, so none of the group being served is evicted for another of it.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict

from kimitui.trace.reader import Trace

Key = tuple[int, int]  # (layer, expert)
NEVER = float("inf")


def route_groups(trace: Trace) -> list[list[Key]]:
    """Every router choice in the trace, in order: the (layer, expert) pairs needed together."""
    return [[(r["layer"], e) for e in r["experts"]] for req in trace.requests for r in req.routes]


def engine_hits(trace: Trace) -> tuple[int, int]:
    """(experts found resident, experts asked for) as the engine counted them."""
    hits = asked = 0
    for req in trace.requests:
        for r in req.routes:
            hits += r["hits"]
            asked += len(r["experts"])
    return hits, asked


def belady_hits(groups: list[list[Key]], slots: int) -> int:
    """Hits of the optimal offline cache of ``slots`` experts on ``groups``, starting empty."""
    flat = [key for group in groups for key in group]
    next_use = [NEVER] * len(flat)
    seen: dict[Key, int] = {}
    for i in range(len(flat) - 1, -1, -1):
        next_use[i] = seen.get(flat[i], NEVER)
        seen[flat[i]] = i
    resident: dict[Key, float] = {}  # key -> position of its next use
    heap: list[tuple[float, Key]] = []  # (-next use, key), stale entries skipped
    hits = 0
    position = 0
    for group in groups:
        serving = set(group)
        for key in group:
            upcoming = next_use[position]
            position += 1
            if key in resident:
                hits += 1
            elif len(resident) >= slots:
                held = []
                while heap:
                    far, victim = heapq.heappop(heap)
                    if resident.get(victim) != -far:
                        continue  # stale
                    if victim in serving:
                        held.append((far, victim))
                        continue
                    del resident[victim]
                    break
                for entry in held:
                    heapq.heappush(heap, entry)
                if len(resident) >= slots:
                    continue  # the group alone fills the cache: this one is read and not kept
            resident[key] = upcoming
            heapq.heappush(heap, (-upcoming, key))
    return hits


def lru_hits(groups: list[list[Key]], slots: int) -> int:
    cache: OrderedDict[Key, None] = OrderedDict()
    hits = 0
    for group in groups:
        serving = set(group)
        for key in group:
            if key in cache:
                hits += 1
                cache.move_to_end(key)
                continue
            if len(cache) >= slots:
                victim = next((k for k in cache if k not in serving), None)
                if victim is None:
                    continue
                del cache[victim]
            cache[key] = None
    return hits


def lfu_hits(groups: list[list[Key]], slots: int) -> int:
    """LFU with recency as the tie-break, counts from this trace alone (no earlier heatmap)."""
    counts: dict[Key, int] = {}
    cache: dict[Key, tuple[int, int]] = {}
    heap: list[tuple[int, int, Key]] = []
    hits = tick = 0
    for group in groups:
        serving = set(group)
        for key in group:
            tick += 1
            counts[key] = counts.get(key, 0) + 1
            if key in cache:
                hits += 1
            elif len(cache) >= slots:
                held, evicted = [], False
                while heap:
                    entry = heapq.heappop(heap)
                    victim = entry[2]
                    if cache.get(victim) != entry[:2]:
                        continue
                    if victim in serving:
                        held.append(entry)
                        continue
                    del cache[victim]
                    evicted = True
                    break
                for entry in held:
                    heapq.heappush(heap, entry)
                if not evicted:
                    continue
            cache[key] = (counts[key], tick)
            heapq.heappush(heap, (counts[key], tick, key))
    return hits


def static_hits(groups: list[list[Key]], slots: int) -> int:
    """Hits of the best fixed set chosen in hindsight (the experts used most in the whole trace),
    beside room for the largest group: what a perfect frequency oracle, such as a heatmap of this
    very routing, could pin. Where the optimum is far above it, the routing's reuse is in its
    timing, which no policy that cannot see ahead will find."""
    from collections import Counter

    counts = Counter(key for group in groups for key in group)
    room = max(0, slots - max(len(group) for group in groups))
    kept = {key for key, _ in counts.most_common(room)}
    # Started empty as the optimum is: a kept expert's first use is a read, its later ones hits.
    return sum(1 for group in groups for key in group if key in kept) - len(kept)


def report(trace: Trace, slots: int | None = None) -> dict:
    """The engine's expert hit rate beside the optimum's, LRU's and LFU's at the same slots."""
    groups = route_groups(trace)
    if not groups:
        return {"error": "the trace has no route records (a dense model, or a model that was not streamed)"}
    if slots is None:
        found = {req.settings.get("expert_slots") for req in trace.requests} - {None}
        if len(found) != 1:
            return {"error": "the trace does not say how many experts the cache held; give --slots"}
        slots = found.pop()
    hits, asked = engine_hits(trace)
    best = belady_hits(groups, slots)
    return {
        "slots": slots,
        "choices": len(groups),
        "experts_asked": asked,
        "distinct_experts": len({key for group in groups for key in group}),
        "engine_hit_rate": hits / asked if asked else None,
        "belady_hit_rate": best / asked if asked else None,
        "lru_hit_rate": lru_hits(groups, slots) / asked if asked else None,
        "lfu_hit_rate": lfu_hits(groups, slots) / asked if asked else None,
        "static_hit_rate": static_hits(groups, slots) / asked if asked else None,
        "engine_vs_belady": hits / best if best else None,
        "expert_policies": sorted({str(req.settings.get("expert_policy")) for req in trace.requests}),
    }
