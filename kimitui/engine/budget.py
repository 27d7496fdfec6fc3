"""How a memory budget is spent, decided before llama.cpp is called.

The budget is the promise about the model: its resident pages (pinned, streamed, cached
experts; file-backed and anonymous alike) stay within it. llama.cpp's own working memory (KV
cache, recurrent state, compute buffers) and the interpreter live beside it, and must fit what
the process may use next to the budget: the context length is chosen for that.

An MoE model's budget, in order of bytes saved per byte spent:
1. the non-layer tensors (every token reads them, and the streamer never does);
2. the expert cache's floor: the routed experts one token uses in one layer;
3. the trunk window for the layer computing (the largest trunk still streamed);
4. pinned trunk, layer by layer (a pinned trunk byte saves a read every token);
5. one layer of read-ahead, if it fits (it hides reads behind compute, saves none; deeper
   read-ahead is left to dense models, which have no expert cache to feed);
6. what is left caches experts (a cached expert byte saves n_used/n_expert of a read per token
   under flat routing, more under skew); half of it may pin the experts past runs used most.
Prefill: a micro-batch whose union of experts does not fit is computed one routed matrix at a
time (experts.py), so it is cut only to what one matrix of each expert it routes to fits (all
of a prompt's batch when one matrix of every expert of a layer fits). Where it is cut, each
chunk reads the streamed trunk again, so pinned trunk is given back to the expert cache while
that lowers the bytes of a turn (an n_batch-token prompt and as many tokens of reply).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import os

from kimitui.engine.kv_cache import PLAIN, head_sizes
from kimitui.engine.state import EngineError
from kimitui.model.gguf_map import ROUTED_EXPERTS, ModelMap, Shard
from kimitui.units import format_bytes

# Partial pages at the ends of streamed ranges stay file-backed, and a page fault maps the
# cached neighbours of a faulted page (fault-around, 64 KiB): room for those, not for weights.
SLACK_BYTES = 16 * 2**20
PAGE = os.sysconf("SC_PAGE_SIZE")
PIECE_BYTES = 4 * 2**20  # one direct-read buffer (direct.py); pieces start on its multiples in the file


def pool_buffers(window_bytes: int, shards_per_layer: int, layers: int) -> int:
    """Direct-read buffers a window of ``window_bytes`` over ``layers`` layers may hold
    (direct.py): a shard's pieces start on PIECE_BYTES multiples of the file, so each shard in
    flight may take one buffer more than its bytes say. Free buffers keep their pages for the
    next read (faulting 4 MiB in anew each time cost a fifth of a dense model's decode), so the
    pool's memory is all of them, and the plan counts it so."""
    if window_bytes <= 0:
        return 0
    return -(-window_bytes // PIECE_BYTES) + shards_per_layer * layers


@dataclass(frozen=True)
class MemoryPlan:
    budget: int
    pinned: tuple[Shard, ...]  # whole shards pinned (non-layer tensors and trunk)
    window_bytes: int  # trunk bytes streamed in flight at most (computing layer and read-ahead)
    pool_buffers: int  # of the direct-read buffers that window may take (pool_buffers), those the budget holds
    prefetch_depth: int  # layers read ahead; the configured depth or less, so the window fits
    expert_bytes: int  # routed experts resident at most (the cache, with any hot pinned ones)
    hot_expert_bytes: int  # of expert_bytes: at most this much may pin past runs' hot experts
    ubatch: int  # prefill tokens computed at once

    @property
    def pinned_bytes(self) -> int:
        return sum(s.length for s in self.pinned)


def trunk_bytes(model: ModelMap, layer: int) -> int:
    info = model.layers[layer]
    return info.trunk_bytes if info.is_moe else info.n_bytes


def _slice_pages(length: int) -> int:
    """The memory a slice of ``length`` bytes takes at most: ceil(n / page) + 1 pages, wherever it starts."""
    return (-(-length // PAGE) + 1) * PAGE


def _moe_layers(model: ModelMap) -> list[int]:
    return [i for i, info in enumerate(model.layers) if info.is_moe]


def expert_footprint(model: ModelMap) -> int:
    """The memory one resident expert takes at most, in its widest layer (published sets mix
    types layer by layer): its slices rounded out to whole pages."""
    return max((sum(_slice_pages(r.length) for r in model.expert_ranges(i, 0)) for i in _moe_layers(model)), default=0)


def stages_by_matrix(model: ModelMap) -> bool:
    """Whether a micro-batch's experts can be computed one routed matrix at a time (experts.py):
    each routed tensor is a weight the matmul node names as its first source. A routed bias
    reaches ggml through another node's second source, so such models keep whole experts."""
    return all(
        t.name.endswith(".weight") for i in _moe_layers(model) for t in model.layer_tensors(i) if t.role == ROUTED_EXPERTS
    )


def matrix_footprint(model: ModelMap) -> int:
    """The memory one routed matrix (gate, up or down) of one expert takes at most: what a
    staged micro-batch holds per expert at a time (experts.py); a whole expert where the model
    cannot be staged."""
    if not stages_by_matrix(model):
        return expert_footprint(model)
    return max((_slice_pages(r.length) for i in _moe_layers(model) for r in model.expert_ranges(i, 0)), default=0)


def expert_floor(model: ModelMap) -> int:
    """The routed experts one token needs in one layer: the cache can never be smaller."""
    return model.n_expert_used * expert_footprint(model) if model.is_moe else 0


def most_trunk_shards(model: ModelMap) -> int:
    """The most trunk shards one layer has: how many pieces of a layer may start mid-buffer."""
    per_layer = [0] * model.n_layers
    for shard in model.shards:
        if shard.layer is not None and not shard.routed:
            per_layer[shard.layer] += 1
    return max(per_layer, default=0)


def minimum_budget(model: ModelMap) -> int:
    """Non-layer tensors, the largest trunk, and the experts one token uses in a layer."""
    largest = max((trunk_bytes(model, i) for i in range(model.n_layers)), default=0)
    return model.nonlayer_bytes + largest + expert_floor(model) + SLACK_BYTES


def budget_shortfall(model: ModelMap, budget: int) -> str | None:
    """Why ``budget`` cannot run ``model``, in one line; None when it can."""
    needed = minimum_budget(model)
    if budget >= needed:
        return None
    what = "the largest trunk and the routed experts one token uses in a layer" if model.is_moe else "its largest layer"
    return (
        f"budget {format_bytes(budget)} is below the minimum working set of {model.files[0].name}: "
        f"{format_bytes(needed)} (non-layer tensors, {what}, {format_bytes(SLACK_BYTES)} of page slack)"
    )


def _trunk_shards(model: ModelMap) -> list[Shard]:
    """Trunk shards in pinning order: non-layer tensors, then layer by layer."""
    return sorted(
        (s for s in model.shards if not s.routed),
        key=lambda s: (-1 if s.layer is None else s.layer, s.file, s.offset),
    )


def plan_memory(model: ModelMap, budget: int, prefetch_depth: int, n_batch: int) -> MemoryPlan:
    """Spend ``budget`` on ``model`` as the module says; ``budget`` is at least the minimum.

    One function: its steps share one set of sums (the room left, the expert floor, the
    trunk in pinning order) and read in the order the module's docstring gives them."""
    room = max(0, budget - SLACK_BYTES)
    shards = _trunk_shards(model)
    nonlayer = [s for s in shards if s.layer is None]
    layered = [s for s in shards if s.layer is not None]
    floor = expert_floor(model)
    matrix = matrix_footprint(model)
    left = room - sum(s.length for s in nonlayer) - floor
    most_shards = most_trunk_shards(model)

    def window(pinned_by_layer: dict[int, int], depth: int) -> int:
        """The largest trunk still streamed (what is not pinned of it), times the layers in flight."""
        streamed = [trunk_bytes(model, i) - pinned_by_layer.get(i, 0) for i in range(model.n_layers)]
        return max(streamed, default=0) * (depth + 1)

    def footprint(pinned_by_layer: dict[int, int], depth: int) -> int:
        """What streaming that window takes in memory: the direct-read pool that holds it."""
        return pool_buffers(window(pinned_by_layer, depth), most_shards, depth + 1) * PIECE_BYTES

    def by_layer(chosen: list[Shard]) -> dict[int, int]:
        pinned: dict[int, int] = {}
        for shard in chosen:
            pinned[shard.layer] = pinned.get(shard.layer, 0) + shard.length
        return pinned

    def pin_trunk(depth: int) -> list[Shard]:
        """Trunk shards in order, while the pool for what still streams fits beside them."""
        pinned: dict[int, int] = {}
        spent, chosen = 0, []
        for shard in layered:
            after = dict(pinned)
            after[shard.layer] = after.get(shard.layer, 0) + shard.length
            if spent + shard.length + footprint(after, depth) > left:
                break
            chosen.append(shard)
            spent += shard.length
            pinned = after
        return chosen

    def moe_depth(chosen: list[Shard]) -> int:
        """One layer of read-ahead if what is left beside ``chosen`` holds it."""
        fits = sum(s.length for s in chosen) + footprint(by_layer(chosen), 1) <= left
        return 1 if prefetch_depth >= 1 and fits else 0

    if model.is_moe:
        # A pinned trunk byte saves a read every token; read-ahead only hides reads behind
        # compute. So the trunk is pinned first, beside a window of the layer computing; one
        # layer of read-ahead if what is left holds it; the rest caches experts.
        chosen = pin_trunk(0)
        depth = moe_depth(chosen)
    else:
        # Dense: the deepest read-ahead that fits with nothing pinned, then the trunk beside it.
        depth = prefetch_depth
        while depth > 0 and footprint({}, depth) > left:
            depth -= 1
        chosen = pin_trunk(depth)

    def finish(chosen: list[Shard], depth: int) -> MemoryPlan:
        """The plan with ``chosen`` pinned beside the non-layer tensors, the rest as laid out above."""
        spent = sum(s.length for s in chosen)
        win = window(by_layer(chosen), depth)
        # Near the minimum budget the whole pool may not fit: ``pool_buffers`` is then what does, and
        # the pool may pass it by the rest (at most a buffer per shard of the layers in flight).
        buffers = min(pool_buffers(win, most_shards, depth + 1), max(0, (left - spent) // PIECE_BYTES))
        experts = 0
        if model.is_moe:
            experts = max(0, left - spent - max(win, buffers * PIECE_BYTES)) + floor
        cache_floor = experts - (experts - floor) // 2  # what stays a cache if half pins hot experts
        ubatch = n_batch
        if model.is_moe and model.bytes_per_expert:
            # A micro-batch whose experts do not fit whole is computed one matrix at a time, so it
            # needs room for one matrix of each expert it routes to: where even one matrix of every
            # expert of a layer does not fit, as many tokens as surely fit.
            matrices = cache_floor // matrix
            if matrices < model.n_expert:
                ubatch = max(1, min(n_batch, matrices // model.n_expert_used))
        return MemoryPlan(
            budget=budget,
            pinned=tuple(nonlayer + chosen),
            window_bytes=win,
            pool_buffers=buffers,
            prefetch_depth=depth,
            expert_bytes=experts,
            hot_expert_bytes=(experts - floor) // 2,
            ubatch=ubatch,
        )

    plan = finish(chosen, depth)
    if model.is_moe and plan.ubatch < n_batch:
        # Prompts are cut into chunks, and each chunk reads the streamed trunk again: pinned trunk
        # given back to the expert cache makes chunks larger. The plan keeps what costs the fewest
        # bytes over a turn of an n_batch-token prompt and as many tokens of reply.
        candidates = [plan] + [finish(chosen[:k], moe_depth(chosen[:k])) for k in range(len(chosen) - 1, -1, -1)]
        plan = min(candidates, key=lambda p: turn_bytes(model, p, n_batch))
    return plan


def prompt_chunks(n_prompt: int, n_batch: int, n_ubatch: int) -> list[int]:
    """The micro-batches llama.cpp evaluates an ``n_prompt``-token prompt in: llama-cpp-python
    hands it over ``n_batch`` tokens at a time, and llama_decode splits each into ``n_ubatch``."""
    chunks = []
    for start in range(0, n_prompt, n_batch):
        batch = min(n_batch, n_prompt - start)
        chunks += [n_ubatch] * (batch // n_ubatch) + ([batch % n_ubatch] if batch % n_ubatch else [])
    return chunks


def prompt_bytes(model: ModelMap, plan: MemoryPlan, n_prompt: int, n_batch: int) -> int:
    """What an ``n_prompt``-token prompt reads under ``plan`` at flat routing: the streamed trunk
    once per chunk, and each chunk's distinct experts once (a chunk of c tokens routes to
    n_expert x (1 - (1 - n_used / n_expert)^c) of a layer's experts; real text shares more)."""
    return _prompt_bytes(model, plan_reads(model, plan)["trunk_bytes_per_token"], plan.ubatch, n_prompt, n_batch)


def _prompt_bytes(model: ModelMap, trunk: int, ubatch: int, n_prompt: int, n_batch: int) -> int:
    moe = [model.layers[i] for i in _moe_layers(model)]
    total = 0
    for chunk, count in Counter(prompt_chunks(n_prompt, n_batch, ubatch)).items():
        experts = sum(layer.n_expert * (1 - (1 - model.n_expert_used / layer.n_expert) ** chunk) * layer.expert_bytes for layer in moe)
        total += count * (trunk + int(experts))
    return total


def turn_bytes(model: ModelMap, plan: MemoryPlan, n_tokens: int) -> int:
    """An ``n_tokens`` prompt and as many decoded tokens: what the plan weighs pinning against."""
    reads = plan_reads(model, plan)
    trunk = reads["trunk_bytes_per_token"]
    return _prompt_bytes(model, trunk, plan.ubatch, n_tokens, n_tokens) + n_tokens * (trunk + reads["expert_bytes_per_token"])


def context_bytes(kv: dict, arch: str, n_ctx: int, value_bytes: float = PLAIN.value_bytes) -> int:
    """llama.cpp's KV cache (``value_bytes`` a value: kv_cache.KVCache) and recurrent state (f32)
    for ``n_ctx`` cells, from the GGUF's keys (``kv``: key -> value), as llama.cpp sizes them
    (checked against its own log lines)."""

    def get(key: str, default=None):
        return kv.get(f"{arch}.{key}", default)

    n_layer = int(get("block_count", 0))
    n_head = int(get("attention.head_count", 0) or 0)
    heads_kv = get("attention.head_count_kv", n_head)
    per_layer_kv = list(heads_kv) if isinstance(heads_kv, (list, tuple)) else [heads_kv] * n_layer
    k_len, v_len = head_sizes(kv, arch)
    mla = get("attention.kv_lora_rank") is not None  # absorbed MLA caches K only; V is a view of it
    total = 0
    kda_dim = get("kda.head_dim")
    for n_kv in per_layer_kv:
        n_kv = int(n_kv)
        if n_kv == 0 and kda_dim is not None:  # a KDA layer: conv state and the recurrent matrix
            d_inner = int(kda_dim) * n_head
            conv = (int(get("ssm.conv_kernel", 4)) - 1) * d_inner * 3
            total += 4 * (conv + int(kda_dim) ** 2 * n_head)
            continue
        width = n_kv * k_len + (0 if mla else n_kv * v_len)
        total += int(value_bytes * width * n_ctx)
    return total


# llama.cpp's buffers for one micro-batch, per token in it: logits over the vocabulary, the
# attention scores of each head over the context, a few activations (4 bytes each); the margin
# covers what the formula leaves out (measured against llama.cpp's own log: within 10%).
COMPUTE_MARGIN = 1.15
# What the process may still grow by beside llama.cpp and the weights (the UI, threads): the
# memory available is measured with the interpreter already in it.
PROCESS_RESERVE = 32 * 2**20
MIN_CTX = 256


def working_estimate(model: ModelMap, n_ctx: int, n_ubatch: int, slots: int = 1, snapshots: int = 0,
                     value_bytes: float = PLAIN.value_bytes) -> int:
    """llama.cpp's working memory for a context of ``n_ctx`` tokens: cache, state, buffers. With
    several slots llama.cpp's context is one slot's share, and beside it the slots' prompts are
    parked (each up to that share, with a recurrent state of its own; all of them at once while
    one is being swapped for another). ``snapshots``: copies of the recurrent state llama.cpp
    keeps so that rejected drafts can be taken back (``n_rs_seq``, speculation.py).
    ``value_bytes``: what a cached key or value takes (context_bytes)."""
    arch = model.architecture
    kv = model.hparams
    n_vocab = int(kv.get(f"{arch}.vocab_size") or 0) or 32000
    n_embd = int(kv.get(f"{arch}.embedding_length") or 0)
    n_head = int(kv.get(f"{arch}.attention.head_count") or 1)
    live = n_ctx // slots
    tokens = min(n_ubatch, live)
    compute = 4 * tokens * (n_vocab + n_head * live + 8 * n_embd)
    cache = context_bytes(kv, arch, live, value_bytes)
    parked = slots * cache if slots > 1 else 0
    rollback = snapshots * state_copy_bytes(model)
    return cache + parked + rollback + int(compute * COMPUTE_MARGIN)


# The smallest prefill micro-batch a context is fitted with before the context itself shrinks
# (the chunk colibri evaluates Kimi K3's prompts in).
MIN_UBATCH = 32


def state_copy_bytes(model: ModelMap) -> int:
    """One copy of the recurrent state (K3's KDA; 0 for a model without one): a context of no
    cells, which llama.cpp keeps per draft a pass may carry (``n_rs_seq``)."""
    return context_bytes(model.hparams, model.architecture, 0)


def _fits(model: ModelMap, weights: int, room: int, n_ctx: int, n_ubatch: int, slots: int, snapshots: int,
          value_bytes: float) -> bool:
    return weights + working_estimate(model, n_ctx, n_ubatch, slots, snapshots, value_bytes) + PROCESS_RESERVE <= room


def context_fits(model: ModelMap, weights: int, room: int, n_ctx: int, n_ubatch: int, slots: int = 1, snapshots: int = 0,
                 value_bytes: float = PLAIN.value_bytes) -> int | None:
    """The largest context up to ``n_ctx`` (halving, down to MIN_CTX) whose working memory fits
    ``room`` beside ``weights`` bytes of model pages; None when not even the smallest does."""
    ctx = n_ctx
    while True:
        if _fits(model, weights, room, ctx, n_ubatch, slots, snapshots, value_bytes):
            return ctx
        if ctx <= MIN_CTX:
            return None
        ctx = max(MIN_CTX, ctx // 2)


def fit_context(model: ModelMap, weights: int, room: int, n_ctx: int, n_ubatch: int, slots: int, *,
                fixed: bool, snapshots: int = 0, value_bytes: float = PLAIN.value_bytes) -> tuple[int, int | None, str | None]:
    """The context that fits ``room`` beside ``weights`` bytes of model pages: (n_ctx, a smaller
    micro-batch that lets all of ``n_ctx`` fit or None, the note saying n_ctx shrank or None).
    The largest context up to the configured one, or, where the user chose it (``fixed``) or
    not even the smallest fits, EngineError saying what to lower. Without it a context too big
    is an OOM kill once the KV cache fills."""
    fitted = context_fits(model, weights, room, n_ctx, n_ubatch, slots, snapshots, value_bytes)
    # A large micro-batch's compute buffers grow with the context: smaller micro-batches (each
    # reads the streamed trunk again) are tried before a smaller context.
    ubatch = n_ubatch
    while fitted != n_ctx and ubatch > MIN_UBATCH:
        ubatch = max(MIN_UBATCH, ubatch // 2)
        if context_fits(model, weights, room, n_ctx, ubatch, slots, snapshots, value_bytes) == n_ctx:
            return n_ctx, ubatch, None
    if fitted == n_ctx:
        return n_ctx, None, None
    if fitted is None or fixed:
        need = working_estimate(model, n_ctx, n_ubatch, slots, snapshots, value_bytes)
        lower = "--budget" if fitted is None else f"--n-ctx (to {fitted} at most) or --budget"
        copies = snapshots * state_copy_bytes(model)
        without = n_ctx if fixed else MIN_CTX  # the context that would then fit
        if copies and context_fits(model, weights, room, without, min(n_ubatch, MIN_UBATCH), slots, 0, value_bytes) == without:
            lower += f", or set engine.speculate off (the recurrent state's {snapshots} copies kept for drafts: {format_bytes(copies)})"
        raise EngineError(
            f"context of {n_ctx} tokens needs {format_bytes(need)} of KV cache and buffers beside the "
            f"{format_bytes(weights)} of weights, but {format_bytes(room)} is available (cgroup limits included): lower {lower}"
        )
    return fitted, None, f"context {fitted} tokens instead of {n_ctx}: the KV cache for more would not fit beside the budget"


def drafts_that_fit(model: ModelMap, weights: int, room: int, n_ctx: int, n_ubatch: int, slots: int, asked: int,
                    value_bytes: float = PLAIN.value_bytes) -> int:
    """How many of the ``asked`` copies of the recurrent state llama.cpp keeps for drafts (one
    per draft a pass may carry, K3's KDA) fit beside ``weights`` with the whole ``n_ctx``: the
    most at the planned micro-batch, else at the smallest one; ``asked`` where they all fit,
    where a copy costs nothing (no recurrent state), or where not even one fits (the context
    then shrinks, fit_context)."""
    if not state_copy_bytes(model):
        return asked
    for ubatch in dict.fromkeys((n_ubatch, min(n_ubatch, MIN_UBATCH))):
        for n in range(asked, 0, -1):
            if _fits(model, weights, room, n_ctx, ubatch, slots, n, value_bytes):
                return n
    return asked


def budget_overflow(model: ModelMap, budget: int, room: int, n_ctx: int, n_ubatch: int, slots: int,
                    snapshots: int = 0, value_bytes: float = PLAIN.value_bytes) -> str | None:
    """Why ``budget`` would not fit beside llama.cpp's context in ``room`` (the check the load
    makes, ``fit_context``), or None."""
    weights = min(budget, model.tensor_bytes)
    working = working_estimate(model, n_ctx, n_ubatch, slots, snapshots, value_bytes)
    if weights + working + PROCESS_RESERVE <= room:
        return None
    most = max(0, room - working - PROCESS_RESERVE)
    return (
        f"budget {format_bytes(budget)} does not fit: with the context's {format_bytes(working)} of KV cache and buffers "
        f"it needs {format_bytes(weights + working + PROCESS_RESERVE)}, and this process may use {format_bytes(room)} "
        f"(cgroup limits included): at most {format_bytes(most)}"
    )


def plan_reads(model: ModelMap, plan: MemoryPlan) -> dict:
    """What a token reads from storage under ``plan``: the trunk not pinned (each token walks all
    of it; an embedding row if the table is not pinned) and the routed experts that miss the
    cache, at flat routing (Kimi K3's router was trained for it: a cached expert is hit at
    n_used / n_expert per layer and token, whatever the policy)."""
    pinned = {s.index for s in plan.pinned}
    trunk = 0
    for shard in model.shards:
        if shard.routed or shard.index in pinned:
            continue
        if shard.layer is None:
            continue  # non-layer tensors are always pinned (minimum_budget has room for them)
        trunk += shard.length
    moe_layers = [layer for layer in model.layers if layer.is_moe]
    total_experts = sum(layer.n_expert for layer in moe_layers)
    cached = plan.expert_bytes // expert_footprint(model) if model.bytes_per_expert else 0
    hit = min(1.0, cached / total_experts) if total_experts else 0.0
    experts = sum(model.n_expert_used * layer.expert_bytes for layer in moe_layers) * (1 - hit)
    return {
        "trunk_bytes_per_token": trunk,
        "expert_bytes_per_token": int(experts),
        "cached_experts": cached,
        "flat_hit_rate": hit,
    }
