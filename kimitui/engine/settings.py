"""The streaming engine's settings, apart from the engine itself: an engine is made (and its
load started) before anything decides whether the model streams at all. Their defaults,
bounds and choices are the config schema's ([engine] in config.py): one place for each."""

from __future__ import annotations

from dataclasses import dataclass

from kimitui.config import key_spec
from kimitui.engine.trimming import TrimRule

POLICIES = key_spec("engine.policy").choices
EXPERT_POLICIES = key_spec("engine.expert_policy").choices  # the routed-expert cache's


@dataclass(frozen=True)
class StreamSettings:
    prefetch_depth: int = key_spec("engine.prefetch_depth").default
    policy: str = key_spec("engine.policy").default
    io_threads: int = key_spec("engine.io_threads").default
    window_bytes: int = 0  # streamed bytes that may be resident at once (0: depth + 1 layers' worth)
    expert_policy: str = key_spec("engine.expert_policy").default  # the routed-expert cache: "lfu" or "lru"
    expert_lookahead: bool = key_spec("engine.expert_lookahead").default  # read the experts layer L+1 chose last token while layer L computes
    # Lossy, off by default (trimming.py): skip a routed expert that is not in memory when its
    # share of the token's routing weight is below ``expert_trim_below``, or when it comes after
    # the token's experts whose shares reach ``expert_trim_cumulative``.
    expert_trim_below: float = key_spec("engine.expert_trim_below").default
    expert_trim_cumulative: float = key_spec("engine.expert_trim_cumulative").default

    @property
    def trim_rule(self) -> TrimRule:
        return TrimRule(self.expert_trim_below, self.expert_trim_cumulative)


def _within(key: str, value: int, what: str) -> None:
    spec = key_spec(f"engine.{key}")
    if not spec.low <= value <= spec.high:
        raise ValueError(f"{what} must be {spec.low:g}..{spec.high:g}")


def check_changes(changes: dict) -> None:
    """ValueError naming the first live-tuning value a streamer cannot take."""
    if "policy" in changes and changes["policy"] not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}")
    if "expert_policy" in changes and changes["expert_policy"] not in EXPERT_POLICIES:
        raise ValueError(f"expert policy must be one of {', '.join(EXPERT_POLICIES)}")
    if "io_threads" in changes:
        _within("io_threads", changes["io_threads"], "I/O threads")
    if "prefetch_depth" in changes:
        _within("prefetch_depth", changes["prefetch_depth"], "prefetch depth")
    if "expert_trim_below" in changes:
        _within("expert_trim_below", changes["expert_trim_below"], "expert trim share")
    if "expert_trim_cumulative" in changes:
        _within("expert_trim_cumulative", changes["expert_trim_cumulative"], "expert trim cumulative share")
