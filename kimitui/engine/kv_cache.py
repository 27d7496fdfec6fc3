"""How a llama.cpp context caches keys and values, and what that costs.

Speculation (speculation.py) checks drafted tokens in one batch, and its replies are plain
decoding's only where a token computed in a batch gets, to the bit, the logits it would get
alone. ggml-cpu's flash attention computes a query row by row over every cell, except over F16
or F32 keys: there a lone query over 512 cells or more (past 256 tokens, llama.cpp padding to
256) is split over the threads, and 64 queries or more are tiled, each rounding otherwise
(`use_split_kv_path`, `use_tiled` in ggml-cpu's ops.cpp; its `use_ref`, which would turn both
off, is out of reach of llama.cpp's API). Without flash attention a batch's attention rounds
through F16 otherwise than a lone token's. So a context that may check drafts caches keys and
values as Q8_0 with flash attention: every query takes the row-by-row loop, and the cache is
about half of F16's. llama.cpp refuses Q8_0 where a head's size is not a multiple of its
32-value blocks; such a model caches BF16 instead, whose loop is the same (docs/design.md,
"Speculative decoding").
"""

from __future__ import annotations

from dataclasses import dataclass

# ggml's type numbers (llama_cpp.GGML_TYPE_*), as llama.cpp's context parameters take them.
GGML_TYPE_Q8_0 = 8
GGML_TYPE_BF16 = 30
Q8_0_BLOCK = 32  # values in a Q8_0 block: 32 int8 and one F16 scale, 34 bytes


@dataclass(frozen=True)
class KVCache:
    name: str  # as saved states record it
    flash_attn: bool
    type_k: int | None  # a ggml type; None: llama.cpp's default, F16
    type_v: int | None
    value_bytes: float  # bytes a cached key or value takes
    batch_exact: bool  # a token computed in a batch gets the logits it gets alone, at any length

    def llama_params(self) -> dict:
        """llama_cpp.Llama's keyword arguments for this cache."""
        types = {"type_k": self.type_k, "type_v": self.type_v} if self.type_k is not None else {}
        return {"flash_attn": self.flash_attn, **types}


# llama-cpp-python's default.
PLAIN = KVCache("f16", flash_attn=False, type_k=None, type_v=None, value_bytes=2.0, batch_exact=False)
Q8_0 = KVCache("q8_0 with flash attention", flash_attn=True, type_k=GGML_TYPE_Q8_0, type_v=GGML_TYPE_Q8_0,
               value_bytes=(Q8_0_BLOCK + 2) / Q8_0_BLOCK, batch_exact=True)
BF16 = KVCache("bf16 with flash attention", flash_attn=True, type_k=GGML_TYPE_BF16, type_v=GGML_TYPE_BF16,
               value_bytes=2.0, batch_exact=True)


def head_sizes(kv: dict, arch: str) -> tuple[int, int]:
    """(a key head's values, a value head's), from the GGUF's keys as llama.cpp reads them."""
    n_head = int(kv.get(f"{arch}.attention.head_count", 0) or 0)
    n_embd = int(kv.get(f"{arch}.embedding_length", 0) or 0)
    head_dim = n_embd // n_head if n_head else 0
    k_len = int(kv.get(f"{arch}.attention.key_length", head_dim) or head_dim)
    v_len = int(kv.get(f"{arch}.attention.value_length", head_dim) or head_dim)
    return k_len, v_len


def for_drafts(kv: dict, arch: str) -> KVCache:
    """The cache of a context that may check drafts: Q8_0, or BF16 where a head's size is not
    a multiple of Q8_0's block."""
    return Q8_0 if all(size % Q8_0_BLOCK == 0 for size in head_sizes(kv, arch)) else BF16
