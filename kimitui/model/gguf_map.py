"""Where every weight of a GGUF lives: file, byte range, layer, role; grouped into shards.

The streaming engine reads weights by byte range, so this map answers the questions it
asks: which ranges make up layer L, which range is expert E of layer L, which ranges are
the trunk every token needs. Single files and llama.cpp split sets
(`name-0000N-of-0000M.gguf`) are handled alike; offsets are absolute within each file.
"""

from __future__ import annotations

import errno
import os
import re
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Iterable

from kimitui.config import key_spec
from kimitui.errors import UserError
from kimitui.units import format_bytes

# engine.shard_size's default and bounds, as the config has them.
DEFAULT_SHARD_SIZE = key_spec("engine.shard_size").default
MIN_SHARD_SIZE, MAX_SHARD_SIZE = (int(b) for b in key_spec("engine.shard_size").bounds)

ATTENTION = "attention"
DENSE_FFN = "dense_ffn"
ROUTED_EXPERTS = "routed_experts"
SHARED_EXPERTS = "shared_experts"
ROUTER = "router"
NORM = "norm"
EMBEDDING = "embedding"
OUTPUT = "output"
OTHER = "other"  # names no rule knows (rope_freqs, MTP heads, ...): kept, counted as trunk
ROLES = (ATTENTION, DENSE_FFN, ROUTED_EXPERTS, SHARED_EXPERTS, ROUTER, NORM, EMBEDDING, OUTPUT, OTHER)

_SPLIT_RE = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
_LAYER_RE = re.compile(r"^blk\.(?P<layer>\d+)\.(?P<base>[^.]+)")


def classify(name: str) -> tuple[int | None, str]:
    """(layer index or None, role) from a llama.cpp tensor name."""
    match = _LAYER_RE.match(name)
    if match is None:
        base = name.split(".", 1)[0]
        if "norm" in base:
            return None, NORM
        if base == "output":
            return None, OUTPUT
        if "embd" in base:
            return None, EMBEDDING
        return None, OTHER
    layer, base = int(match["layer"]), match["base"]
    if "norm" in base:
        role = NORM
    elif "exps" in base:  # ffn_{gate,up,down,gate_up}_exps and their biases: one slice per expert
        role = ROUTED_EXPERTS
    elif "shexp" in base:
        role = SHARED_EXPERTS
    elif base.startswith("ffn_gate_inp") or base == "exp_probs_b":
        role = ROUTER
    elif base.startswith("attn"):
        role = ATTENTION
    elif base.startswith("ffn"):
        role = DENSE_FFN
    else:
        role = OTHER
    return layer, role


@dataclass(frozen=True)
class ByteRange:
    file: int  # index into ModelMap.files
    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True)
class TensorInfo:
    index: int
    name: str
    file: int
    offset: int  # absolute byte offset of the data in its file
    n_bytes: int
    layer: int | None
    role: str
    ggml_type: str
    shape: tuple[int, ...]  # ggml order: ne0 (contiguous) first
    n_expert: int = 0  # routed-expert tensors only: the last ggml dimension

    @property
    def range(self) -> ByteRange:
        return ByteRange(self.file, self.offset, self.n_bytes)

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert's slice: the expert index is the outermost dimension."""
        return self.n_bytes // self.n_expert if self.n_expert else 0

    def expert_range(self, expert: int) -> ByteRange:
        if not 0 <= expert < self.n_expert:
            raise IndexError(f"{self.name}: expert {expert} not in 0..{self.n_expert - 1}")
        size = self.expert_bytes
        return ByteRange(self.file, self.offset + expert * size, size)


@dataclass(frozen=True)
class Shard:
    index: int
    file: int
    offset: int
    length: int  # the whole range, alignment padding between its tensors included
    tensor_bytes: int
    layer: int | None
    routed: bool  # holds routed-expert tensors only; shards never mix them with trunk tensors
    tensors: tuple[int, ...]  # indices into ModelMap.tensors, in file order

    @property
    def range(self) -> ByteRange:
        return ByteRange(self.file, self.offset, self.length)


