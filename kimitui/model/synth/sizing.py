"""Shaping a synthetic model: the widths and depth that land its file on a target size with
a realistic shape, or Kimi's counts at its widths times a scale, or a slice of them."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Iterator

from kimitui.errors import UserError
from kimitui.model.synth.archs import (
    DEFAULT_QUANT,
    K3_LAYOUTS,
    K3_TRUNK_QUANT,
    LIKE,
    QUANTS,
    Deepseek2Dims,
    KimiK3Dims,
    LlamaDims,
    deepseek2_spec,
    kimi_k3_spec,
    llama_spec,
)
from kimitui.model.synth.spec import IQ_TYPES, ModelSpec, Tokenizer
from kimitui.units import format_bytes

# Generic MoE: DeepSeek-V2-Lite / Moonlight expert counts (64 routed, 6 used, 2 shared).
GENERIC_MOE = dict(n_expert=64, n_expert_used=6, n_expert_shared=2, n_dense_lead=1, expert_weights_scale=2.5)
LLAMA_FF_RATIO = 8 / 3  # SwiGLU keeps the FFN's parameters at 4x n_embd wide: n_ff ~ 8/3 n_embd
# llama.cpp takes a deepseek2 model of 26 or 27 layers for a "lite" one without q_lora.
DEEPSEEK2_LITE_LAYERS = {26, 27}
SIZE_TOLERANCE = 0.05  # the file lands within 5% of --size, within 1% unless widths are tiny
SIZE_WEIGHT = 50.0  # 1% off the size weighs like a shape ratio off by a factor 1.65


def _round(x: float, multiple: int, minimum: int | None = None) -> int:
    value = max(multiple, int(round(x / multiple)) * multiple)
    return max(value, minimum) if minimum is not None else value


def _ideal_layers(n_embd: int) -> float:
    # Llama 3 8B 4096/32, 405B 16384/126; small models still get enough layers to stream.
    return max(8.0, n_embd / 128)


def _layer_options(n_embd: int, exclude: frozenset[int] = frozenset()) -> list[tuple[int, float]]:
    """(layer count, shape penalty) near the ideal depth for this width."""
    ideal = _ideal_layers(n_embd)
    counts = {max(2, round(ideal * f)) for f in (0.8, 1.0, 1.25)} - exclude
    return [(n, abs(math.log(n / ideal))) for n in sorted(counts)]


def _widths(start: int, fine: int) -> Iterator[int]:
    """Candidate n_embd from `start`, in steps of `fine` (doubling at 2048 and 8192, where
    one step changes the size less)."""
    n = start
    while n <= 65536:
        yield n
        n += fine if n < 2048 else 2 * fine if n < 8192 else 4 * fine


def _search(target: int, what: str, widths: Iterator[int], layers_for, spec_for, free_range, unit: int) -> ModelSpec:
    """The best spec for `target` bytes: realistic shape, size within SIZE_TOLERANCE.

    For each width (ascending) and layer count, the remaining free width (an FFN, a
    multiple of `unit`) is solved for: the file size is linear in it, so two probes find
    it. `free_range(n_embd)` gives (lo, hi, ideal) for it. Score: the free width's and the
    depth's log distance from ideal, plus SIZE_WEIGHT per unit of relative size error, so a
    coarse grid (tiny widths of many experts) trades a little size for a sane shape.
    Stops once even the narrowest shape of a width is too big."""
    best: tuple[float, float, ModelSpec] | None = None
    for n_embd in widths:
        lo, hi, ideal = free_range(n_embd)
        any_fit = False
        for n_layer, penalty in layers_for(n_embd):
            s_lo = spec_for(n_embd, n_layer, lo).file_bytes()
            any_fit = any_fit or s_lo <= target * (1 + SIZE_TOLERANCE)
            s_hi = spec_for(n_embd, n_layer, hi).file_bytes()
            steps = (hi - lo) // unit
            guess = round((target - s_lo) / (s_hi - s_lo) * steps) if s_hi > s_lo else 0
            guess = max(0, min(steps, guess))
            for step in {max(0, guess - 1), guess, min(steps, guess + 1)}:
                free = lo + step * unit
                spec = spec_for(n_embd, n_layer, free)
                error = abs(spec.file_bytes() - target) / target
                score = abs(math.log(free / ideal)) + penalty + SIZE_WEIGHT * error
                if error <= SIZE_TOLERANCE and (best is None or score < best[0]):
                    best = (score, error, spec)
        if not any_fit:
            break
    if best is None:
        raise UserError(f"cannot shape a {what} model of {format_bytes(target)} within {SIZE_TOLERANCE:.0%}")
    return best[2]


def plan_dense(target: int, quant: str, tok: Tokenizer) -> ModelSpec:
    qtype, ftype = QUANTS[quant]

    def spec_for(n_embd: int, n_layer: int, n_ff: int) -> ModelSpec:
        n_head = n_embd // (64 if n_embd < 2048 else 128)
        # grouped-query attention as Llama 3 (4 query heads per kv head) where heads allow
        n_head_kv = n_head // 4 if n_head % 4 == 0 else n_head // 2 if n_head % 2 == 0 else n_head
        return llama_spec(LlamaDims(n_embd, n_ff, n_layer, n_head, n_head_kv), qtype, ftype, tok)

    def free_range(n_embd: int) -> tuple[int, int, float]:
        return _round(2 * n_embd, 64), _round(4 * n_embd, 64), LLAMA_FF_RATIO * n_embd

    return _search(target, "dense", _widths(256, 128), _layer_options, spec_for, free_range, 64)


def plan_moe(target: int, quant: str, tok: Tokenizer) -> ModelSpec:
    qtype, ftype = QUANTS[quant]

    def spec_for(n_embd: int, n_layer: int, n_ff_exp: int) -> ModelSpec:
        dims = Deepseek2Dims(
            n_embd=n_embd, n_layer=n_layer, n_head=max(1, n_embd // 128),
            q_lora=_round(n_embd * 1536 / 7168, 32), kv_lora=_round(n_embd * 512 / 7168, 32),
            n_ff=_round(LLAMA_FF_RATIO * n_embd, 64), n_ff_exp=n_ff_exp, **GENERIC_MOE,
        )
        return deepseek2_spec(dims, qtype, ftype, tok)

    def free_range(n_embd: int) -> tuple[int, int, float]:
        # expert width ~3/8 of n_embd as Qwen3-30B-A3B; DeepSeek-V3 0.29, V2-Lite 0.69
        return _round(n_embd / 8, 32), _round(n_embd, 32), 0.375 * n_embd

    def layers_for(n_embd: int) -> list[tuple[int, float]]:
        return _layer_options(n_embd, DEEPSEEK2_LITE_LAYERS)

    return _search(target, "MoE", _widths(256, 64), layers_for, spec_for, free_range, 32)


def _scaled(ref: dict, scale: float, n_ff_exp: int | None, counts: dict) -> dict:
    """`ref`'s widths times `scale` (head widths stay, head counts shrink); `counts` as given."""
    out = dict(
        n_embd=_round(ref["n_embd"] * scale, 32, 64),
        n_head=max(1, round(ref["n_head"] * scale)),
        q_lora=_round(ref["q_lora"] * scale, 32),
        kv_lora=_round(ref["kv_lora"] * scale, 32),
        n_ff=_round(ref["n_ff"] * scale, 32),
        n_ff_exp=n_ff_exp if n_ff_exp is not None else _round(ref["n_ff_exp"] * scale, 32),
        **counts,
    )
    if "n_latent" in ref:
        out["n_latent"] = _round(ref["n_latent"] * scale, 32)
    return out


