"""`kimitui synth`: synthetic GGUF models of any size that llama.cpp loads and runs.

Benchmarks need models larger than memory, in real shapes, without downloading them:
random but valid quantized weights (finite logits), the default model's tokenizer (so
chat works), a dense `llama` or an MoE `deepseek2` (Kimi's architecture) sized to hit
`--size`. Written streaming: a few pools of pre-generated random blocks are copied out
at random offsets, so memory stays bounded and throughput is the disk's, not numpy's RNG.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, BinaryIO, Iterator

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, GGUFWriter, LlamaFileType

from kimitui.errors import UserError
from kimitui.units import format_bytes, format_rate, size_option

QUANTS = {
    "q4_0": (GGMLQuantizationType.Q4_0, LlamaFileType.MOSTLY_Q4_0),
    "q4_1": (GGMLQuantizationType.Q4_1, LlamaFileType.MOSTLY_Q4_1),
    "q8_0": (GGMLQuantizationType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    "bf16": (GGMLQuantizationType.BF16, LlamaFileType.MOSTLY_BF16),
}
# Kimi K3 ships its routed experts in MXFP4 (17 bytes per 32 weights) whatever the trunk is.
MXFP4 = GGMLQuantizationType.MXFP4
IQ1_S, IQ2_XXS, IQ3_XXS = GGMLQuantizationType.IQ1_S, GGMLQuantizationType.IQ2_XXS, GGMLQuantizationType.IQ3_XXS
# The K3 GGUFs people download (unsloth's): the release's MXFP4 experts, or the smaller sets'
# trunk at Q8_0 with the routed experts' gate and up in one i-quant and down in a wider one
# (the published sets mix types layer by layer; one rule per set lands near their sizes).
# name -> (trunk type or None for --type's, gate/up type, down type, file type, the published set's bytes)
K3_LAYOUTS = {
    "release": (None, MXFP4, MXFP4, LlamaFileType.MOSTLY_MXFP4_MOE, None),
    "ud-q2_k_xl": ("q8_0", IQ2_XXS, IQ3_XXS, LlamaFileType.MOSTLY_Q2_K, 861e9),
    "ud-iq1_m": ("q8_0", IQ1_S, IQ2_XXS, LlamaFileType.MOSTLY_IQ1_M, 649e9),
}
# i-quants: blocks of 256 weights, each led by its fp16 scale d.
IQ_TYPES = (IQ1_S, IQ2_XXS, GGMLQuantizationType.IQ2_XS, IQ3_XXS)
# Q4_1 by default: llama.cpp's CPU backend repacks Q4_0 (and Q8_0 on some builds) into
# anonymous memory, measured here for Q4_0, so weights would stop streaming from the file.
DEFAULT_QUANT = "q4_1"
F32 = GGMLQuantizationType.F32
ALIGNMENT = 32  # GGUF default data alignment; GGUFWriter uses it too
CONTEXT_LENGTH = 8192  # the SmolLM2 tokenizer's model was trained at 8k
POOL_BYTES = 8 * 1024**2
CHUNK_BYTES = 1024**2
# exp_probs_b = -ROUTER_SKEW * ln(rank + 1) is added to the sigmoid probabilities (spread
# ~0.2) to choose experts: a Zipf-like hot set that still varies per token. Measured in
# llama.cpp (eval callback, 106 tokens): kimi-k2-like at 100 MiB, 300 MiB and 2 GiB, the
# hottest expert of a layer serves 51-66% of tokens, the top 10% of experts take 72-81% of
# picks (Zipf s ~ 1.1); the 64-expert generic MoE 41-46% and 29-30%. Almost every token
# picks a distinct set.
ROUTER_SKEW = 0.06


# --- what a model is made of ----------------------------------------------------------------

WEIGHT = "weight"  # a matrix from a block pool, std 1/sqrt(fan-in)
EMBED = "embed"  # token embeddings from a block pool, std 1
ONES = "ones"  # norm weights
ROUTER = "router"  # ffn_gate_inp, f32, fresh random per layer
ROUTER_BIAS = "router_bias"  # exp_probs_b, f32, Zipf-like per layer
FLAT_ROUTER_BIAS = "flat_router_bias"  # exp_probs_b for a router trained for flat expert use (K3)
SMALL = "small"  # f32 conv kernels and the residual-attention scores, std 1/sqrt(ne0)
ZEROS = "zeros"  # f32 biases (ssm_dt.bias)
DECAY = "decay"  # ssm_a: -exp(A_log), negative, per KDA head
# K3's router was trained for flat expert use: a skew a third of K2's keeps a mild hot set.
FLAT_ROUTER_SKEW = 0.02


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]  # ggml order: ne0 (contiguous, the dot-product axis) first
    qtype: GGMLQuantizationType
    fill: str

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)

    @property
    def n_bytes(self) -> int:
        block, type_size = GGML_QUANT_SIZES[self.qtype]
        return self.n_elements // block * type_size


@dataclass(frozen=True)
class ModelSpec:
    arch: str
    description: str
    kv: tuple[tuple[str, Any, GGUFValueType], ...]
    tensors: tuple[TensorSpec, ...]
    tokenizer: Tokenizer = field(repr=False)

    def kv_value(self, key: str) -> Any:
        for k, value, _ in self.kv:
            if k == key:
                return value
        raise KeyError(key)

    def file_bytes(self) -> int:
        """The exact size of the single-file GGUF this spec writes."""
        head = 4 + 4 + 8 + 8  # magic, version, tensor count, kv count
        head += sum(_kv_bytes(k, v, t) for k, v, t in self.kv) + self.tokenizer.encoded_bytes
        head += sum(8 + len(t.name.encode()) + 4 + 8 * len(t.shape) + 4 + 8 for t in self.tensors)
        return _pad(head) + sum(_pad(t.n_bytes) for t in self.tensors)


def _pad(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def _kv_bytes(key: str, value: Any, vtype: GGUFValueType) -> int:
    size = 8 + len(key.encode()) + 4
    if vtype == GGUFValueType.STRING:
        return size + 8 + len(str(value).encode())
    if vtype == GGUFValueType.ARRAY:  # only arrays of uint32 (per-layer head counts)
        return size + 4 + 8 + 4 * len(value)
    return size + {GGUFValueType.UINT32: 4, GGUFValueType.FLOAT32: 4, GGUFValueType.BOOL: 1}[vtype]


@dataclass(frozen=True)
class Tokenizer:
    fields: tuple[tuple[str, Any, GGUFValueType, GGUFValueType | None], ...]
    n_vocab: int
    encoded_bytes: int  # the fields' exact size inside a GGUF header


@lru_cache(maxsize=1)
def default_tokenizer() -> Tokenizer:
    """The tokenizer.* fields (vocabulary, merges, chat template) of the default model."""
    from gguf import GGUFReader

    from kimitui.model.default import default_model_path

    reader = GGUFReader(str(default_model_path()), "r")
    fields = []
    size = 0
    n_vocab = 0
    for key, f in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = f.contents()
        sub = f.types[1] if f.types[0] == GGUFValueType.ARRAY else None
        fields.append((key, value, f.types[0], sub))
        size += sum(int(part.nbytes) for part in f.parts)
        if key == "tokenizer.ggml.tokens":
            n_vocab = len(value)
    if not n_vocab:
        raise UserError(f"{default_model_path()}: holds no tokenizer.ggml.tokens to copy")
    return Tokenizer(tuple(fields), n_vocab, size)


# --- shapes -----------------------------------------------------------------------------


def _round(x: float, multiple: int, minimum: int | None = None) -> int:
    value = max(multiple, int(round(x / multiple)) * multiple)
    return max(value, minimum) if minimum is not None else value


@dataclass(frozen=True)
class LlamaDims:
    n_embd: int
    n_ff: int
    n_layer: int
    n_head: int
    n_head_kv: int

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


def llama_spec(d: LlamaDims, qtype: GGMLQuantizationType, ftype: LlamaFileType, tok: Tokenizer) -> ModelSpec:
    a, v = "llama", tok.n_vocab
    kv = [
        (f"{a}.vocab_size", v, GGUFValueType.UINT32),
        (f"{a}.context_length", CONTEXT_LENGTH, GGUFValueType.UINT32),
        (f"{a}.embedding_length", d.n_embd, GGUFValueType.UINT32),
        (f"{a}.feed_forward_length", d.n_ff, GGUFValueType.UINT32),
        (f"{a}.block_count", d.n_layer, GGUFValueType.UINT32),
        (f"{a}.attention.head_count", d.n_head, GGUFValueType.UINT32),
        (f"{a}.attention.head_count_kv", d.n_head_kv, GGUFValueType.UINT32),
        (f"{a}.rope.dimension_count", d.head_dim, GGUFValueType.UINT32),
        (f"{a}.rope.freq_base", 500000.0, GGUFValueType.FLOAT32),
        (f"{a}.attention.layer_norm_rms_epsilon", 1e-5, GGUFValueType.FLOAT32),
    ]
    kv_width = d.n_head_kv * d.head_dim
    tensors = [TensorSpec("token_embd.weight", (d.n_embd, v), qtype, EMBED)]
    for i in range(d.n_layer):
        b = f"blk.{i}."
        tensors += [
            TensorSpec(b + "attn_norm.weight", (d.n_embd,), F32, ONES),
            TensorSpec(b + "attn_q.weight", (d.n_embd, d.n_embd), qtype, WEIGHT),
            TensorSpec(b + "attn_k.weight", (d.n_embd, kv_width), qtype, WEIGHT),
            TensorSpec(b + "attn_v.weight", (d.n_embd, kv_width), qtype, WEIGHT),
            TensorSpec(b + "attn_output.weight", (d.n_embd, d.n_embd), qtype, WEIGHT),
            TensorSpec(b + "ffn_norm.weight", (d.n_embd,), F32, ONES),
            *_gated_ffn(b, "", d.n_embd, d.n_ff, qtype),
        ]
    tensors += [
        TensorSpec("output_norm.weight", (d.n_embd,), F32, ONES),
        TensorSpec("output.weight", (d.n_embd, v), qtype, WEIGHT),
    ]
    desc = (
        f"llama: {d.n_layer} layers, n_embd {d.n_embd}, n_ff {d.n_ff}, "
        f"{d.n_head} heads ({d.n_head_kv} kv), vocab {v}"
    )
    return _finish_spec(a, desc, kv, tensors, ftype, tok)


@dataclass(frozen=True)
class Deepseek2Dims:
    n_embd: int
    n_layer: int
    n_head: int
    q_lora: int
    kv_lora: int
    n_ff: int  # the leading dense layers' FFN
    n_ff_exp: int
    n_expert: int
    n_expert_used: int
    n_expert_shared: int
    n_dense_lead: int
    expert_weights_scale: float
    qk_nope: int = 128
    qk_rope: int = 64
    v_head: int = 128


def _mla_tensors(b: str, n_embd: int, d, qtype: GGMLQuantizationType) -> list[TensorSpec]:
    """MLA's low-rank q and compressed kv as llama.cpp's converters write them (kv_b split into
    attn_k_b / attn_v_b): deepseek2 and kimi-k3 alike."""
    return [
        TensorSpec(b + "attn_q_a.weight", (n_embd, d.q_lora), qtype, WEIGHT),
        TensorSpec(b + "attn_q_a_norm.weight", (d.q_lora,), F32, ONES),
        TensorSpec(b + "attn_q_b.weight", (d.q_lora, d.n_head * (d.qk_nope + d.qk_rope)), qtype, WEIGHT),
        TensorSpec(b + "attn_kv_a_mqa.weight", (n_embd, d.kv_lora + d.qk_rope), qtype, WEIGHT),
        TensorSpec(b + "attn_kv_a_norm.weight", (d.kv_lora,), F32, ONES),
        TensorSpec(b + "attn_k_b.weight", (d.qk_nope, d.kv_lora, d.n_head), qtype, WEIGHT),
        TensorSpec(b + "attn_v_b.weight", (d.kv_lora, d.v_head, d.n_head), qtype, WEIGHT),
    ]


def _gated_ffn(b: str, suffix: str, n_embd: int, n_ff: int, qtype: GGMLQuantizationType) -> list[TensorSpec]:
    """ffn_gate/up/down (suffix "" for a dense FFN, "_shexp" for a shared expert)."""
    return [
        TensorSpec(b + f"ffn_gate{suffix}.weight", (n_embd, n_ff), qtype, WEIGHT),
        TensorSpec(b + f"ffn_up{suffix}.weight", (n_embd, n_ff), qtype, WEIGHT),
        TensorSpec(b + f"ffn_down{suffix}.weight", (n_ff, n_embd), qtype, WEIGHT),
    ]


def deepseek2_spec(d: Deepseek2Dims, qtype: GGMLQuantizationType, ftype: LlamaFileType, tok: Tokenizer) -> ModelSpec:
    """DeepSeek-V3 / Kimi K2 layout as llama.cpp's converter writes it today: MLA with the
    kv_b projection split into attn_k_b / attn_v_b, sigmoid routing with exp_probs_b."""
    a, v = "deepseek2", tok.n_vocab
    u32, f32 = GGUFValueType.UINT32, GGUFValueType.FLOAT32
    kv = [
        (f"{a}.vocab_size", v, u32),
        (f"{a}.context_length", CONTEXT_LENGTH, u32),
        (f"{a}.embedding_length", d.n_embd, u32),
        (f"{a}.feed_forward_length", d.n_ff, u32),
        (f"{a}.block_count", d.n_layer, u32),
        (f"{a}.attention.head_count", d.n_head, u32),
        # MLA runs as multi-query attention over the compressed kv: one kv head whose key
        # is the kv latent plus the rope part, whose value is the latent.
        (f"{a}.attention.head_count_kv", 1, u32),
        (f"{a}.attention.key_length", d.kv_lora + d.qk_rope, u32),
        (f"{a}.attention.value_length", d.kv_lora, u32),
        (f"{a}.attention.key_length_mla", d.qk_nope + d.qk_rope, u32),
        (f"{a}.attention.value_length_mla", d.v_head, u32),
        (f"{a}.attention.q_lora_rank", d.q_lora, u32),
        (f"{a}.attention.kv_lora_rank", d.kv_lora, u32),
        (f"{a}.attention.layer_norm_rms_epsilon", 1e-6, f32),
        (f"{a}.rope.dimension_count", d.qk_rope, u32),
        (f"{a}.rope.freq_base", 50000.0, f32),
        (f"{a}.leading_dense_block_count", d.n_dense_lead, u32),
        (f"{a}.expert_feed_forward_length", d.n_ff_exp, u32),
        (f"{a}.expert_count", d.n_expert, u32),
        (f"{a}.expert_used_count", d.n_expert_used, u32),
        (f"{a}.expert_shared_count", d.n_expert_shared, u32),
        (f"{a}.expert_weights_scale", d.expert_weights_scale, f32),
        (f"{a}.expert_weights_norm", True, GGUFValueType.BOOL),
        (f"{a}.expert_gating_func", 2, u32),  # sigmoid, as DeepSeek-V3 and Kimi K2
    ]
    tensors = [TensorSpec("token_embd.weight", (d.n_embd, v), qtype, EMBED)]
    n_shexp = d.n_ff_exp * d.n_expert_shared
    for i in range(d.n_layer):
        b = f"blk.{i}."
        tensors += [
            TensorSpec(b + "attn_norm.weight", (d.n_embd,), F32, ONES),
            *_mla_tensors(b, d.n_embd, d, qtype),
            TensorSpec(b + "attn_output.weight", (d.n_head * d.v_head, d.n_embd), qtype, WEIGHT),
            TensorSpec(b + "ffn_norm.weight", (d.n_embd,), F32, ONES),
        ]
        if i < d.n_dense_lead:
            tensors += _gated_ffn(b, "", d.n_embd, d.n_ff, qtype)
        else:
            tensors += [
                TensorSpec(b + "ffn_gate_inp.weight", (d.n_embd, d.n_expert), F32, ROUTER),
                TensorSpec(b + "exp_probs_b.bias", (d.n_expert,), F32, ROUTER_BIAS),
                TensorSpec(b + "ffn_gate_exps.weight", (d.n_embd, d.n_ff_exp, d.n_expert), qtype, WEIGHT),
                TensorSpec(b + "ffn_up_exps.weight", (d.n_embd, d.n_ff_exp, d.n_expert), qtype, WEIGHT),
                TensorSpec(b + "ffn_down_exps.weight", (d.n_ff_exp, d.n_embd, d.n_expert), qtype, WEIGHT),
                *_gated_ffn(b, "_shexp", d.n_embd, n_shexp, qtype),
            ]
    tensors += [
        TensorSpec("output_norm.weight", (d.n_embd,), F32, ONES),
        TensorSpec("output.weight", (d.n_embd, v), qtype, WEIGHT),
    ]
    desc = (
        f"deepseek2: {d.n_layer} layers ({d.n_dense_lead} dense), n_embd {d.n_embd}, "
        f"{d.n_expert} experts ({d.n_expert_used} used, {d.n_expert_shared} shared) of n_ff {d.n_ff_exp}, "
        f"dense n_ff {d.n_ff}, {d.n_head} heads, q/kv lora {d.q_lora}/{d.kv_lora}, vocab {v}"
    )
    return _finish_spec(a, desc, kv, tensors, ftype, tok)


@dataclass(frozen=True)
class KimiK3Dims:
    n_embd: int
    n_layer: int
    n_head: int  # KDA and MLA alike
    q_lora: int
    kv_lora: int
    n_ff: int  # the leading dense layers' FFN
    n_ff_exp: int
    n_latent: int  # LatentMoE: routed experts run at this width
    n_expert: int
    n_expert_used: int
    n_expert_shared: int
    n_dense_lead: int
    expert_weights_scale: float
    kda_head_dim: int = 128
    conv_kernel: int = 4
    qk_nope: int = 128
    qk_rope: int = 64  # NoPE, but it still sizes K (the converter's note)
    v_head: int = 128
    attn_res_block_size: int = 6

    def is_mla(self, layer: int) -> bool:
        """Full (MLA) attention on every fourth layer and on the last, KDA elsewhere: 24 MLA and
        69 KDA layers at 93, as the release; a cut keeps the rule (4 layers: 3 KDA, 1 MLA)."""
        return (layer + 1) % 4 == 0 or layer == self.n_layer - 1


def kimi_k3_spec(
    d: KimiK3Dims, qtype: GGMLQuantizationType, ftype: LlamaFileType, tok: Tokenizer,
    experts: tuple[GGMLQuantizationType, GGMLQuantizationType] = (MXFP4, MXFP4),
) -> ModelSpec:
    """Kimi K3 as llama.cpp's kimi-k3 loader reads it (src/models/kimi-k3.cpp of the pinned
    llama.cpp): KDA and gated-MLA layers told apart by a per-layer head_count_kv of 0 or 1,
    cross-layer residual attention scores, LatentMoE (router on n_embd, routed experts in
    MXFP4 at the latent width between ffn_routed_down and ffn_routed_up), the shared experts
    fused into one FFN at n_embd, and the situ activation. The trunk is `qtype`; ``experts``: the
    routed gate/up and down types."""
    a, v = "kimi-k3", tok.n_vocab
    gate_up, down = experts
    u32, f32 = GGUFValueType.UINT32, GGUFValueType.FLOAT32
    kv = [
        (f"{a}.vocab_size", v, u32),
        (f"{a}.context_length", CONTEXT_LENGTH, u32),
        (f"{a}.embedding_length", d.n_embd, u32),
        (f"{a}.feed_forward_length", d.n_ff, u32),
        (f"{a}.block_count", d.n_layer, u32),
        (f"{a}.attention.head_count", d.n_head, u32),
        # 0 marks a KDA (recurrent) layer; MLA runs as one kv head over the compressed latent.
        (f"{a}.attention.head_count_kv", [1 if d.is_mla(i) else 0 for i in range(d.n_layer)], GGUFValueType.ARRAY),
        (f"{a}.attention.key_length", d.kv_lora + d.qk_rope, u32),
        (f"{a}.attention.value_length", d.kv_lora, u32),
        (f"{a}.attention.key_length_mla", d.qk_nope + d.qk_rope, u32),
        (f"{a}.attention.value_length_mla", d.v_head, u32),
        (f"{a}.attention.q_lora_rank", d.q_lora, u32),
        (f"{a}.attention.kv_lora_rank", d.kv_lora, u32),
        (f"{a}.attention.layer_norm_rms_epsilon", 1e-6, f32),
        (f"{a}.rope.dimension_count", d.qk_rope, u32),
        (f"{a}.ssm.conv_kernel", d.conv_kernel, u32),
        (f"{a}.kda.head_dim", d.kda_head_dim, u32),
        (f"{a}.kda.gate_lower_bound", -5.0, f32),
        (f"{a}.leading_dense_block_count", d.n_dense_lead, u32),
        (f"{a}.expert_feed_forward_length", d.n_ff_exp, u32),
        (f"{a}.expert_count", d.n_expert, u32),
        (f"{a}.expert_used_count", d.n_expert_used, u32),
        (f"{a}.expert_shared_count", d.n_expert_shared, u32),
        (f"{a}.expert_weights_scale", d.expert_weights_scale, f32),
        (f"{a}.expert_weights_norm", True, GGUFValueType.BOOL),
        (f"{a}.expert_gating_func", 2, u32),  # sigmoid
        (f"{a}.expert_latent_length", d.n_latent, u32),
        (f"{a}.activation.situ_beta", 8.0, f32),
        (f"{a}.activation.situ_linear_beta", 8.0, f32),
        (f"{a}.attn_res.block_size", d.attn_res_block_size, u32),
    ]
    d_inner = d.n_head * d.kda_head_dim
    n_shexp = d.n_ff_exp * d.n_expert_shared
    tensors = [TensorSpec("token_embd.weight", (d.n_embd, v), qtype, EMBED)]
    for i in range(d.n_layer):
        b = f"blk.{i}."
        tensors += [
            TensorSpec(b + "attn_norm.weight", (d.n_embd,), F32, ONES),
            TensorSpec(b + "attn_res_score.weight", (d.n_embd,), F32, SMALL),
        ]
        if d.is_mla(i):
            tensors += [
                *_mla_tensors(b, d.n_embd, d, qtype),
                TensorSpec(b + "attn_gate.weight", (d.n_embd, d.n_head * d.v_head), qtype, WEIGHT),
                TensorSpec(b + "attn_output.weight", (d.n_head * d.v_head, d.n_embd), qtype, WEIGHT),
            ]
        else:
            tensors += [
                TensorSpec(b + "ssm_conv1d_q.weight", (d.conv_kernel, 1, d_inner), F32, SMALL),
                TensorSpec(b + "ssm_conv1d_k.weight", (d.conv_kernel, 1, d_inner), F32, SMALL),
                TensorSpec(b + "ssm_conv1d_v.weight", (d.conv_kernel, 1, d_inner), F32, SMALL),
                TensorSpec(b + "attn_q.weight", (d.n_embd, d_inner), qtype, WEIGHT),
                TensorSpec(b + "attn_k.weight", (d.n_embd, d_inner), qtype, WEIGHT),
                TensorSpec(b + "attn_v.weight", (d.n_embd, d_inner), qtype, WEIGHT),
                TensorSpec(b + "ssm_f_a.weight", (d.n_embd, d.kda_head_dim), qtype, WEIGHT),
                TensorSpec(b + "ssm_f_b.weight", (d.kda_head_dim, d_inner), qtype, WEIGHT),
                TensorSpec(b + "ssm_beta.weight", (d.n_embd, d.n_head), F32, SMALL),
                TensorSpec(b + "ssm_a", (d.n_head,), F32, DECAY),
                TensorSpec(b + "ssm_dt.bias", (d_inner,), F32, ZEROS),
                TensorSpec(b + "ssm_g.weight", (d.n_embd, d_inner), qtype, WEIGHT),
                TensorSpec(b + "ssm_norm.weight", (d.kda_head_dim,), F32, ONES),
                TensorSpec(b + "attn_output.weight", (d_inner, d.n_embd), qtype, WEIGHT),
            ]
        tensors += [
            TensorSpec(b + "ffn_norm.weight", (d.n_embd,), F32, ONES),
            TensorSpec(b + "ffn_res_score.weight", (d.n_embd,), F32, SMALL),
        ]
        if i < d.n_dense_lead:
            tensors += _gated_ffn(b, "", d.n_embd, d.n_ff, qtype)
        else:
            tensors += [
                TensorSpec(b + "ffn_gate_inp.weight", (d.n_embd, d.n_expert), F32, ROUTER),
                TensorSpec(b + "exp_probs_b.bias", (d.n_expert,), F32, FLAT_ROUTER_BIAS),
                TensorSpec(b + "ffn_routed_down.weight", (d.n_embd, d.n_latent), qtype, WEIGHT),
                TensorSpec(b + "ffn_gate_exps.weight", (d.n_latent, d.n_ff_exp, d.n_expert), gate_up, WEIGHT),
                TensorSpec(b + "ffn_up_exps.weight", (d.n_latent, d.n_ff_exp, d.n_expert), gate_up, WEIGHT),
                TensorSpec(b + "ffn_down_exps.weight", (d.n_ff_exp, d.n_latent, d.n_expert), down, WEIGHT),
                TensorSpec(b + "ffn_routed_norm.weight", (d.n_latent,), F32, ONES),
                TensorSpec(b + "ffn_routed_up.weight", (d.n_latent, d.n_embd), qtype, WEIGHT),
                *_gated_ffn(b, "_shexp", d.n_embd, n_shexp, qtype),
            ]
    tensors += [
        TensorSpec("output_res_score.weight", (d.n_embd,), F32, SMALL),
        TensorSpec("output_norm.weight", (d.n_embd,), F32, ONES),
        TensorSpec("output.weight", (d.n_embd, v), qtype, WEIGHT),
    ]
    n_mla = sum(d.is_mla(i) for i in range(d.n_layer))
    desc = (
        f"kimi-k3: {d.n_layer} layers ({d.n_layer - n_mla} KDA, {n_mla} MLA; {d.n_dense_lead} dense), n_embd {d.n_embd}, "
        f"{d.n_expert} experts ({d.n_expert_used} used, {d.n_expert_shared} shared) of n_ff {d.n_ff_exp} "
        f"at latent {d.n_latent} in {_type_names(experts)}, one expert {format_bytes(_expert_bytes_k3(d, experts))}, "
        f"{d.n_head} heads, trunk {qtype.name}, vocab {v}"
    )
    return _finish_spec(a, desc, kv, tensors, ftype, tok)


def _expert_bytes_k3(d: KimiK3Dims, experts=(MXFP4, MXFP4)) -> int:
    def matrix(qtype) -> int:
        block, size = GGML_QUANT_SIZES[qtype]
        return d.n_latent * d.n_ff_exp // block * size

    return 2 * matrix(experts[0]) + matrix(experts[1])


def _type_names(experts) -> str:
    gate_up, down = experts
    return gate_up.name if gate_up == down else f"{gate_up.name} (gate, up) and {down.name} (down)"


def _finish_spec(arch, desc, kv, tensors, ftype, tok) -> ModelSpec:
    head = [
        ("general.architecture", arch, GGUFValueType.STRING),
        ("general.type", "model", GGUFValueType.STRING),
        ("general.name", f"kimitui synthetic {arch}", GGUFValueType.STRING),
        ("general.file_type", int(ftype), GGUFValueType.UINT32),
        ("general.quantization_version", 2, GGUFValueType.UINT32),
    ]
    return ModelSpec(arch, desc, tuple(head + kv), tuple(tensors), tok)


# --- sizing -------------------------------------------------------------------------------

# Kimi K2 (config.json of moonshotai/Kimi-K2-Instruct); K3 keeps the architecture.
KIMI_K2 = dict(
    n_embd=7168, n_layer=61, n_head=64, q_lora=1536, kv_lora=512, n_ff=18432, n_ff_exp=2048,
    n_expert=384, n_expert_used=8, n_expert_shared=1, n_dense_lead=1, expert_weights_scale=2.827,
)
# Kimi K3 (the public config, checked against llama.cpp's kimi-k3 loader): 93 layers, 69 KDA
# and 24 gated MLA, 96 heads in both (KDA 96 x 128; MLA q_lora 1536, kv_lora 512, nope 128 +
# 64, v 128), LatentMoE with 896 routed experts (16 used) at latent 3584 and n_ff 3072 in MXFP4
# (17,547,264 bytes an expert), and two shared experts at n_embd, which the loader fuses into
# one FFN of 2 x 3072 = 6144. At full size in BF16 the trunk (every layer tensor but the routed
# experts) is 109.4 GB against the public ~108.8 GB, the experts 1,446.5 GB against ~1.45 TB.
KIMI_K3 = dict(
    n_embd=7168, n_layer=93, n_head=96, q_lora=1536, kv_lora=512, n_ff=18432, n_ff_exp=3072,
    n_latent=3584, n_expert=896, n_expert_used=16, n_expert_shared=2, n_dense_lead=1,
    expert_weights_scale=2.827,
)
K3_TRUNK_QUANT = "bf16"
LIKE = {"kimi-k2": KIMI_K2, "kimi-k3": KIMI_K3}
# Generic MoE: DeepSeek-V2-Lite / Moonlight expert counts (64 routed, 6 used, 2 shared).
GENERIC_MOE = dict(n_expert=64, n_expert_used=6, n_expert_shared=2, n_dense_lead=1, expert_weights_scale=2.5)
LLAMA_FF_RATIO = 8 / 3  # SwiGLU keeps the FFN's parameters at 4x n_embd wide: n_ff ~ 8/3 n_embd
# llama.cpp takes a deepseek2 model of 26 or 27 layers for a "lite" one without q_lora.
DEEPSEEK2_LITE_LAYERS = {26, 27}
SIZE_TOLERANCE = 0.05  # the file lands within 5% of --size, within 1% unless widths are tiny
SIZE_WEIGHT = 50.0  # 1% off the size weighs like a shape ratio off by a factor 1.65


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


# --- writing ------------------------------------------------------------------------------

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


class _Filler:
    def __init__(self, rng: np.random.Generator):
        self.rng = rng
        self.pools: dict[tuple[GGMLQuantizationType, float], BlockPool] = {}

    def pieces(self, t: TensorSpec) -> Iterator[memoryview | bytes]:
        if t.fill in (WEIGHT, EMBED):
            # std 1/sqrt(fan-in) keeps activations O(1) through every matmul; pools are
            # shared between fan-ins within a factor sqrt(2), which bounds their number.
            sigma = 1.0 if t.fill == EMBED else 1 / math.sqrt(t.shape[0])
            key = (t.qtype, 2 ** (round(math.log2(sigma) * 2) / 2))
            if key not in self.pools:
                self.pools[key] = BlockPool(t.qtype, key[1], self.rng)
            yield from self.pools[key].pieces(t.n_bytes, self.rng)
        elif t.fill == ONES:
            yield np.ones(t.n_elements, dtype=np.float32).tobytes()
        elif t.fill == ROUTER:
            yield self.rng.normal(0.0, 1 / math.sqrt(t.shape[0]), t.n_elements).astype(np.float32).tobytes()
        elif t.fill in (ROUTER_BIAS, FLAT_ROUTER_BIAS):
            # a different hot set in every layer, as real routers have
            skew = ROUTER_SKEW if t.fill == ROUTER_BIAS else FLAT_ROUTER_SKEW
            rank = self.rng.permutation(t.n_elements)
            yield (-skew * np.log1p(rank)).astype(np.float32).tobytes()
        elif t.fill == SMALL:
            yield self.rng.normal(0.0, 1 / math.sqrt(t.shape[0]), t.n_elements).astype(np.float32).tobytes()
        elif t.fill == ZEROS:
            yield bytes(4 * t.n_elements)
        elif t.fill == DECAY:
            yield (-self.rng.uniform(0.5, 2.0, t.n_elements)).astype(np.float32).tobytes()
        else:
            raise AssertionError(f"unknown fill {t.fill}")


class _Progress:
    """One self-rewriting line on stderr (a terminal), at most twice a second."""

    def __init__(self, total: int, stream=sys.stderr):
        self.total, self.done, self.stream = total, 0, stream
        self.start = self.last = time.monotonic()
        self.live = stream.isatty()

    def add(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.live and now - self.last >= 0.5:
            self.last = now
            rate = self.done / max(now - self.start, 1e-9)
            eta = (self.total - self.done) / rate if rate else 0
            self.stream.write(
                f"\rsynth: {format_bytes(self.done)} of {format_bytes(self.total)} "
                f"({100 * self.done / self.total:.0f}%), {format_rate(rate)}, {eta:.0f} s left  "
            )
            self.stream.flush()

    def close(self) -> None:
        if self.live:
            self.stream.write("\r" + " " * 79 + "\r")
            self.stream.flush()


@dataclass(frozen=True)
class WriteResult:
    paths: tuple[Path, ...]
    n_bytes: int  # all files together
    seconds: float  # writing and fsync, header included

    @property
    def rate(self) -> float:
        return self.n_bytes / max(self.seconds, 1e-9)


def split_names(out: Path, n_files: int) -> list[Path]:
    """llama.cpp's split naming (llama_split_path): OUT-0000N-of-0000M.gguf."""
    if n_files == 1:
        return [out]
    stem = out.name[: -len(".gguf")] if out.name.endswith(".gguf") else out.name
    return [out.with_name(f"{stem}-{i:05d}-of-{n_files:05d}.gguf") for i in range(1, n_files + 1)]


