"""Expert trimming: opt-in and lossy. A routed expert that is not in memory and carries little of
its token's routing weight is skipped instead of read.

Where llama.cpp has picked a layer's experts (``ffn_moe_topk-L``) and gathered their routing
weights (``ffn_moe_weights-L``), before it normalises those weights and before any expert matmul,
the eval callback rewrites both in place: a skipped slot's weight becomes 0 (-inf where the
weights go through a softmax next, as gpt-oss's do), so the token's other experts share its
weight where the model normalises, and its id becomes the token's first choice, which is read
anyway. The matmul then touches no byte of the skipped expert. Nothing is skipped that is
resident (pinned, cached or already being read): that would cost quality and save no read.

A token's "share" of an expert is its weight over the sum of its selected experts' weights
(after the softmax for softmax-weighted models). Two rules, either or both:
- ``below``: skip a miss whose share is below this (BigMoeOnEdge skips low-weight misses);
- ``cumulative``: keep a token's experts in falling share until their shares reach this, and
  skip the misses after that (colibri's cumulative 0.7 kept about 8 of K3's 16).
The token's first choice is never skipped. `kimitui quality --trim-below / --trim-cumulative`
measures what a rule costs with every expert counted as a miss: the most it can cost.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from kimitui.engine.llama_glue import GGML_NB_OFFSET, GGML_NE_OFFSET

SOFTMAX_WEIGHTED_ARCHS = frozenset({"gpt-oss"})  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT


@dataclass(frozen=True)
class TrimRule:
    below: float = 0.0  # skip a miss whose share of its token's routing weight is below this (0: never)
    cumulative: float = 1.0  # skip a miss past the token's experts whose shares reach this (1: never)

    @property
    def on(self) -> bool:
        return self.below > 0.0 or self.cumulative < 1.0

    def label(self) -> str:
        """What the status bar says while it is on: "trim <5%", "trim >70%", "trim <5% >70%"."""
        parts = []
        if self.below > 0.0:
            parts.append(f"<{self.below * 100:.3g}%")
        if self.cumulative < 1.0:
            parts.append(f">{self.cumulative * 100:.3g}%")
        return "trim " + " ".join(parts) if parts else ""


def shares(weights: np.ndarray, softmax: bool) -> np.ndarray:
    """Each slot's share of its token's routing weight, rows of ``weights`` (n_tokens, k). A row
    whose weights do not sum above 0 gets NaN shares (nothing of it is skipped)."""
    w = weights.astype(np.float64)
    if softmax:
        w = np.exp(w - w.max(axis=1, keepdims=True))
    total = w.sum(axis=1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total > 0, w / np.where(total > 0, total, 1.0), np.nan)


def choose_skips(token_shares: np.ndarray, resident: np.ndarray, rule: TrimRule) -> np.ndarray:
    """Which slots to skip (bool, the shape of ``token_shares``): misses below the rule's share,
    or past its cumulative share; never a token's first choice, never a resident expert."""
    n_tokens, k = token_shares.shape
    order = np.argsort(-np.nan_to_num(token_shares, nan=0.0), axis=1, kind="stable")
    ranked = np.take_along_axis(token_shares, order, axis=1)
    before = np.cumsum(ranked, axis=1) - ranked  # the shares ranked above each slot
    past = np.zeros_like(resident)
    np.put_along_axis(past, order, before >= rule.cumulative - 1e-9, axis=1)
    first = np.zeros_like(resident)
    first[np.arange(n_tokens), order[:, 0]] = True
    low = token_shares < rule.below  # NaN compares False
    valid = ~np.isnan(token_shares).any(axis=1, keepdims=True)
    return valid & ~resident & ~first & (low | (past & (rule.cumulative < 1.0)))


def row_skips(weights: list[float], resident: list[bool], rule: TrimRule, softmax: bool) -> list[bool]:
    """``choose_skips`` for one token, in plain Python: a decoded token's routing is a row of k
    (8 or 16), where numpy's per-call cost is most of the work and a model has 60-90 MoE layers."""
    if softmax:
        top = max(weights)
        weights = [math.exp(w - top) for w in weights]
    total = sum(weights)
    if not total > 0:
        return [False] * len(weights)
    token_shares = [w / total for w in weights]
    order = sorted(range(len(token_shares)), key=lambda i: -token_shares[i])
    skips = [False] * len(token_shares)
    before = 0.0
    for rank, i in enumerate(order):
        past = rule.cumulative < 1.0 and before >= rule.cumulative - 1e-9
        skips[i] = rank > 0 and not resident[i] and (token_shares[i] < rule.below or past)
        before += token_shares[i]
    return skips