@dataclass(frozen=True)
class Cut:
    """A slice of the real model: its widths (so reads have their real sizes), fewer of
    its layers and experts. None keeps the real count."""

    layers: int | None = None
    experts: int | None = None

    def counts(self, ref: dict) -> dict:
        n_layer = self.layers or ref["n_layer"]
        n_expert = self.experts or ref["n_expert"]
        return dict(
            n_layer=n_layer,
            n_expert=n_expert,
            n_expert_used=min(ref["n_expert_used"], n_expert),
            n_expert_shared=ref["n_expert_shared"],
            # a slice keeps the leading dense layer only while some MoE layer is left after it
            n_dense_lead=min(ref["n_dense_lead"], n_layer - 1),
            expert_weights_scale=ref["expert_weights_scale"],
        )


def like_dims(like: str, scale: float, n_ff_exp: int | None = None, cut: Cut = Cut()):
    """`like`'s counts (cut as asked) with every width multiplied by `scale`."""
    ref = LIKE[like]
    dims = _scaled(ref, scale, n_ff_exp, cut.counts(ref))
    return KimiK3Dims(**dims) if like == "kimi-k3" else Deepseek2Dims(**dims)


def like_spec(like: str, dims, quant: str | None, tok: Tokenizer, layout: str = "release") -> ModelSpec:
    if like == "kimi-k3":
        trunk, gate_up, down, ftype, _ = K3_LAYOUTS[layout]
        qtype, _ = QUANTS[quant or trunk or K3_TRUNK_QUANT]
        if gate_up in IQ_TYPES or down in IQ_TYPES:  # rows of whole 256-weight blocks
            dims = replace(dims, n_latent=_round(dims.n_latent, 256), n_ff_exp=_round(dims.n_ff_exp, 256))
        return kimi_k3_spec(dims, qtype, ftype, tok, (gate_up, down))
    qtype, ftype = QUANTS[quant or DEFAULT_QUANT]
    return deepseek2_spec(dims, qtype, ftype, tok)


def plan_like(
    like: str, target: int | None, scale: float | None, quant: str | None, tok: Tokenizer, cut: Cut = Cut(),
    layout: str = "release",
) -> ModelSpec:
    """Kimi's counts (layers, experts, used, shared, dense lead; fewer with `cut`); widths
    from `scale`, or solved so the file lands on `target`; K3 in one of its published ``layout``s."""
    ref = LIKE[like]
    if scale is not None:
        return like_spec(like, like_dims(like, scale, cut=cut), quant, tok, layout)
    assert target is not None
    n_layer = cut.layers or ref["n_layer"]

    def spec_for(n_embd: int, _n_layer: int, n_ff_exp: int) -> ModelSpec:
        return like_spec(like, like_dims(like, n_embd / ref["n_embd"], n_ff_exp, cut), quant, tok, layout)

    def free_range(n_embd: int) -> tuple[int, int, float]:
        ideal = max(32.0, n_embd * ref["n_ff_exp"] / ref["n_embd"])
        return _round(ideal / 3, 32), _round(3 * ideal, 32), ideal

    return _search(target, like, _widths(64, 32), lambda n_embd: [(n_layer, 0.0)], spec_for, free_range, 32)