def write_model(
    spec: ModelSpec,
    out: Path,
    *,
    seed: int = 0,
    split_size: int | None = None,
    force: bool = False,
    progress: bool = True,
    sparse: bool = False,
    whole_layers: bool = True,
) -> WriteResult:
    """Write `spec` to `out` (or a split set next to it) through a `.partial` directory,
    renamed into place only once every byte is on disk. `sparse`: the weight matrices are file
    holes (they read back as zeros and take no disk); headers, norms, routers and their biases
    hold data, so the file has the real model's shape and size at the cost of its small tensors.
    A split set keeps each layer in one file unless ``whole_layers`` is False (cut between any
    two tensors, as sets made with llama.cpp's gguf-split are)."""
    total = sum(t.n_bytes for t in spec.tensors if not _hole(t, sparse))  # bytes written
    splitting = split_size is not None and sum(t.n_bytes for t in spec.tensors) > split_size
    writer = GGUFWriter(None, spec.arch)
    for key, value, vtype in spec.kv:
        if key != "general.architecture":  # GGUFWriter writes that one itself
            writer.add_key_value(key, value, vtype)
    for key, value, vtype, sub in spec.tokenizer.fields:
        writer.add_key_value(key, value, vtype, sub_type=sub)
    by_name = {}
    starts = _file_starts(spec.tensors, split_size, whole_layers) if splitting else set()
    for t in spec.tensors:
        if t.name in starts:
            writer.tensors.append({})  # the next file of the set: GGUFWriter writes one per dict
        # GGUFWriter takes numpy (outermost-first) order and writes it reversed
        writer.add_tensor_info(t.name, tuple(reversed(t.shape)), np.dtype(np.float32), t.n_bytes, raw_dtype=t.qtype)
        by_name[t.name] = t

    finals = split_names(out, len(writer.tensors))
    existing = [p for p in finals if p.exists()]
    for p in existing:
        if p.is_dir():
            raise UserError(f"{p} is a directory; name a file")
    if existing and not force:
        raise UserError(f"{existing[0]} exists (use --force to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out.parent).free
    needs = total + (spec.file_bytes() - sum(t.n_bytes for t in spec.tensors))
    if free < needs:
        raise UserError(f"{out.parent}: {format_bytes(free)} free, the model needs {format_bytes(needs)}")

    tmp_dir = out.with_name(out.name + ".partial")
    if tmp_dir.exists():
        shutil.rmtree(tmp_dir)  # left by an interrupted run: ours by name
    tmp_dir.mkdir()
    start = time.monotonic()
    bar = _Progress(total) if progress else None
    filler = _Filler(np.random.default_rng(seed))
    try:
        writer.write_header_to_file(tmp_dir / out.name)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        assert writer.fout is not None
        temps = [Path(f.name) for f in writer.fout]
        for fout, tensors in zip(writer.fout, writer.tensors):
            _write_data(fout, [by_name[name] for name in tensors], filler, bar, sparse)
            fout.flush()
            os.fsync(fout.fileno())
        writer.close()
        if bar:
            bar.close()
        # the first file last: llama.cpp opens a set through it, so its presence means done
        for tmp, final in list(zip(temps, finals))[1:] + [(temps[0], finals[0])]:
            os.replace(tmp, final)
        tmp_dir.rmdir()
    except BaseException:
        writer.close()
        if bar:
            bar.close()
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    seconds = time.monotonic() - start
    return WriteResult(tuple(finals), sum(p.stat().st_size for p in finals), seconds)


def _layer_of(name: str) -> int | None:
    return int(name.split(".")[1]) if name.startswith("blk.") else None


def _file_starts(tensors: tuple[TensorSpec, ...], split_size: int, whole_layers: bool) -> set[str]:
    """The tensors that begin a new file of a split set, as many units per file as fit in
    ``split_size`` (a unit larger than that gets a file of its own). With ``whole_layers`` a unit
    is a layer, or the run of non-layer tensors before the first layer (embeddings) or after the
    last (output norm and head), so no layer straddles two files; else each tensor is one, as
    llama.cpp's gguf-split cuts."""
    units: list[tuple[str, int]] = []  # (first tensor, bytes)
    key = object()
    for t in tensors:
        unit = (_layer_of(t.name), t.name) if not whole_layers else (_layer_of(t.name), None)
        if unit != key:
            units.append((t.name, 0))
            key = unit
        units[-1] = (units[-1][0], units[-1][1] + t.n_bytes)
    starts, in_file = set(), 0
    for first, n_bytes in units:
        if in_file and in_file + n_bytes > split_size:
            starts.add(first)
            in_file = 0
        in_file += n_bytes
    return starts


def _hole(t: TensorSpec, sparse: bool) -> bool:
    """Whether ``--sparse`` leaves this tensor as a file hole: the weight matrices, but not the
    embeddings and the output head, which make each token's hidden state (and so its routing,
    in every layer) and the next greedy token differ; with them zero every token would route
    alike and the caches would hit as no real model lets them."""
    return sparse and t.fill == WEIGHT and t.name != "output.weight"


def _write_data(fout: BinaryIO, tensors: list[TensorSpec], filler: _Filler, bar: _Progress | None, sparse: bool) -> None:
    fout.write(bytes(_pad(fout.tell()) - fout.tell()))
    for t in tensors:
        if _hole(t, sparse):
            fout.seek(_pad(t.n_bytes), os.SEEK_CUR)
            continue
        for piece in filler.pieces(t):
            fout.write(piece)
            if bar:
                bar.add(len(piece))
        fout.write(bytes(_pad(t.n_bytes) - t.n_bytes))
    fout.truncate(fout.tell())  # a hole at the end still makes the file its full size


# --- command line -------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", type=Path, help="output GGUF (with --split-size: OUT-0000N-of-0000M.gguf)")
    parser.add_argument("--arch", choices=("dense", "moe"), help="dense llama or MoE deepseek2 (default dense; moe with --like)")
    parser.add_argument("--size", help="target file size, e.g. 8GiB (from about 100MiB up)")
    parser.add_argument("--like", choices=sorted(LIKE), help="MoE with this model's layer and expert counts, widths shrunk to --size")
    parser.add_argument("--scale", type=float, help="with --like instead of --size: multiply its widths by this")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0): same seed, same bytes")
    parser.add_argument("--layers", type=int, help="with --like: a slice of this many of its layers at its real widths")
    parser.add_argument("--experts", type=int, help="with --like: a slice with this many routed experts per layer at their real size")
    parser.add_argument(
        "--type", dest="quant", choices=sorted(QUANTS),
        help=f"weight type (default {DEFAULT_QUANT}; the trunk of kimi-k3, {K3_TRUNK_QUANT}, its experts are MXFP4)",
    )
    parser.add_argument(
        "--split-size",
        help="write a llama.cpp split set (OUT-0000N-of-0000M.gguf, as published sets are): files of whole layers, each at most this size unless one layer is larger",
    )
    parser.add_argument(
        "--layout", choices=tuple(K3_LAYOUTS),
        help="kimi-k3: a published set's types (release: experts MXFP4, trunk as --type; ud-q2_k_xl and ud-iq1_m: trunk Q8_0, experts i-quants)",
    )
    parser.add_argument("--force", action="store_true", help="replace existing output files")
    parser.add_argument("--dry-run", action="store_true", help="print the shape and size, write nothing")
    parser.add_argument(
        "--sparse", action="store_true",
        help="weight matrices as file holes (zeros, no disk): the real size for planning and start-up; routers, norms and biases hold data",
    )


