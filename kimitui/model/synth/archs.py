"""The architectures a synthetic model takes, as llama.cpp's loaders read them: a dense
`llama`, an MoE `deepseek2` (DeepSeek-V3, Kimi K2) and `kimi-k3`, with the real models'
shapes and Kimi K3's published type layouts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, LlamaFileType

from kimitui.model.synth.spec import F32, IQ1_S, IQ2_XXS, IQ3_XXS, MXFP4, Fill, ModelSpec, TensorSpec, Tokenizer, model_spec
from kimitui.units import format_bytes

QUANTS = {
    "q4_0": (GGMLQuantizationType.Q4_0, LlamaFileType.MOSTLY_Q4_0),
    "q4_1": (GGMLQuantizationType.Q4_1, LlamaFileType.MOSTLY_Q4_1),
    "q8_0": (GGMLQuantizationType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    "bf16": (GGMLQuantizationType.BF16, LlamaFileType.MOSTLY_BF16),
}
# Q4_1 by default: llama.cpp's CPU backend repacks Q4_0 (and Q8_0 on some builds) into
# anonymous memory, measured here for Q4_0, so weights would stop streaming from the file.
DEFAULT_QUANT = "q4_1"
K3_TRUNK_QUANT = "bf16"
# The K3 GGUFs people download (unsloth's): the release's MXFP4 experts, or the smaller sets'
# trunk at Q8_0 with the routed experts' gate and up in one i-quant and down in a wider one
# (the published sets mix types layer by layer; one rule per set lands near their sizes).
# name -> (trunk type or None for --type's, gate/up type, down type, file type, the published set's bytes)
K3_LAYOUTS = {
    "release": (None, MXFP4, MXFP4, LlamaFileType.MOSTLY_MXFP4_MOE, None),
    "ud-q2_k_xl": ("q8_0", IQ2_XXS, IQ3_XXS, LlamaFileType.MOSTLY_Q2_K, 861e9),
    "ud-iq1_m": ("q8_0", IQ1_S, IQ2_XXS, LlamaFileType.MOSTLY_IQ1_M, 649e9),
}
CONTEXT_LENGTH = 8192  # the SmolLM2 tokenizer's model was trained at 8k

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
LIKE = {"kimi-k2": KIMI_K2, "kimi-k3": KIMI_K3}

U32, FLOAT32 = GGUFValueType.UINT32, GGUFValueType.FLOAT32


# --- what the architectures share -----------------------------------------------------------


def _head_kv(a: str, vocab: int, d: LlamaDims | Deepseek2Dims) -> list:
    """The keys that open every architecture's list (`a.`-prefixed)."""
    return [
        (f"{a}.vocab_size", vocab, U32),
        (f"{a}.context_length", CONTEXT_LENGTH, U32),
        (f"{a}.embedding_length", d.n_embd, U32),
        (f"{a}.feed_forward_length", d.n_ff, U32),
        (f"{a}.block_count", d.n_layer, U32),
        (f"{a}.attention.head_count", d.n_head, U32),
    ]


def _mla_kv(a: str, d: Deepseek2Dims) -> list:
    """MLA's widths: it runs as multi-query attention over the compressed kv, one kv head whose
    key is the kv latent plus the rope part, whose value is the latent."""
    return [
        (f"{a}.attention.key_length", d.kv_lora + d.qk_rope, U32),
        (f"{a}.attention.value_length", d.kv_lora, U32),
        (f"{a}.attention.key_length_mla", d.qk_nope + d.qk_rope, U32),
        (f"{a}.attention.value_length_mla", d.v_head, U32),
        (f"{a}.attention.q_lora_rank", d.q_lora, U32),
        (f"{a}.attention.kv_lora_rank", d.kv_lora, U32),
        (f"{a}.attention.layer_norm_rms_epsilon", 1e-6, FLOAT32),
        (f"{a}.rope.dimension_count", d.qk_rope, U32),
    ]


