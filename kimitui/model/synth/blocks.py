"""The bytes of a synthetic model's tensors: valid quantized blocks of random weights (finite
logits), norms, routers with a hot set. Weights come from a few pools of pre-generated blocks
copied out at random offsets, so memory stays bounded and writing runs at the disk's speed,
not numpy's RNG's."""

from __future__ import annotations

import functools
import math
from typing import Iterator

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kimitui.model.synth.spec import IQ_TYPES, MXFP4, Fill, TensorSpec

POOL_BYTES = 8 * 1024**2
CHUNK_BYTES = 1024**2
# exp_probs_b = -ROUTER_SKEW * ln(rank + 1) is added to the sigmoid probabilities (spread
# ~0.2) to choose experts: a Zipf-like hot set that still varies per token. Measured in
# llama.cpp (eval callback, 106 tokens): kimi-k2-like at 100 MiB, 300 MiB and 2 GiB, the
# hottest expert of a layer serves 51-66% of tokens, the top 10% of experts take 72-81% of
# picks (Zipf s ~ 1.1); the 64-expert generic MoE 41-46% and 29-30%. Almost every token
# picks a distinct set.
ROUTER_SKEW = 0.06
# K3's router was trained for flat expert use: a skew a third of K2's keeps a mild hot set.
FLAT_ROUTER_SKEW = 0.02

_BLOCK_DTYPES = {
    GGMLQuantizationType.Q4_0: np.dtype([("d", "<f2"), ("qs", "u1", (16,))]),
    GGMLQuantizationType.Q4_1: np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", (16,))]),
    GGMLQuantizationType.Q8_0: np.dtype([("d", "<f2"), ("qs", "i1", (32,))]),
    MXFP4: np.dtype([("e", "u1"), ("qs", "u1", (16,))]),  # an E8M0 scale, 32 E2M1 codes
    GGMLQuantizationType.BF16: np.dtype("<u2"),
}
# Std of a dequantized weight per unit of the block scale d: uniform over 16 levels (4-bit)
# or over -127..127 (8-bit); MXFP4 codes are ggml's kvalues (0, ±1, ±2, ±3, ±4, ±6, ±8, ±12)
# times half the E8M0 scale.
_STD_PER_SCALE = {
    GGMLQuantizationType.Q4_0: 4.61, GGMLQuantizationType.Q4_1: 4.61, GGMLQuantizationType.Q8_0: 73.6, MXFP4: 5.85,
}