def plan(args: argparse.Namespace) -> ModelSpec:
    if args.like and args.arch == "dense":
        raise UserError("--like makes an MoE model; drop --arch dense")
    if args.scale is not None and not args.like:
        raise UserError("--scale needs --like (it scales that model's widths)")
    if args.scale is not None and args.size:
        raise UserError("give --size or --scale, not both")
    cut = Cut(args.layers, args.experts)
    if (cut.layers is not None or cut.experts is not None) and not args.like:
        raise UserError("--layers and --experts cut a --like model (e.g. --like kimi-k3 --layers 4 --experts 48)")
    if cut.layers is not None and not 2 <= cut.layers <= LIKE[args.like]["n_layer"]:
        raise UserError(f"--layers must be in 2..{LIKE[args.like]['n_layer']}")
    if cut.experts is not None and not 1 <= cut.experts <= LIKE[args.like]["n_expert"]:
        raise UserError(f"--experts must be in 1..{LIKE[args.like]['n_expert']}")
    if args.scale is None and not args.size:
        if cut == Cut():
            raise UserError("--size is required (e.g. --size 8GiB), or --scale, --layers or --experts with --like")
        args.scale = 1.0  # a slice keeps the real widths
    if args.scale is not None and not 0 < args.scale <= 4:
        raise UserError("--scale must be in (0, 4]")
    if args.seed < 0:
        raise UserError("--seed must be 0 or more")
    if args.layout and args.like != "kimi-k3":
        raise UserError("--layout is one of Kimi K3's published sets: use it with --like kimi-k3")
    if args.layout not in (None, "release") and args.quant:
        raise UserError(f"--layout {args.layout} sets the trunk's type (Q8_0): drop --type")
    target = size_option(args.size, "--size") if args.size else None
    tok = default_tokenizer()
    if args.like:
        return plan_like(args.like, target, args.scale, args.quant, tok, cut, args.layout or "release")
    assert target is not None
    if args.arch == "moe":
        return plan_moe(target, args.quant or DEFAULT_QUANT, tok)
    return plan_dense(target, args.quant or DEFAULT_QUANT, tok)