def _moe_kv(a: str, d: Deepseek2Dims) -> list:
    return [
        (f"{a}.leading_dense_block_count", d.n_dense_lead, U32),
        (f"{a}.expert_feed_forward_length", d.n_ff_exp, U32),
        (f"{a}.expert_count", d.n_expert, U32),
        (f"{a}.expert_used_count", d.n_expert_used, U32),
        (f"{a}.expert_shared_count", d.n_expert_shared, U32),
        (f"{a}.expert_weights_scale", d.expert_weights_scale, FLOAT32),
        (f"{a}.expert_weights_norm", True, GGUFValueType.BOOL),
        (f"{a}.expert_gating_func", 2, U32),  # sigmoid, as DeepSeek-V3 and Kimi K2
    ]


def _model_tensors(
    n_embd: int, vocab: int, n_layer: int, qtype: GGMLQuantizationType,
    layer: Callable[[str, int], list[TensorSpec]], before_output: Sequence[TensorSpec] = (),
) -> list[TensorSpec]:
    """The embeddings, each layer's tensors (`layer(prefix, index)`), the output norm and head."""
    tensors = [TensorSpec("token_embd.weight", (n_embd, vocab), qtype, Fill.EMBED)]
    for i in range(n_layer):
        tensors += layer(f"blk.{i}.", i)
    return tensors + [
        *before_output,
        TensorSpec("output_norm.weight", (n_embd,), F32, Fill.ONES),
        TensorSpec("output.weight", (n_embd, vocab), qtype, Fill.WEIGHT),
    ]


def _gated_ffn(b: str, suffix: str, n_embd: int, n_ff: int, qtype: GGMLQuantizationType) -> list[TensorSpec]:
    """ffn_gate/up/down (suffix "" for a dense FFN, "_shexp" for a shared expert)."""
    return [
        TensorSpec(b + f"ffn_gate{suffix}.weight", (n_embd, n_ff), qtype, Fill.WEIGHT),
        TensorSpec(b + f"ffn_up{suffix}.weight", (n_embd, n_ff), qtype, Fill.WEIGHT),
        TensorSpec(b + f"ffn_down{suffix}.weight", (n_ff, n_embd), qtype, Fill.WEIGHT),
    ]


def _mla_tensors(b: str, d: Deepseek2Dims, qtype: GGMLQuantizationType) -> list[TensorSpec]:
    """MLA's low-rank q and compressed kv as llama.cpp's converters write them (kv_b split into
    attn_k_b / attn_v_b): deepseek2 and kimi-k3 alike."""
    return [
        TensorSpec(b + "attn_q_a.weight", (d.n_embd, d.q_lora), qtype, Fill.WEIGHT),
        TensorSpec(b + "attn_q_a_norm.weight", (d.q_lora,), F32, Fill.ONES),
        TensorSpec(b + "attn_q_b.weight", (d.q_lora, d.n_head * (d.qk_nope + d.qk_rope)), qtype, Fill.WEIGHT),
        TensorSpec(b + "attn_kv_a_mqa.weight", (d.n_embd, d.kv_lora + d.qk_rope), qtype, Fill.WEIGHT),
        TensorSpec(b + "attn_kv_a_norm.weight", (d.kv_lora,), F32, Fill.ONES),
        TensorSpec(b + "attn_k_b.weight", (d.qk_nope, d.kv_lora, d.n_head), qtype, Fill.WEIGHT),
        TensorSpec(b + "attn_v_b.weight", (d.kv_lora, d.v_head, d.n_head), qtype, Fill.WEIGHT),
    ]


def _routed_experts(
    b: str, d: Deepseek2Dims, width: int, router_bias: Fill, gate_up: GGMLQuantizationType, down: GGMLQuantizationType,
) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """(the router, the routed experts' gate/up/down at `width`) of an MoE layer."""
    router = [
        TensorSpec(b + "ffn_gate_inp.weight", (d.n_embd, d.n_expert), F32, Fill.ROUTER),
        TensorSpec(b + "exp_probs_b.bias", (d.n_expert,), F32, router_bias),
    ]
    experts = [
        TensorSpec(b + "ffn_gate_exps.weight", (width, d.n_ff_exp, d.n_expert), gate_up, Fill.WEIGHT),
        TensorSpec(b + "ffn_up_exps.weight", (width, d.n_ff_exp, d.n_expert), gate_up, Fill.WEIGHT),
        TensorSpec(b + "ffn_down_exps.weight", (d.n_ff_exp, width, d.n_expert), down, Fill.WEIGHT),
    ]
    return router, experts


