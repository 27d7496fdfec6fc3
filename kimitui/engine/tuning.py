"""Live tuning: what a change waits for before it takes effect, and the line that says so.

Stream settings (prefetch depth, policies, I/O threads, look-ahead) apply when the next token
starts. Budget and shard size change the pinned set: it is re-read first, mid-reply too, and
that token waits for it. Two cases need a fresh llama.cpp context, which only a reply's start
can give (the conversation is then prefilled again): a model that fitted and must now stream
(a context takes the eval callback only when it is made), and a MoE model whose expert cache
changes size (prefill micro-batches must follow it, and llama.cpp fixes n_ubatch per context).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass
class PendingTuning:
    repin: bool = False  # re-read the pinned set (and remake the streamer) before the next token
    rebuild: bool = False  # ... on a fresh llama.cpp context, at the next reply's start

    def due(self, mid_reply: bool) -> bool:
        return self.repin and not (mid_reply and self.rebuild)


def schedule(pending: PendingTuning, *, repin: bool, streams: bool, fits: Callable[[], bool], mapped: bool,
             ubatch_changes: Callable[[], bool]) -> str:
    """Mark in ``pending`` what a retune waits for; the line that tells the user when it applies.

    ``repin``: the budget or the shard size changed. ``streams``: the context has the streaming
    callbacks. ``fits()``: the model fits the (new) budget whole. ``mapped``: fast start mapped
    the model (the stock load read it into llama.cpp's buffers instead). ``ubatch_changes()``:
    the new expert cache holds a different prefill micro-batch. The two are asked only when the
    answer matters (a memory plan is not free)."""
    if not repin:
        return "applies from the next token"
    if not streams and not fits():
        if not mapped:
            return "no streaming after the stock load (it read the whole model): the budget applies at the next start"
        pending.repin = pending.rebuild = True
        return "applies from the next reply: streaming starts on a fresh llama.cpp context"
    if ubatch_changes():
        pending.repin = pending.rebuild = True
        return "applies from the next reply, on a fresh llama.cpp context sized for the new expert cache"
    pending.repin = True
    return "applies from the next token, after the pinned set is re-read"