def figures(spec: ModelSpec) -> list[str]:
    """What a streaming engine meets in this model, for --dry-run: the sizes that decide it."""
    experts = [t for t in spec.tensors if "_exps." in t.name]
    if not experts:
        return []
    n_expert = experts[0].shape[-1]
    used = spec.kv_value(f"{spec.arch}.expert_used_count")
    moe_layers = sorted({t.name.split(".")[1] for t in experts})
    one_expert = sum(t.n_bytes for t in experts) // n_expert // len(moe_layers)
    routed = sum(t.n_bytes for t in experts)
    embd = next(t for t in spec.tensors if t.name == "token_embd.weight")
    trunk = sum(t.n_bytes for t in spec.tensors) - routed - embd.n_bytes
    per_layer = [sum(t.n_bytes for t in spec.tensors if t.name.startswith(f"blk.{i}.")) for i in range(len(moe_layers) + 1)]
    return [
        f"one expert {format_bytes(one_expert)} ({one_expert:,} B); {n_expert} per MoE layer, {len(moe_layers)} MoE layers",
        f"one token: {used} experts x {len(moe_layers)} layers = {format_bytes(used * one_expert * len(moe_layers))} of experts, "
        f"plus {format_bytes(trunk + embd.n_bytes // embd.shape[1])} of trunk",
        f"routed experts {format_bytes(routed)}, trunk {format_bytes(trunk)}, embeddings {format_bytes(embd.n_bytes)}; "
        f"largest layer with all its experts {format_bytes(max(per_layer))}",
    ]