def _moe_description(d: Deepseek2Dims) -> str:
    return f"{d.n_expert} experts ({d.n_expert_used} used, {d.n_expert_shared} shared) of n_ff {d.n_ff_exp}"


# --- llama ------------------------------------------------------------------------------------


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
    kv = _head_kv(a, v, d) + [
        (f"{a}.attention.head_count_kv", d.n_head_kv, U32),
        (f"{a}.rope.dimension_count", d.head_dim, U32),
        (f"{a}.rope.freq_base", 500000.0, FLOAT32),
        (f"{a}.attention.layer_norm_rms_epsilon", 1e-5, FLOAT32),
    ]
    kv_width = d.n_head_kv * d.head_dim

    def layer(b: str, _: int) -> list[TensorSpec]:
        return [
            TensorSpec(b + "attn_norm.weight", (d.n_embd,), F32, Fill.ONES),
            TensorSpec(b + "attn_q.weight", (d.n_embd, d.n_embd), qtype, Fill.WEIGHT),
            TensorSpec(b + "attn_k.weight", (d.n_embd, kv_width), qtype, Fill.WEIGHT),
            TensorSpec(b + "attn_v.weight", (d.n_embd, kv_width), qtype, Fill.WEIGHT),
            TensorSpec(b + "attn_output.weight", (d.n_embd, d.n_embd), qtype, Fill.WEIGHT),
            TensorSpec(b + "ffn_norm.weight", (d.n_embd,), F32, Fill.ONES),
            *_gated_ffn(b, "", d.n_embd, d.n_ff, qtype),
        ]

    desc = (
        f"llama: {d.n_layer} layers, n_embd {d.n_embd}, n_ff {d.n_ff}, "
        f"{d.n_head} heads ({d.n_head_kv} kv), vocab {v}"
    )
    return model_spec(a, desc, kv, _model_tensors(d.n_embd, v, d.n_layer, qtype, layer), ftype, tok)


# --- deepseek2 (DeepSeek-V3, Kimi K2) ---------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
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
    qk_rope: int = 64  # K3's MLA is NoPE, but this still sizes K (the converter's note)
    v_head: int = 128


def deepseek2_spec(d: Deepseek2Dims, qtype: GGMLQuantizationType, ftype: LlamaFileType, tok: Tokenizer) -> ModelSpec:
    """DeepSeek-V3 / Kimi K2 layout as llama.cpp's converter writes it today: MLA with the
    kv_b projection split into attn_k_b / attn_v_b, sigmoid routing with exp_probs_b."""
    a, v = "deepseek2", tok.n_vocab
    kv = [
        *_head_kv(a, v, d),
        (f"{a}.attention.head_count_kv", 1, U32),  # MLA runs as one kv head (_mla_kv)
        *_mla_kv(a, d),
        (f"{a}.rope.freq_base", 50000.0, FLOAT32),
        *_moe_kv(a, d),
    ]
    n_shexp = d.n_ff_exp * d.n_expert_shared

    def layer(b: str, i: int) -> list[TensorSpec]:
        tensors = [
            TensorSpec(b + "attn_norm.weight", (d.n_embd,), F32, Fill.ONES),
            *_mla_tensors(b, d, qtype),
            TensorSpec(b + "attn_output.weight", (d.n_head * d.v_head, d.n_embd), qtype, Fill.WEIGHT),
            TensorSpec(b + "ffn_norm.weight", (d.n_embd,), F32, Fill.ONES),
        ]
        if i < d.n_dense_lead:
            return tensors + _gated_ffn(b, "", d.n_embd, d.n_ff, qtype)
        router, experts = _routed_experts(b, d, d.n_embd, Fill.ROUTER_BIAS, qtype, qtype)
        return tensors + router + experts + _gated_ffn(b, "_shexp", d.n_embd, n_shexp, qtype)

    desc = (
        f"deepseek2: {d.n_layer} layers ({d.n_dense_lead} dense), n_embd {d.n_embd}, {_moe_description(d)}, "
        f"dense n_ff {d.n_ff}, {d.n_head} heads, q/kv lora {d.q_lora}/{d.kv_lora}, vocab {v}"
    )
    return model_spec(a, desc, kv, _model_tensors(d.n_embd, v, d.n_layer, qtype, layer), ftype, tok)