def _view(tensor: int, data: int, rows_at: int, slots_at: int, dtype) -> np.ndarray:
    """A (n_tokens, k) view of a routing tensor's data, with ggml's own strides: dimension
    ``slots_at`` holds a token's k slots, dimension ``rows_at`` its tokens."""
    ne = (ctypes.c_int64 * 4).from_address(tensor + GGML_NE_OFFSET)
    nb = (ctypes.c_size_t * 4).from_address(tensor + GGML_NB_OFFSET)
    shape, strides = (ne[rows_at], ne[slots_at]), (nb[rows_at], nb[slots_at])
    if 0 in shape:
        return np.zeros(shape, dtype)
    span = (shape[0] - 1) * strides[0] + (shape[1] - 1) * strides[1] + np.dtype(dtype).itemsize
    return np.ndarray(shape, dtype, buffer=(ctypes.c_char * span).from_address(data), strides=strides)


@dataclass
class RouteTrimmer:
    """Applies a rule to each MoE layer's routing as the graph computes; counts what it skipped."""

    rule: TrimRule
    softmax_weighted: bool = False  # the weights go through a softmax after they are gathered (gpt-oss)
    routes: int = 0  # (token, slot) routes seen
    routes_skipped: int = 0
    experts_skipped: int = 0  # distinct experts a layer's micro-batch no longer reads

    def trim(self, ids: np.ndarray, weights: np.ndarray, resident: Callable[[list[int]], list[bool]]) -> set[int]:
        """Rewrite ``ids`` (int32) and ``weights`` (float32), both (n_tokens, k) views of the
        graph's tensors; ``resident(experts)`` says which of those expert ids are in memory.
        Returns the experts still routed to."""
        if ids.size == 0:
            return set()
        if ids.shape[0] == 1:
            return self._trim_one(ids, weights, resident)
        picked = np.unique(ids)
        if picked[0] < 0:  # not expert ids: left to the streamer's check, which stops the token
            return set(picked.tolist())
        in_memory = np.zeros(int(picked.max()) + 1, dtype=bool)
        in_memory[picked] = resident(picked.tolist())
        skip = choose_skips(shares(weights, self.softmax_weighted), in_memory[ids], self.rule)
        # An expert another token of the micro-batch keeps is read anyway: skipping it saves nothing.
        skip &= ~np.isin(ids, ids[~skip])
        self.routes += ids.size
        if skip.any():
            token_first = ids[np.arange(ids.shape[0]), np.argmax(weights, axis=1)]
            ids[skip] = np.broadcast_to(token_first[:, None], ids.shape)[skip]
            weights[skip] = -np.inf if self.softmax_weighted else 0.0
            self.routes_skipped += int(skip.sum())
        kept = np.unique(ids)
        self.experts_skipped += len(picked) - len(kept)
        return set(kept.tolist())

    def _trim_one(self, ids: np.ndarray, weights: np.ndarray, resident: Callable[[list[int]], list[bool]]) -> set[int]:
        """``trim`` for a micro-batch of one token (each decoded token)."""
        row, gathered = ids[0].tolist(), weights[0].tolist()
        if min(row) < 0:  # not expert ids: left to the streamer's check, which stops the token
            return set(row)
        self.routes += len(row)
        skips = row_skips(gathered, resident(row), self.rule, self.softmax_weighted)
        if any(skips):
            first = row[max(range(len(row)), key=gathered.__getitem__)]
            for slot, skip in enumerate(skips):
                if skip:
                    ids[0, slot] = first
                    weights[0, slot] = -np.inf if self.softmax_weighted else 0.0
            self.routes_skipped += sum(skips)
        kept = {e for e, skip in zip(row, skips) if not skip}
        self.experts_skipped += len(set(row)) - len(kept)
        return kept


def routing_views(ggml, ids_tensor: int, weights_tensor: int) -> tuple[np.ndarray, np.ndarray]:
    """Writable (n_tokens, k) views of a layer's routing in the graph: ``ffn_moe_topk-L``
    (int32, ne [k, n_tokens], a view into the argsort's rows) and ``ffn_moe_weights-L``
    (float32, ne [1, k, n_tokens])."""
    ids = _view(ids_tensor, ggml.ggml_get_data(ids_tensor), 1, 0, np.int32)
    weights = _view(weights_tensor, ggml.ggml_get_data(weights_tensor), 2, 1, np.float32)
    return ids, weights
