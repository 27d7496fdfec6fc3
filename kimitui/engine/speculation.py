"""Speculative decoding that shares the trunk: drafted tokens verified in one pass.

Where the weights stream, a pass reads the unpinned trunk once whatever the number of tokens in
it, and each token adds only its own routed experts. So a pass that checks k drafted tokens
beside the one it must compute costs little more than a plain decode step and may emit up to
k + 1 tokens. llama-cpp-python's generate() already verifies drafts: it evaluates the sampled
token and the drafts in one batch, samples at each position with the reply's own sampler chain,
and keeps the drafts while they equal what was sampled: one sample per emitted token, the same
sampler state. The output is plain decoding's token for token where a batched token's logits
equal a lone one's, which the cache of a context that may check drafts makes so at any length
(kv_cache.py). What this module adds:

- ``lookup``: drafts from the conversation itself, as llama.cpp's lookup decoding and
  prompt-lookup decoding do: the longest n-gram at the end of the tokens so far that occurred
  earlier (down to one token), and the tokens that followed its last occurrence. Or
  ``DraftModel``: a small model with the same vocabulary (engine.draft_model) drafts greedily.
- ``DraftPlanner``: how many drafts a pass carries, from the acceptance measured so far and
  the bytes a pass costs (the streamed trunk once, each token's routed experts). It picks the
  count with the fewest expected bytes per emitted token and drafts nothing where no count beats
  plain decoding (nothing streams, or drafts are rarely accepted). Acceptance is learnt apart for
  drafts that followed a single matching token, those that followed a longer match and a draft
  model's, each as two chances: that the first draft is kept, and that a draft after a kept one
  is kept too (a copied run goes on once it has started). After a run of plain passes it tries
  one draft again, so that acceptance is measured again.
- ``Speculation``: the draft model llama-cpp-python calls between passes; it counts passes,
  drafts and acceptances for the panels and the trace.
- ``RollbackGuard``: on a recurrent model's context, only a drafted pass's own tokens may be
  taken back (below).

A model whose memory is recurrent (Kimi K3's KDA layers) cannot drop the state of a rejected
draft; llama.cpp keeps per-token snapshots of that state for it (``n_rs_seq``, which the
engine sets to the most drafts a pass carries, counted in the context's memory) and rolls back
to the last accepted token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from kimitui.engine.metrics import DraftCounts
from kimitui.engine.slots import common_prefix

NGRAM_MAX = 4  # the longest suffix looked up; shorter ones are tried after it
NGRAM_MIN = 1  # a single matching token too: its drafts' acceptance is learnt apart (DraftPlanner)
PROBE_AFTER = 16  # plain passes in a row before one draft is tried again
MEMORY = 0.95  # the weight of what acceptance was one pass earlier
# What one more token in a pass costs besides its own expert bytes, as a share of the pass's
# trunk read. On the embedded model streamed at 60 MiB here a one-token pass took 93 ms and a
# nine-token one 148 ms: ~7 ms, 7.5%, a token (in RAM a batched token computes in a quarter of a
# lone one's 12.8 ms; streamed, the pass's reads and its longer compute share two cores).
TOKEN_COMPUTE = 0.075
FROM_DRAFT_MODEL = 0  # the match length of a draft model's drafts: a class of their own


def lookup(tokens: Sequence[int], count: int, ngram_max: int = NGRAM_MAX, ngram_min: int = NGRAM_MIN) -> tuple[list[int], int]:
    """Up to ``count`` tokens that followed the last earlier occurrence of the longest n-gram
    (``ngram_max`` down to ``ngram_min``) that ends ``tokens``, and that n-gram's length
    (([], 0) where none occurred earlier)."""
    n = len(tokens)
    if count <= 0 or n < ngram_min + 1:
        return [], 0
    seq = np.asarray(tokens, dtype=np.int64)
    for size in range(min(ngram_max, n - 1), ngram_min - 1, -1):
        tail = seq[n - size:]
        # Every start s < n - size where seq[s:s+size] == tail; the latest one wins.
        starts = np.flatnonzero(seq[: n - size] == tail[0])
        for s in starts[::-1]:
            if s + size < n and np.array_equal(seq[s: s + size], tail):
                follow = seq[s + size: s + size + count]
                if len(follow):
                    return follow.tolist(), size
    return [], 0


@dataclass
class Acceptance:
    """What became of one kind of drafts: kept and rejected first drafts, and kept and rejected
    drafts after a kept one, older passes fading (MEMORY). The first chance starts from a
    Beta(1, 1) prior (one kept and one rejected before any is seen); the next one from the first
    chance, with the weight of one draft, so that until a run has been seen a draft after a kept
    one counts as likely as the first (passes of one draft, all a costly token allows, never
    measure it)."""

    first_kept: float = 1.0
    first_rejected: float = 1.0
    next_kept: float = 0.0
    next_rejected: float = 0.0

    def observe(self, drafted: int, kept: int) -> None:
        self.first_kept = self.first_kept * MEMORY + (kept >= 1)
        self.first_rejected = self.first_rejected * MEMORY + (kept == 0)
        if kept >= 1 and drafted >= 2:
            self.next_kept = self.next_kept * MEMORY + (kept - 1)
            self.next_rejected = self.next_rejected * MEMORY + (kept < drafted)

    def expected_tokens(self, k: int) -> float:
        """Tokens a pass with ``k`` drafts emits on average: the one it computes, the first draft
        kept with one chance, and each next one with the other once those before it were."""
        first = self.first_kept / (self.first_kept + self.first_rejected)
        after = (self.next_kept + first) / (self.next_kept + self.next_rejected + 1.0)
        return 1.0 + first * sum(after**j for j in range(k))


@dataclass
class DraftPlanner:
    """Drafts per pass from measured acceptance and measured bytes.

    ``trunk_bytes``: what a pass streams whatever its size; ``token_bytes``: what each token of
    it adds (its routed experts), beside its compute, counted as TOKEN_COMPUTE of the trunk's
    read. ``match``: the length of the n-gram the drafts followed (FROM_DRAFT_MODEL for a draft
    model's): a single matching token predicts a copied run less often than a longer match, so
    their acceptance is learnt apart."""

    max_drafts: int
    acceptance: dict[int, Acceptance] = field(default_factory=dict)
    plain_in_a_row: int = 0
    _match_last: int | None = None  # the match length the last drafts() was asked about

    @staticmethod
    def _kind(match: int) -> int:
        return min(match, 2)  # a draft model's; after one matching token; after more

    def observe(self, drafted: int, kept: int) -> None:
        """The last pass carried ``drafted`` drafts and kept ``kept`` of them (a rejection ended
        it if fewer)."""
        if drafted <= 0 or self._match_last is None:
            return
        self.acceptance.setdefault(self._kind(self._match_last), Acceptance()).observe(drafted, kept)

    def drafts(self, trunk_bytes: float, token_bytes: float, available: int, match: int = FROM_DRAFT_MODEL) -> int:
        """How many of ``available`` drafts the next pass should carry (0: a plain pass)."""
        limit = min(self.max_drafts, available)
        self._match_last = match
        if limit <= 0 or trunk_bytes <= 0:
            return 0  # nothing streams: a draft saves no read and costs compute
        acceptance = self.acceptance.get(self._kind(match)) or Acceptance()
        token = token_bytes + TOKEN_COMPUTE * trunk_bytes
        best_k, best = 0, (trunk_bytes + token) / 1.0
        for k in range(1, limit + 1):
            per_token = (trunk_bytes + (k + 1) * token) / acceptance.expected_tokens(k)
            if per_token < best * 0.999:
                best_k, best = k, per_token
        if best_k == 0:
            self.plain_in_a_row += 1
            if self.plain_in_a_row >= PROBE_AFTER:  # measure acceptance again, one draft's worth
                self.plain_in_a_row = 0
                return 1
        else:
            self.plain_in_a_row = 0
        return best_k


class DraftModel:
    """Drafts from a small model with the target's vocabulary (engine.draft_model), greedy. Its
    own context follows the conversation: each call keeps what it shares with the tokens so far
    and evaluates the rest."""

    def __init__(self, llm) -> None:
        self.llm = llm

    def draft(self, tokens: Sequence[int], count: int) -> list[int]:
        import llama_cpp

        llm = self.llm
        tokens = list(tokens)
        if len(tokens) + count >= llm.n_ctx():
            return []
        keep = min(common_prefix(llm.input_ids[: llm.n_tokens].tolist(), tokens), len(tokens) - 1)  # the last token is evaluated again: its logits are the next draft's
        if keep == 0 or not llm._ctx.kv_cache_seq_rm(-1, keep, -1):
            llm.reset()  # a recurrent draft model cannot go back: it evaluates the conversation afresh
            keep = 0
        llm.n_tokens = keep
        llm.eval(tokens[keep:])
        drafts: list[int] = []
        n_vocab = llm.n_vocab()
        for _ in range(count):
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(n_vocab,))
            token = int(np.argmax(logits))
            if llama_cpp.llama_vocab_is_eog(llm._model.vocab, token):
                break
            drafts.append(token)
            llm.eval([token])
        return drafts

    def close(self) -> None:
        self.llm.close()


def vocabulary_difference(model, draft) -> str | None:
    """Why ``draft``'s tokens are not ``model``'s (both llama-cpp-python models), or None."""
    import llama_cpp

    if draft.n_vocab() != model.n_vocab():
        return f"{draft.n_vocab()} tokens against {model.n_vocab()}"
    ours, theirs = model._model.vocab, draft._model.vocab
    for token in range(model.n_vocab()):
        a, b = llama_cpp.llama_vocab_get_text(ours, token), llama_cpp.llama_vocab_get_text(theirs, token)
        if a != b:
            return f"token {token} is {b!r} against {a!r}"
    return None


class RollbackGuard:
    """llama.cpp takes a recurrent state back a few tokens from snapshots of the last
    micro-batch's positions only (``n_rs_seq``), and a removal that reaches further back, or past
    a micro-batch that wrote fewer snapshots, silently restores a stale one. So on a recurrent
    model's context the only partial removals let through are those of the drafted pass just
    evaluated, after its first token (``allow_after``); any other is refused as llama.cpp refused
    it before it kept snapshots, and the caller evaluates afresh (llama-cpp-python's prefix reuse
    does)."""

    def __init__(self, ctx) -> None:
        self._ctx = ctx
        self._remove = ctx.kv_cache_seq_rm
        self.floor: int | None = None  # the drafted pass's first position, while its tokens may be taken back
        ctx.kv_cache_seq_rm = self.seq_rm

    def allow_after(self, position: int | None) -> None:
        self.floor = position

    def seq_rm(self, seq_id: int, p0: int, p1: int) -> bool:
        import llama_cpp

        if p0 > 0 and (self.floor is None or p0 <= self.floor):
            last = llama_cpp.llama_memory_seq_pos_max(self._ctx.memory, max(seq_id, 0))
            if p0 <= last and (p1 < 0 or p1 > last):  # it would take the state back: not from these snapshots
                return False
        return self._remove(seq_id, p0, p1)


@dataclass
class Speculation:
    """generate()'s draft model for one reply. ``pass_bytes()`` says what the streamer has read
    so far as (trunk bytes, routed-expert bytes), cumulative, or None where nothing streams."""

    planner: DraftPlanner
    pass_bytes: Callable[[], tuple[int, int] | None]
    draft_model: DraftModel | None = None  # drafts from this model instead of the conversation
    guard: RollbackGuard | None = None  # a recurrent model's: told which positions a drafted pass may take back
    on_pass: Callable[[int, int, int], None] | None = None  # (drafted, kept, emitted) for the panels
    # The context's cells: generate() drops drafts past them, which must then not count as drafted.
    n_ctx: int | None = None
    stats: DraftCounts = field(default_factory=DraftCounts)
    _drafted_last: int = 0
    _yielded_since: int = 0
    _bytes_at: tuple[int, int] | None = None
    _started: bool = False
    _trunk_per_pass: float = 0.0
    _expert_per_token: float = 0.0

    def token_yielded(self) -> None:
        self._yielded_since += 1

    def __call__(self, input_ids: np.ndarray) -> np.ndarray:
        """Called by generate() after each pass, with every token so far (the last one sampled
        and not yet evaluated): the drafts to evaluate beside it."""
        self._close_pass()
        most = self.planner.max_drafts if self.n_ctx is None else min(self.planner.max_drafts, max(0, self.n_ctx - len(input_ids)))
        if self.draft_model is not None:  # decided first: each draft costs the draft model a step
            k = self.planner.drafts(self._trunk_per_pass, self._expert_per_token, most)
            drafts = self.draft_model.draft(input_ids, k) if k else []
        else:
            available, match = lookup(input_ids, most)
            drafts = available[: self.planner.drafts(self._trunk_per_pass, self._expert_per_token, len(available), match)] if available else []
        self._drafted_last = len(drafts)
        return np.asarray(drafts, dtype=np.intc)

    def finish(self) -> None:
        """The reply ended: its last pass counted, though not as acceptance (the reply may have
        stopped inside it)."""
        if self._yielded_since and self._started:
            emitted, self._yielded_since = self._yielded_since, 0
            self._count(emitted)

    def _count(self, emitted: int) -> int:
        """A pass that gave ``emitted`` tokens, counted; the drafts it kept (each token but the
        last one it gave was a draft that equalled what was sampled)."""
        kept = max(0, min(self._drafted_last, emitted - 1))
        self.stats.passes += 1
        self.stats.emitted += emitted
        self.stats.drafted += self._drafted_last
        self.stats.accepted += kept
        if self.on_pass is not None:
            self.on_pass(self._drafted_last, kept, emitted)
        return kept

    def _close_pass(self) -> None:
        """What the pass since the last call drafted, kept and read. The first call closes the
        prompt's evaluation, which is no decode pass."""
        emitted, self._yielded_since = self._yielded_since, 0
        now = self.pass_bytes()
        before, self._bytes_at = self._bytes_at, now
        if not self._started:
            self._started = True
            return
        self.planner.observe(self._drafted_last, self._count(emitted))
        if now is None or before is None or now[0] < before[0] or now[1] < before[1]:
            return  # nothing streams, or live tuning made a new streamer whose counts start again
        trunk, per_token = now[0] - before[0], (now[1] - before[1]) / (1 + self._drafted_last)
        # Recent passes weigh most: the pinned set and the expert cache change what a pass reads.
        first = self.stats.passes <= 1
        self._trunk_per_pass = trunk if first else 0.7 * self._trunk_per_pass + 0.3 * trunk
        self._expert_per_token = per_token if first else 0.7 * self._expert_per_token + 0.3 * per_token
