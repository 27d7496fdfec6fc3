"""What a synthetic model is made of: its tensors, its keys and the tokenizer it borrows,
and the exact size of the GGUF they make."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from functools import lru_cache
from typing import Any

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, LlamaFileType

from kimitui.errors import UserError

F32 = GGMLQuantizationType.F32
# Kimi K3 ships its routed experts in MXFP4 (17 bytes per 32 weights) whatever the trunk is.
MXFP4 = GGMLQuantizationType.MXFP4
IQ1_S, IQ2_XXS, IQ3_XXS = GGMLQuantizationType.IQ1_S, GGMLQuantizationType.IQ2_XXS, GGMLQuantizationType.IQ3_XXS
# i-quants: blocks of 256 weights, each led by its fp16 scale d.
IQ_TYPES = (IQ1_S, IQ2_XXS, GGMLQuantizationType.IQ2_XS, IQ3_XXS)
ALIGNMENT = 32  # GGUF default data alignment; GGUFWriter uses it too

class Fill(Enum):
    """How a tensor's bytes are made (blocks.py makes them)."""

    WEIGHT = "weight"  # a matrix from a block pool, std 1/sqrt(fan-in)
    EMBED = "embed"  # token embeddings from a block pool, std 1
    ONES = "ones"  # norm weights
    ROUTER = "router"  # ffn_gate_inp, f32, fresh random per layer
    ROUTER_BIAS = "router_bias"  # exp_probs_b, f32, Zipf-like per layer
    FLAT_ROUTER_BIAS = "flat_router_bias"  # exp_probs_b for a router trained for flat expert use (K3)
    SMALL = "small"  # f32 conv kernels and the residual-attention scores, std 1/sqrt(ne0)
    ZEROS = "zeros"  # f32 biases (ssm_dt.bias)
    DECAY = "decay"  # ssm_a: -exp(A_log), negative, per KDA head


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]  # ggml order: ne0 (contiguous, the dot-product axis) first
    qtype: GGMLQuantizationType
    fill: Fill

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)

    @property
    def n_bytes(self) -> int:
        block, type_size = GGML_QUANT_SIZES[self.qtype]
        return self.n_elements // block * type_size


@dataclass(frozen=True)
class Tokenizer:
    fields: tuple[tuple[str, Any, GGUFValueType, GGUFValueType | None], ...]
    n_vocab: int
    encoded_bytes: int  # the fields' exact size inside a GGUF header


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
        return pad(head) + sum(pad(t.n_bytes) for t in self.tensors)


def model_spec(arch: str, description: str, kv: list, tensors: list[TensorSpec], ftype: LlamaFileType, tok: Tokenizer) -> ModelSpec:
    """An architecture's keys and tensors, led by the general.* keys every GGUF has."""
    head = [
        ("general.architecture", arch, GGUFValueType.STRING),
        ("general.type", "model", GGUFValueType.STRING),
        ("general.name", f"kimitui synthetic {arch}", GGUFValueType.STRING),
        ("general.file_type", int(ftype), GGUFValueType.UINT32),
        ("general.quantization_version", 2, GGUFValueType.UINT32),
    ]
    return ModelSpec(arch, description, tuple(head + kv), tuple(tensors), tok)


def pad(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def _kv_bytes(key: str, value: Any, vtype: GGUFValueType) -> int:
    size = 8 + len(key.encode()) + 4
    if vtype == GGUFValueType.STRING:
        return size + 8 + len(str(value).encode())
    if vtype == GGUFValueType.ARRAY:  # only arrays of uint32 (per-layer head counts)
        return size + 4 + 8 + 4 * len(value)
    return size + {GGUFValueType.UINT32: 4, GGUFValueType.FLOAT32: 4, GGUFValueType.BOOL: 1}[vtype]


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