# --- kimi-k3 ----------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class KimiK3Dims(Deepseek2Dims):
    """K2's dims (K3 keeps its MLA and experts), with KDA's and LatentMoE's. n_head counts
    KDA's heads and MLA's alike."""

    n_latent: int  # LatentMoE: routed experts run at this width
    kda_head_dim: int = 128
    conv_kernel: int = 4
    attn_res_block_size: int = 6

    def is_mla(self, layer: int) -> bool:
        """Full (MLA) attention on every fourth layer and on the last, KDA elsewhere: 24 MLA and
        69 KDA layers at 93, as the release; a cut keeps the rule (4 layers: 3 KDA, 1 MLA)."""
        return (layer + 1) % 4 == 0 or layer == self.n_layer - 1

    @property
    def kda_width(self) -> int:
        return self.n_head * self.kda_head_dim


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
    v = tok.n_vocab

    def layer(b: str, i: int) -> list[TensorSpec]:
        attention = _k3_mla_tensors(b, d, qtype) if d.is_mla(i) else _kda_tensors(b, d, qtype)
        if i < d.n_dense_lead:
            ffn = _gated_ffn(b, "", d.n_embd, d.n_ff, qtype)
        else:
            ffn = _latent_moe_tensors(b, d, qtype, experts)
        return [
            TensorSpec(b + "attn_norm.weight", (d.n_embd,), F32, Fill.ONES),
            TensorSpec(b + "attn_res_score.weight", (d.n_embd,), F32, Fill.SMALL),
            *attention,
            TensorSpec(b + "ffn_norm.weight", (d.n_embd,), F32, Fill.ONES),
            TensorSpec(b + "ffn_res_score.weight", (d.n_embd,), F32, Fill.SMALL),
            *ffn,
        ]

    tensors = _model_tensors(
        d.n_embd, v, d.n_layer, qtype, layer, [TensorSpec("output_res_score.weight", (d.n_embd,), F32, Fill.SMALL)]
    )
    n_mla = sum(d.is_mla(i) for i in range(d.n_layer))
    desc = (
        f"kimi-k3: {d.n_layer} layers ({d.n_layer - n_mla} KDA, {n_mla} MLA; {d.n_dense_lead} dense), n_embd {d.n_embd}, "
        f"{_moe_description(d)} at latent {d.n_latent} in {_type_names(experts)}, "
        f"one expert {format_bytes(k3_expert_bytes(d, experts))}, {d.n_head} heads, trunk {qtype.name}, vocab {v}"
    )
    return model_spec("kimi-k3", desc, _kimi_k3_kv(d, v), tensors, ftype, tok)


def _kimi_k3_kv(d: KimiK3Dims, vocab: int) -> list:
    a = "kimi-k3"
    return [
        *_head_kv(a, vocab, d),
        # 0 marks a KDA (recurrent) layer; MLA runs as one kv head over the compressed latent.
        (f"{a}.attention.head_count_kv", [1 if d.is_mla(i) else 0 for i in range(d.n_layer)], GGUFValueType.ARRAY),
        *_mla_kv(a, d),
        (f"{a}.ssm.conv_kernel", d.conv_kernel, U32),
        (f"{a}.kda.head_dim", d.kda_head_dim, U32),
        (f"{a}.kda.gate_lower_bound", -5.0, FLOAT32),
        *_moe_kv(a, d),
        (f"{a}.expert_latent_length", d.n_latent, U32),
        (f"{a}.activation.situ_beta", 8.0, FLOAT32),
        (f"{a}.activation.situ_linear_beta", 8.0, FLOAT32),
        (f"{a}.attn_res.block_size", d.attn_res_block_size, U32),
    ]


