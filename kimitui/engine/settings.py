"""The streaming engine's settings, apart from the engine itself: an engine is made (and its
load started) before anything decides whether the model streams at all."""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("pin-stream", "lru")
EXPERT_POLICIES = ("lru", "lfu")  # the routed-expert cache's


@dataclass(frozen=True)
class StreamSettings:
    prefetch_depth: int = 2
    policy: str = "pin-stream"
    io_threads: int = 4
    window_bytes: int = 0  # streamed bytes that may be resident at once (0: depth + 1 layers' worth)
    expert_policy: str = "lfu"  # the routed-expert cache: "lfu" or "lru"
    expert_lookahead: bool = False  # read the experts layer L+1 chose last token while layer L computes