@dataclass(frozen=True)
class LayerInfo:
    index: int
    n_bytes: int
    trunk_bytes: int
    routed_bytes: int
    n_expert: int  # 0 for a dense layer
    expert_bytes: int  # one expert's bytes over all its routed tensors in this layer
    shards: tuple[int, ...]

    @property
    def is_moe(self) -> bool:
        return self.n_expert > 0


@dataclass(frozen=True)
class ModelMap:
    files: tuple[Path, ...]
    file_sizes: tuple[int, ...]
    architecture: str
    name: str
    n_expert_used: int
    n_expert_shared: int
    tensors: tuple[TensorInfo, ...]
    shard_size: int
    shards: tuple[Shard, ...] = field(repr=False)
    layers: tuple[LayerInfo, ...] = field(repr=False)
    alignment: int = 32  # GGUF data alignment: the most padding that separates adjacent tensors
    hparams: dict = field(default_factory=dict, repr=False, compare=False)  # the `{arch}.*` keys

    # --- totals -------------------------------------------------------------------------
    @cached_property
    def tensor_bytes(self) -> int:
        return sum(t.n_bytes for t in self.tensors)

    @cached_property
    def routed_bytes(self) -> int:
        return sum(t.n_bytes for t in self.tensors if t.role == ROUTED_EXPERTS)

    @property
    def trunk_bytes(self) -> int:
        """Everything but routed experts: what a streaming engine wants pinned first."""
        return self.tensor_bytes - self.routed_bytes

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def is_moe(self) -> bool:
        return any(layer.is_moe for layer in self.layers)

    @property
    def n_expert(self) -> int:
        return max((layer.n_expert for layer in self.layers), default=0)

    @cached_property
    def bytes_per_expert(self) -> int:
        """One expert of one MoE layer (all its routed tensors); 0 for a dense model."""
        return max((layer.expert_bytes for layer in self.layers), default=0)

    @cached_property
    def nonlayer_bytes(self) -> int:
        return sum(t.n_bytes for t in self.tensors if t.layer is None)

    @cached_property
    def _embedding_split(self) -> tuple[int, int]:
        """(table bytes, bytes one token reads) of token embeddings read row by row.

        A token reads one row of the table (get_rows); a table that doubles as the output
        matrix (no `output` tensor: tied embeddings) is read whole, so it is plain trunk
        and counts as (0, 0) here."""
        if any(t.role == OUTPUT for t in self.tensors):
            tables = [t for t in self.tensors if t.role == EMBEDDING and len(t.shape) == 2]
            return sum(t.n_bytes for t in tables), sum(t.n_bytes // t.shape[1] for t in tables)
        return 0, 0

    @property
    def active_bytes_per_token(self) -> int:
        """Bytes one token's forward pass touches: the trunk (one embedding row) plus
        n_expert_used experts in every MoE layer; all of a dense model but the embedding rows."""
        table, row = self._embedding_split
        experts = sum(self.n_expert_used * layer.expert_bytes for layer in self.layers if layer.is_moe)
        return self.trunk_bytes - table + row + experts

    def retyped(self, types: dict[int, tuple[str, int]]) -> ModelMap:
        """This model with some tensors in other types ({tensor index: (ggml type, bytes)}),
        each file's tensors packed from where its data starts now: a requantized copy's map,
        planned before it is written (the copy's header may differ by a few bytes, so its
        offsets may too; sizes, shards and layers are what the plan reads)."""
        tensors: list[TensorInfo] = []
        sizes: list[int] = []
        for file in range(len(self.files)):
            in_file = sorted((t for t in self.tensors if t.file == file), key=lambda t: t.offset)
            at = min((t.offset for t in in_file), default=self.file_sizes[file])
            for t in in_file:
                ggml_type, n_bytes = types.get(t.index, (t.ggml_type, t.n_bytes))
                tensors.append(replace(t, offset=at, ggml_type=ggml_type, n_bytes=n_bytes))
                at += -(-n_bytes // self.alignment) * self.alignment
            sizes.append(at if in_file else self.file_sizes[file])
        frozen = tuple(sorted(tensors, key=lambda t: t.index))
        shards = group_shards(frozen, self.shard_size)
        return replace(self, tensors=frozen, file_sizes=tuple(sizes), shards=shards, layers=_layer_infos(frozen, shards, self.n_layers))

    def read_bytes_per_token(self, budget: int) -> int:
        """Bytes a token must read from storage when `budget` bytes stay pinned."""
        return sum(self.read_split_per_token(budget))

    def read_split_per_token(self, budget: int) -> tuple[int, int]:
        """(trunk bytes, routed-expert bytes) a token must read from storage when `budget`
        bytes stay pinned, pinned in order of use per byte: the trunk every token walks, then
        routed experts (uniform routing: a pinned expert byte saves n_used/n_expert of a byte
        per token), then the embedding table (one row per token). The two are apart because
        they are read differently: the trunk in long runs, experts in small scattered slices."""
        table, row = self._embedding_split
        every_token = self.trunk_bytes - table
        left = max(0, budget)
        pinned = min(left, every_token)
        trunk = every_token - pinned
        left -= pinned
        experts = 0
        expert_active = self.active_bytes_per_token - every_token - row
        if self.routed_bytes:
            pinned = min(left, self.routed_bytes)
            experts = expert_active - expert_active * pinned // self.routed_bytes
            left -= pinned
        if left < table:
            trunk += row
        return trunk, experts

    @property
    def expert_slice_bytes(self) -> int | None:
        """A typical piece of one expert in one tensor: the size of an expert read."""
        layer = next((i for i, info in enumerate(self.layers) if info.is_moe), None)
        if layer is None:
            return None
        lengths = sorted(r.length for r in self.expert_ranges(layer, 0))
        return lengths[len(lengths) // 2]

    def tok_s_floor(self, bandwidth: float, budget: int) -> float | None:
        """Tokens/s that reading the unpinned active bytes at `bandwidth` B/s allows; None
        when nothing needs reading (compute-bound)."""
        read = self.read_bytes_per_token(budget)
        return None if read == 0 else bandwidth / read

    # --- what a streaming engine asks ---------------------------------------------------
    @cached_property
    def _by_name(self) -> dict[str, TensorInfo]:
        return {t.name: t for t in self.tensors}

    @cached_property
    def _by_layer(self) -> dict[int | None, tuple[TensorInfo, ...]]:
        # the engine asks per layer and per expert on every token: index once
        groups: dict[int | None, list[TensorInfo]] = {}
        for t in self.tensors:
            groups.setdefault(t.layer, []).append(t)
        return {layer: tuple(ts) for layer, ts in groups.items()}

    def tensor(self, name: str) -> TensorInfo:
        return self._by_name[name]

    def layer_tensors(self, layer: int) -> tuple[TensorInfo, ...]:
        self._check_layer(layer)
        return self._by_layer.get(layer, ())

    def layer_ranges(self, layer: int, *, experts: bool = True) -> list[ByteRange]:
        """Byte ranges holding layer `layer`, adjacent tensors merged; `experts=False`
        leaves out the routed experts (the layer's trunk)."""
        chosen = [t.range for t in self.layer_tensors(layer) if experts or t.role != ROUTED_EXPERTS]
        return merge_ranges(chosen, gap=self.alignment)

    def nonlayer_ranges(self) -> list[ByteRange]:
        """Embeddings, output and final norm: no layer's, every token's."""
        return merge_ranges([t.range for t in self._by_layer.get(None, ())], gap=self.alignment)

    @cached_property
    def _routed_by_layer(self) -> dict[int | None, tuple[TensorInfo, ...]]:
        # Asked for thousands of times a prompt (an expert's slices), so found once.
        return {layer: tuple(t for t in tensors if t.role == ROUTED_EXPERTS) for layer, tensors in self._by_layer.items()}

    def routed_tensors(self, layer: int) -> tuple[TensorInfo, ...]:
        """`layer`'s routed expert tensors (gate, up, down, ...), in file order."""
        self._check_layer(layer)
        return self._routed_by_layer.get(layer, ())

    def expert_ranges(self, layer: int, expert: int) -> list[ByteRange]:
        """One range per routed tensor of `layer` (gate, up, down, ...) for expert `expert`."""
        routed = self.routed_tensors(layer)
        if not routed:
            raise IndexError(f"layer {layer} has no routed experts")
        return [t.expert_range(expert) for t in routed]

    def moe_layers_from(self, layer: int) -> list[int]:
        """The MoE layers from ``layer`` on (itself included), in order."""
        return [i for i in range(layer, len(self.layers)) if self.layers[i].is_moe]

    def layer_shards(self, layer: int | None) -> list[Shard]:
        return [s for s in self.shards if s.layer == layer]

    def regroup(self, shard_size: int) -> ModelMap:
        """The same tensors grouped for another shard size (a live tuning knob)."""
        shards = group_shards(self.tensors, shard_size)
        return replace(self, shard_size=shard_size, shards=shards, layers=_layer_infos(self.tensors, shards, len(self.layers)))

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < len(self.layers):
            raise IndexError(f"layer {layer} not in 0..{len(self.layers) - 1}")


def merge_ranges(ranges: Iterable[ByteRange], gap: int = 0) -> list[ByteRange]:
    """Sort and merge ranges of one file that touch or sit less than `gap` bytes apart
    (alignment padding), so a reader issues fewer, larger requests."""
    merged: list[ByteRange] = []
    for r in sorted(ranges, key=lambda r: (r.file, r.offset)):
        last = merged[-1] if merged else None
        if last is not None and last.file == r.file and r.offset <= last.end + max(gap - 1, 0):
            merged[-1] = ByteRange(last.file, last.offset, max(last.end, r.end) - last.offset)
        else:
            merged.append(r)
    return merged


def check_shard_size(size: int) -> int:
    if not MIN_SHARD_SIZE <= size <= MAX_SHARD_SIZE:
        raise UserError(
            f"shard size {format_bytes(size)} is outside {format_bytes(MIN_SHARD_SIZE)}.."
            f"{format_bytes(MAX_SHARD_SIZE)}"
        )
    return size


def group_shards(tensors: tuple[TensorInfo, ...], shard_size: int) -> tuple[Shard, ...]:
    """Consecutive tensors (file order) of one file, one layer and one kind (trunk or
    routed experts) fill a shard up to `shard_size`; a bigger tensor is a shard of its own."""
    check_shard_size(shard_size)
    shards: list[Shard] = []
    current: list[TensorInfo] = []

    def close() -> None:
        if current:
            first, last = current[0], current[-1]
            shards.append(
                Shard(
                    index=len(shards),
                    file=first.file,
                    offset=first.offset,
                    length=last.offset + last.n_bytes - first.offset,
                    tensor_bytes=sum(t.n_bytes for t in current),
                    layer=first.layer,
                    routed=first.role == ROUTED_EXPERTS,
                    tensors=tuple(t.index for t in current),
                )
            )
            current.clear()

    for t in sorted(tensors, key=lambda t: (t.file, t.offset)):
        if current:
            head = current[0]
            same_group = (
                head.file == t.file
                and head.layer == t.layer
                and (head.role == ROUTED_EXPERTS) == (t.role == ROUTED_EXPERTS)
            )
            if not same_group or t.offset + t.n_bytes - head.offset > shard_size:
                close()
        current.append(t)
    close()
    return tuple(shards)


def _layer_infos(tensors: tuple[TensorInfo, ...], shards: tuple[Shard, ...], n_layers: int) -> tuple[LayerInfo, ...]:
    own: list[list[TensorInfo]] = [[] for _ in range(n_layers)]
    for t in tensors:
        if t.layer is not None:
            own[t.layer].append(t)
    layer_shards: list[list[int]] = [[] for _ in range(n_layers)]
    for s in shards:
        if s.layer is not None:
            layer_shards[s.layer].append(s.index)
    infos = []
    for layer, ts in enumerate(own):
        routed = [t for t in ts if t.role == ROUTED_EXPERTS]
        routed_bytes = sum(t.n_bytes for t in routed)
        total = sum(t.n_bytes for t in ts)
        infos.append(
            LayerInfo(
                index=layer,
                n_bytes=total,
                trunk_bytes=total - routed_bytes,
                routed_bytes=routed_bytes,
                n_expert=max((t.n_expert for t in routed), default=0),
                expert_bytes=sum(t.expert_bytes for t in routed),
                shards=tuple(layer_shards[layer]),
            )
        )
    return tuple(infos)


# --- reading ------------------------------------------------------------------------------


def split_name(prefix: str, number: int, count: int) -> str:
    """File `number` (from 1) of a split set of `count`, named as llama.cpp's llama_split_path."""
    return f"{prefix}-{number:05d}-of-{count:05d}.gguf"


def split_names(path: Path) -> list[str] | None:
    """The names of every file of the split set `path` names, in order; None for a single file.
    UserError where its numbering makes no sense."""
    match = _SPLIT_RE.match(path.name)
    if match is None:
        return None
    count = int(match["count"])
    if count < 1 or not 1 <= int(match["no"]) <= count:
        raise UserError(f"{path}: split number {match['no']} of {match['count']} makes no sense")
    return [split_name(match["prefix"], i, count) for i in range(1, count + 1)]


def split_set(path: Path) -> list[Path]:
    """All files of the split set `path` belongs to (just `path` for a single file)."""
    if not path.exists():
        raise UserError(f"model file not found: {path}")
    names = split_names(path)
    if names is None:
        return [path]
    count = len(names)
    files = [path.with_name(name) for name in names]
    missing = [f for f in files if not f.exists()]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise UserError(f"split set of {count} files is incomplete: {missing[0]} is missing{more}")
    return files


def _open_reader(path: Path, arrays: bool = False):
    """A GGUFReader over `path`'s header. Without `arrays`, array values (the vocabulary,
    merges, scores: most of a header) are stepped over, not parsed: their fields keep one raw
    part and render as empty lists. Only rewriting a file (shard) needs them."""
    import struct

    import numpy as np
    from gguf import GGUFReader, GGUFValueType  # heavy import (numpy); only when a model is opened

    class HeaderReader(GGUFReader):
        # GGUFReader parses a field as numpy views of its np.memmap, one per vocabulary
        # string; views of a memmap subclass cost 3-4x those of a plain array (1.2 s instead
        # of 4 s for a 49k vocabulary here), so it gets a plain array over the same mapping.
        @property
        def data(self):
            return self._data

        @data.setter
        def data(self, value):
            self._data = value.view(np.ndarray)

        # GGUFReader parses an array element by element (a numpy view each): 0.8 s for a 49k
        # vocabulary, seconds for Kimi's 160k, on every start. Stepping over one costs a
        # length read per string.
        def _get_field_parts(self, orig_offs, raw_type):  # noqa: ANN001 - gguf's own hook
            if arrays or raw_type != GGUFValueType.ARRAY:
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype = self._get(orig_offs, np.uint32)
            alen = self._get(orig_offs + 4, np.uint64)
            start = offs = orig_offs + 12
            itype, count = GGUFValueType(int(raw_itype[0])), int(alen[0])
            if itype != GGUFValueType.STRING and count <= 4096:  # per-layer hyperparameters: cheap, and needed
                return super()._get_field_parts(orig_offs, raw_type)
            if itype == GGUFValueType.STRING:
                view, length = memoryview(self._data), struct.Struct(alen.dtype.str[0] + "Q")
                for _ in range(count):
                    offs += 8 + length.unpack_from(view, offs)[0]
            elif itype in self.gguf_scalar_to_np:
                offs += count * np.dtype(self.gguf_scalar_to_np[itype]).itemsize
            else:  # nested arrays: rare and small; parse them the library's way
                return super()._get_field_parts(orig_offs, raw_type)
            skipped = self._get(start, np.uint8, offs - start)
            return offs - orig_offs, [raw_itype, alen, skipped], [], [GGUFValueType.ARRAY, itype]

        # GGUFReader builds a numpy view per tensor, which fails without naming the tensor
        # on a truncated file; keep the raw tensor infos and check bounds ourselves.
        def _build_tensors(self, start_offs, fields):  # noqa: ANN001 - gguf's own hook
            self.tensor_fields = fields

    try:
        with path.open("rb") as fh:
            magic = fh.read(4)
        size = path.stat().st_size
    except OSError as exc:
        raise UserError(f"cannot read model file {path}: {exc.strerror}") from None
    if magic != b"GGUF":
        raise UserError(f"{path}: not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    window = min(size, HEADER_WINDOW)
    while True:
        try:
            with path.open("rb") as fh:
                reader = HeaderReader(_FileWindow(fh, window), "r")
            if reader.data_offset <= window or window >= size:
                return reader  # past the file's end: tensor_layout says which tensor is cut
        except OSError as exc:
            if exc.errno == errno.ENOMEM:
                raise UserError(
                    f"{path}: cannot map {format_bytes(window)} to read its header: this process's address space is full "
                    f"({exc.strerror}; ulimit -v, or the platform's ceiling)"
                ) from None
            raise UserError(f"cannot read model file {path}: {exc.strerror}") from None
        except Exception as exc:  # the gguf package raises ValueError, IndexError, ... on damage
            if window >= size:
                raise UserError(f"{path}: corrupt or truncated GGUF header ({type(exc).__name__}: {exc})") from None
        window = min(size, window * 4)  # a header larger than the window: look further


# How much of a file the header is first read through: Kimi K3's, vocabulary included, is a few
# MB. Never the whole file: a 1.5 TB model mapped whole would not fit a phone's address space.
HEADER_WINDOW = 64 * 2**20


class _FileWindow:
    """The first ``size`` bytes of an open file, as np.memmap sees a file: it maps up to where
    ``tell()`` says the file ends, so the header is read through a bounded mapping."""

    def __init__(self, fh, size: int) -> None:
        self._fh, self._size = fh, size

    def read(self, *args):
        return self._fh.read(*args)

    def fileno(self) -> int:
        return self._fh.fileno()

    def seek(self, offset: int, whence: int = 0) -> int:
        return min(self._fh.seek(offset, whence), self._size)

    def tell(self) -> int:
        return min(self._fh.tell(), self._size)


def field_value(reader, key: str):
    f = reader.fields.get(key)
    if f is None:
        return None
    try:
        return f.contents()
    except Exception:  # a field of a type this gguf version cannot render: treat as absent
        return None


def tensor_layout(reader, file: Path, size: int):
    """(name, ggml type, shape, bytes, absolute offset) of each tensor of one file, checked as
    llama.cpp will: known type, each right after the one before (padded to the alignment),
    none past the end of the file. UserError naming file and tensor otherwise."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    alignment = int(reader.alignment)
    expected = 0
    for info in reader.tensor_fields:
        _, name_data, _, dims, raw_dtype, rel_offset = info.parts
        name = bytes(name_data).decode("utf-8", errors="replace")
        try:
            qtype = GGMLQuantizationType(int(raw_dtype[0]))
        except ValueError:
            raise UserError(f"{file}: tensor {name} has unknown type {int(raw_dtype[0])}") from None
        shape = tuple(int(d) for d in dims)
        n_elements = 1
        for d in shape:
            n_elements *= d
        block, type_size = GGML_QUANT_SIZES[qtype]
        n_bytes = n_elements // block * type_size
        relative = int(rel_offset[0])
        if relative != expected:
            raise UserError(
                f"{file}: tensor {name} starts at data offset {relative}, but the tensors before it "
                f"end at {expected} (damaged header?)"
            )
        expected += -(-n_bytes // alignment) * alignment
        offset = reader.data_offset + relative
        if offset + n_bytes > size:
            raise UserError(
                f"{file}: tensor {name} ends at byte {offset + n_bytes} but the file has "
                f"{size} bytes (truncated copy?)"
            )
        yield name, qtype, shape, n_bytes, offset


@dataclass(frozen=True)
class _ModelKeys:
    """What the first file's keys say about the whole model."""

    arch: str
    name: str
    block_count: int | None
    expert_count: int | None
    expert_used_count: int | None
    expert_shared_count: int | None
    alignment: int
    hparams: dict  # the `{arch}.*` keys

    @classmethod
    def read(cls, reader, first_file: Path) -> _ModelKeys:
        arch = field_value(reader, "general.architecture") or "unknown"
        return cls(
            arch=arch,
            name=field_value(reader, "general.name") or first_file.stem,
            block_count=field_value(reader, f"{arch}.block_count"),
            expert_count=field_value(reader, f"{arch}.expert_count"),
            expert_used_count=field_value(reader, f"{arch}.expert_used_count"),
            expert_shared_count=field_value(reader, f"{arch}.expert_shared_count"),
            alignment=int(reader.alignment),
            hparams={key: field_value(reader, key) for key in reader.fields if key.startswith(f"{arch}.")},
        )


def load_model_map(path: Path | str, shard_size: int = DEFAULT_SHARD_SIZE) -> ModelMap:
    """Parse `path` (a single GGUF or any file of a split set) into a ModelMap."""
    check_shard_size(shard_size)
    files = split_set(Path(path))
    tensors: list[TensorInfo] = []
    sizes: list[int] = []
    keys: _ModelKeys | None = None
    seen: set[str] = set()
    for file_index, file in enumerate(files):
        reader = _open_reader(file)
        sizes.append(os.path.getsize(file))
        if len(files) > 1:
            _check_split_number(reader, file, file_index, len(files))
        if keys is None:
            keys = _ModelKeys.read(reader, file)
        tensors += _file_tensors(reader, file, file_index, sizes[-1], len(tensors), seen)
    assert keys is not None  # a split set has at least one file
    n_layers = _check_counts(tensors, keys, files[0])
    routed = any(t.n_expert for t in tensors)
    frozen = tuple(tensors)
    shards = group_shards(frozen, shard_size)
    return ModelMap(
        files=tuple(files),
        file_sizes=tuple(sizes),
        architecture=str(keys.arch),
        name=str(keys.name),
        n_expert_used=int(keys.expert_used_count or 0) if routed else 0,
        n_expert_shared=int(keys.expert_shared_count or 0),
        tensors=frozen,
        shard_size=shard_size,
        shards=shards,
        layers=_layer_infos(frozen, shards, n_layers),
        alignment=keys.alignment,
        hparams=keys.hparams,
    )


def _check_split_number(reader, file: Path, file_index: int, n_files: int) -> None:
    split_no, split_count = field_value(reader, "split.no"), field_value(reader, "split.count")
    if split_count is not None and (split_count != n_files or split_no != file_index):
        raise UserError(
            f"{file}: says it is split {split_no} of {split_count}, its name says "
            f"{file_index} of {n_files} (files from different sets?)"
        )


def _file_tensors(reader, file: Path, file_index: int, size: int, first_index: int, seen: set[str]) -> list[TensorInfo]:
    """The tensors of one file of the model, indexed from `first_index`; UserError for a name
    already `seen` (which gains this file's)."""
    out: list[TensorInfo] = []
    for tname, qtype, shape, n_bytes, offset in tensor_layout(reader, file, size):
        if tname in seen:
            raise UserError(f"{file}: tensor {tname} appears twice")
        seen.add(tname)
        layer, role = classify(tname)
        n_expert = shape[-1] if role == ROUTED_EXPERTS and len(shape) >= 2 else 0
        if n_expert and n_bytes % n_expert:
            raise UserError(f"{file}: routed tensor {tname} does not split into {n_expert} equal experts")
        out.append(
            TensorInfo(
                index=first_index + len(out),
                name=tname,
                file=file_index,
                offset=offset,
                n_bytes=n_bytes,
                layer=layer,
                role=role,
                ggml_type=qtype.name,
                shape=shape,
                n_expert=n_expert,
            )
        )
    return out


def _check_counts(tensors: list[TensorInfo], keys: _ModelKeys, first_file: Path) -> int:
    """The model's layer count, once the tensors agree with the keys' layer and expert counts."""
    if not tensors:
        raise UserError(f"{first_file}: the GGUF holds no tensors")
    arch = keys.arch
    max_layer = max((t.layer for t in tensors if t.layer is not None), default=-1)
    n_layers = int(keys.block_count) if keys.block_count is not None else max_layer + 1
    if max_layer >= n_layers:
        raise UserError(f"{first_file}: tensor of layer {max_layer} but {arch}.block_count is {n_layers}")
    routed_counts = {t.n_expert for t in tensors if t.n_expert}
    if routed_counts:
        if keys.expert_count is not None and routed_counts != {int(keys.expert_count)}:
            raise UserError(
                f"{first_file}: routed tensors hold {sorted(routed_counts)} experts, {arch}.expert_count says {keys.expert_count}"
            )
        if not keys.expert_used_count:
            raise UserError(f"{first_file}: MoE model without {arch}.expert_used_count")
    return n_layers
