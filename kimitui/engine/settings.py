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


def check_changes(changes: dict) -> None:
    """ValueError naming the first live-tuning value a streamer cannot take."""
    if "policy" in changes and changes["policy"] not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}")
    if "expert_policy" in changes and changes["expert_policy"] not in EXPERT_POLICIES:
        raise ValueError(f"expert policy must be one of {', '.join(EXPERT_POLICIES)}")
    if "io_threads" in changes and not 1 <= changes["io_threads"] <= 64:
        raise ValueError("I/O threads must be 1..64")
    if "prefetch_depth" in changes and not 0 <= changes["prefetch_depth"] <= 16:
        raise ValueError("prefetch depth must be 0..16")