def run(args: argparse.Namespace) -> int:
    split = size_option(args.split_size, "--split-size") if args.split_size else None
    spec = plan(args)
    print(f"{spec.description}; {format_bytes(spec.file_bytes())}")
    if args.dry_run:
        for line in figures(spec):
            print(f"  {line}")
        published = K3_LAYOUTS[args.layout][-1] if args.layout else None
        if published and args.scale == 1 and args.layers is None and args.experts is None:
            size = spec.file_bytes()
            print(f"  the published {args.layout} set: {published / 1e9:,.0f} GB; this one {size / 1e9:,.0f} GB ({size / published - 1:+.1%}; its vocabulary is 49k, K3's 164k)")
        return 0
    result = write_model(spec, args.out, seed=args.seed, split_size=split, force=args.force, sparse=args.sparse)
    paths = result.paths
    names = str(paths[0]) if len(paths) == 1 else f"{len(paths)} files, {paths[0]} .. {paths[-1].name}"
    if args.sparse:
        on_disk = sum(p.stat().st_blocks * 512 for p in paths)
        print(f"wrote {names}: {format_bytes(result.n_bytes)}, {format_bytes(on_disk)} on disk, in {result.seconds:.1f} s")
    else:
        print(f"wrote {names}: {format_bytes(result.n_bytes)} in {result.seconds:.1f} s ({format_rate(result.rate)})")
    return 0