def _k3_mla_tensors(b: str, d: KimiK3Dims, qtype: GGMLQuantizationType) -> list[TensorSpec]:
    """Gated MLA: deepseek2's, with an output gate."""
    return [
        *_mla_tensors(b, d, qtype),
        TensorSpec(b + "attn_gate.weight", (d.n_embd, d.n_head * d.v_head), qtype, Fill.WEIGHT),
        TensorSpec(b + "attn_output.weight", (d.n_head * d.v_head, d.n_embd), qtype, Fill.WEIGHT),
    ]


def _kda_tensors(b: str, d: KimiK3Dims, qtype: GGMLQuantizationType) -> list[TensorSpec]:
    """Kimi Delta Attention: q, k, v through short convolutions, the forget gate's low-rank
    pair, per-head beta and decay, the output gate and its norm."""
    inner = d.kda_width
    return [
        TensorSpec(b + "ssm_conv1d_q.weight", (d.conv_kernel, 1, inner), F32, Fill.SMALL),
        TensorSpec(b + "ssm_conv1d_k.weight", (d.conv_kernel, 1, inner), F32, Fill.SMALL),
        TensorSpec(b + "ssm_conv1d_v.weight", (d.conv_kernel, 1, inner), F32, Fill.SMALL),
        TensorSpec(b + "attn_q.weight", (d.n_embd, inner), qtype, Fill.WEIGHT),
        TensorSpec(b + "attn_k.weight", (d.n_embd, inner), qtype, Fill.WEIGHT),
        TensorSpec(b + "attn_v.weight", (d.n_embd, inner), qtype, Fill.WEIGHT),
        TensorSpec(b + "ssm_f_a.weight", (d.n_embd, d.kda_head_dim), qtype, Fill.WEIGHT),
        TensorSpec(b + "ssm_f_b.weight", (d.kda_head_dim, inner), qtype, Fill.WEIGHT),
        TensorSpec(b + "ssm_beta.weight", (d.n_embd, d.n_head), F32, Fill.SMALL),
        TensorSpec(b + "ssm_a", (d.n_head,), F32, Fill.DECAY),
        TensorSpec(b + "ssm_dt.bias", (inner,), F32, Fill.ZEROS),
        TensorSpec(b + "ssm_g.weight", (d.n_embd, inner), qtype, Fill.WEIGHT),
        TensorSpec(b + "ssm_norm.weight", (d.kda_head_dim,), F32, Fill.ONES),
        TensorSpec(b + "attn_output.weight", (inner, d.n_embd), qtype, Fill.WEIGHT),
    ]


def _latent_moe_tensors(
    b: str, d: KimiK3Dims, qtype: GGMLQuantizationType, experts: tuple[GGMLQuantizationType, GGMLQuantizationType],
) -> list[TensorSpec]:
    """LatentMoE: the router on n_embd, the routed experts between a projection down to the
    latent width and one back up, the shared experts fused into one FFN at n_embd."""
    router, routed = _routed_experts(b, d, d.n_latent, Fill.FLAT_ROUTER_BIAS, *experts)
    return [
        *router,
        TensorSpec(b + "ffn_routed_down.weight", (d.n_embd, d.n_latent), qtype, Fill.WEIGHT),
        *routed,
        TensorSpec(b + "ffn_routed_norm.weight", (d.n_latent,), F32, Fill.ONES),
        TensorSpec(b + "ffn_routed_up.weight", (d.n_latent, d.n_embd), qtype, Fill.WEIGHT),
        *_gated_ffn(b, "_shexp", d.n_embd, d.n_ff_exp * d.n_expert_shared, qtype),
    ]


def k3_expert_bytes(d: KimiK3Dims, experts=(MXFP4, MXFP4)) -> int:
    """One routed expert's bytes: gate and up of the first type, down of the second."""

    def matrix(qtype) -> int:
        block, size = GGML_QUANT_SIZES[qtype]
        return d.n_latent * d.n_ff_exp // block * size

    return 2 * matrix(experts[0]) + matrix(experts[1])


def _type_names(experts) -> str:
    gate_up, down = experts
    return gate_up.name if gate_up == down else f"{gate_up.name} (gate, up) and {down.name} (down)"