@functools.cache
def _iq_std_per_scale(qtype: GGMLQuantizationType) -> float:
    """An i-quant's grids are tables, so the std per unit of d is measured: gguf's own
    dequantization of random blocks at d = 1."""
    from gguf.quants import dequantize

    raw = np.random.default_rng(0).integers(0, 256, (256, GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)
    raw[:, :2] = np.full(256, 1.0, dtype="<f2").view(np.uint8).reshape(256, 2)
    return float(np.std(dequantize(raw.reshape(-1), qtype)))


def random_blocks(qtype: GGMLQuantizationType, n_blocks: int, sigma: float, rng: np.random.Generator) -> np.ndarray:
    """`n_blocks` valid quantized blocks whose weights have std ~`sigma`, as raw bytes."""
    if qtype == GGMLQuantizationType.BF16:  # the top half of float32
        values = rng.normal(0.0, sigma, n_blocks).astype(np.float32)
        return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    if qtype in IQ_TYPES:  # codes and signs at random, under a scale that gives the std asked for
        raw = rng.integers(0, 256, (n_blocks, GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)
        d = (sigma / _iq_std_per_scale(qtype) * rng.uniform(0.5, 1.5, n_blocks)).astype("<f2")
        raw[:, :2] = d.view(np.uint8).reshape(n_blocks, 2)
        return raw.reshape(-1)
    blocks = np.empty(n_blocks, dtype=_BLOCK_DTYPES[qtype])
    if qtype == MXFP4:
        # E8M0 holds a power of two: 2^(e-127), of which ggml takes half (2^(e-128)).
        e = 128 + np.round(np.log2(sigma / _STD_PER_SCALE[qtype])) + rng.integers(-1, 2, n_blocks)
        blocks["e"] = np.clip(e, 1, 254).astype(np.uint8)
        blocks["qs"] = rng.integers(0, 256, (n_blocks, 16), dtype=np.uint8)
        return blocks.view(np.uint8)
    d = sigma / _STD_PER_SCALE[qtype] * rng.uniform(0.5, 1.5, n_blocks)
    blocks["d"] = d.astype(np.float16)
    if qtype == GGMLQuantizationType.Q8_0:
        blocks["qs"] = rng.integers(-127, 128, (n_blocks, 32), dtype=np.int8)
    else:
        blocks["qs"] = rng.integers(0, 256, (n_blocks, 16), dtype=np.uint8)
    if qtype == GGMLQuantizationType.Q4_1:
        blocks["m"] = (-7.5 * d).astype(np.float16)  # centre the 16 levels on zero
    return blocks.view(np.uint8)


class BlockPool:
    """POOL_BYTES of random blocks of one type and scale; a tensor is written as pieces of
    it starting at random block offsets, so generation costs nothing per byte written."""

    def __init__(self, qtype: GGMLQuantizationType, sigma: float, rng: np.random.Generator):
        self.type_size = GGML_QUANT_SIZES[qtype][1]
        self.n_blocks = POOL_BYTES // self.type_size
        self.chunk_blocks = CHUNK_BYTES // self.type_size
        self.data = memoryview(random_blocks(qtype, self.n_blocks, sigma, rng))

    def pieces(self, n_bytes: int, rng: np.random.Generator) -> Iterator[memoryview]:
        left = n_bytes // self.type_size
        while left:
            take = min(left, self.chunk_blocks)
            start = int(rng.integers(0, self.n_blocks - take + 1)) * self.type_size
            yield self.data[start : start + take * self.type_size]
            left -= take


class Filler:
    """Each tensor's bytes by its fill, from one seeded generator: same seed, same bytes."""

    def __init__(self, rng: np.random.Generator):
        self.rng = rng
        self.pools: dict[tuple[GGMLQuantizationType, float], BlockPool] = {}

    def pieces(self, t: TensorSpec) -> Iterator[memoryview | bytes]:
        if t.fill in (Fill.WEIGHT, Fill.EMBED):
            # std 1/sqrt(fan-in) keeps activations O(1) through every matmul; pools are
            # shared between fan-ins within a factor sqrt(2), which bounds their number.
            sigma = 1.0 if t.fill == Fill.EMBED else 1 / math.sqrt(t.shape[0])
            key = (t.qtype, 2 ** (round(math.log2(sigma) * 2) / 2))
            if key not in self.pools:
                self.pools[key] = BlockPool(t.qtype, key[1], self.rng)
            yield from self.pools[key].pieces(t.n_bytes, self.rng)
        elif t.fill == Fill.ONES:
            yield np.ones(t.n_elements, dtype=np.float32).tobytes()
        elif t.fill in (Fill.ROUTER, Fill.SMALL):
            yield self.rng.normal(0.0, 1 / math.sqrt(t.shape[0]), t.n_elements).astype(np.float32).tobytes()
        elif t.fill in (Fill.ROUTER_BIAS, Fill.FLAT_ROUTER_BIAS):
            # a different hot set in every layer, as real routers have
            skew = ROUTER_SKEW if t.fill == Fill.ROUTER_BIAS else FLAT_ROUTER_SKEW
            rank = self.rng.permutation(t.n_elements)
            yield (-skew * np.log1p(rank)).astype(np.float32).tobytes()
        elif t.fill == Fill.ZEROS:
            yield bytes(4 * t.n_elements)
        elif t.fill == Fill.DECAY:
            yield (-self.rng.uniform(0.5, 2.0, t.n_elements)).astype(np.float32).tobytes()
        else:
            raise AssertionError(f"unknown fill {t.fill}")
