"""The routed-expert cache's eviction policies, by name: a policy joins with its class here.

The cache (experts.py) keeps its resident experts in use order, oldest first, and how often
the router chose each (layer, expert); it tells its policy when an expert is used or leaves,
and asks it which to evict next. The names a user may choose are ``engine.expert_policy``'s
choices in config.py, which imports no engine module: a test keeps the two in step.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from typing import ClassVar

Key = tuple[int, int]  # (layer, expert)


class ExpertPolicy:
    """What the expert cache asks of its eviction policy. ``resident``: the cache's experts,
    oldest use first (the cache keeps that order); ``counts``: routing counts per layer and expert."""

    name: ClassVar[str]

    def __init__(self, resident: Mapping[Key, object], counts: list[list[int]]) -> None:
        self.resident = resident
        self.counts = counts

    def used(self, key: Key) -> None:
        """``key`` was just used, or just became resident."""

    def forgot(self, key: Key) -> None:
        """``key`` left the cache."""

    def victim(self, protect: set[Key]) -> Key | None:
        """The expert to evict next, none of ``protect``; None where every resident one is."""
        raise NotImplementedError


class LeastRecentlyUsed(ExpertPolicy):
    name = "lru"

    def victim(self, protect: set[Key]) -> Key | None:
        return next((key for key in self.resident if key not in protect), None)


class LeastFrequentlyUsed(ExpertPolicy):
    """The coldest expert by routing history goes first, the least recent among equals.

    A heap of (uses, tick, key), one entry per use; an entry is live while it matches
    ``_rank[key]``. Finding a victim is then O(log n), not a scan of thousands of experts on
    every miss (tens of ms per token at Kimi's 23k experts)."""

    name = "lfu"

    def __init__(self, resident: Mapping[Key, object], counts: list[list[int]]) -> None:
        super().__init__(resident, counts)
        self._rank: dict[Key, tuple[int, int]] = {}
        self._tick = 0
        # Experts cached under another policy get ranks too, oldest use first: without, none of
        # them could ever be evicted and reads would pass the capacity.
        for key in resident:
            self._tick += 1
            self._rank[key] = (counts[key[0]][key[1]], self._tick)
        self._heap = [(*rank, key) for key, rank in self._rank.items()]
        heapq.heapify(self._heap)

    def used(self, key: Key) -> None:
        self._tick += 1
        rank = self._rank[key] = (self.counts[key[0]][key[1]], self._tick)
        heapq.heappush(self._heap, (*rank, key))
        if len(self._heap) > 4 * len(self._rank) + 64:  # mostly dead entries: rebuild
            self._heap = [(*r, k) for k, r in self._rank.items()]
            heapq.heapify(self._heap)

    def forgot(self, key: Key) -> None:
        self._rank.pop(key, None)

    def victim(self, protect: set[Key]) -> Key | None:
        held, victim = [], None
        while self._heap:
            entry = heapq.heappop(self._heap)
            key = entry[2]
            if self._rank.get(key) != entry[:2]:
                continue  # a dead entry: used again since, or evicted
            if key in protect:
                held.append(entry)
                continue
            victim = key
            break
        for entry in held:
            heapq.heappush(self._heap, entry)
        return victim


POLICIES_BY_NAME: dict[str, type[ExpertPolicy]] = {p.name: p for p in (LeastFrequentlyUsed, LeastRecentlyUsed)}


def make_policy(name: str, resident: Mapping[Key, object], counts: list[list[int]]) -> ExpertPolicy:
    """The policy called ``name``; ValueError naming the choices for any other."""
    if name not in POLICIES_BY_NAME:
        raise ValueError(f"expert policy must be one of {', '.join(POLICIES_BY_NAME)}")
    return POLICIES_BY_NAME[name](resident, counts)
