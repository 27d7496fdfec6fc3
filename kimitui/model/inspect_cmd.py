"""`kimitui inspect MODEL`: what a GGUF costs to stream, before running it.

Layers, shards, trunk and expert sizes, the bytes one token touches, and what a disk of a
given bandwidth allows per second once a memory budget pins the most useful bytes.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kimitui.errors import UserError
from kimitui.model.gguf_map import DEFAULT_SHARD_SIZE, ModelMap, load_model_map
from kimitui.units import format_bytes, format_rate, parse_size


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", type=Path, help="GGUF file, or any file of a split set")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--shard-size", help="target shard size, 4MiB..1GiB (default 64MiB)")
    parser.add_argument("--bandwidth", default="1GB/s", help="storage read bandwidth, e.g. 400MB/s (default 1GB/s)")
    parser.add_argument("--budget", default="auto", help="memory for pinned weights, e.g. 6GiB (default: a safe share of available memory)")


def parse_bandwidth(text: str) -> float:
    """Bytes per second from `1GB/s`, `400MB/s` or a plain size per second."""
    raw = text.strip()
    if raw.lower().endswith("/s"):
        raw = raw[:-2]
    try:
        value = parse_size(raw)
    except ValueError as exc:
        raise UserError(f"--bandwidth: {exc}") from None
    if value <= 0:
        raise UserError("--bandwidth must be above zero")
    return float(value)


def _budget(text: str) -> int:
    if text.strip().lower() == "auto":
        from kimitui.engine.memory import default_budget

        return default_budget()
    try:
        return parse_size(text)
    except ValueError as exc:
        raise UserError(f"--budget: {exc}") from None


def summarize(m: ModelMap, bandwidth: float, budget: int) -> dict:
    read = m.read_bytes_per_token(budget)
    return {
        "files": [str(f) for f in m.files],
        "file_bytes": list(m.file_sizes),
        "name": m.name,
        "architecture": m.architecture,
        "tensor_bytes": m.tensor_bytes,
        "n_layers": m.n_layers,
        "n_moe_layers": sum(1 for layer in m.layers if layer.is_moe),
        "n_expert": m.n_expert,
        "n_expert_used": m.n_expert_used,
        "n_expert_shared": m.n_expert_shared,
        "trunk_bytes": m.trunk_bytes,
        "routed_bytes": m.routed_bytes,
        "bytes_per_expert": m.bytes_per_expert,
        "active_bytes_per_token": m.active_bytes_per_token,
        "shard_size": m.shard_size,
        "n_shards": len(m.shards),
        "budget": budget,
        "bandwidth": bandwidth,
        "read_bytes_per_token": read,
        "tok_s_floor": m.tok_s_floor(bandwidth, budget),
        "nonlayer": {"bytes": m.nonlayer_bytes, "shards": [s.index for s in m.layer_shards(None)]},
        "layers": [
            {
                "index": layer.index,
                "bytes": layer.n_bytes,
                "trunk_bytes": layer.trunk_bytes,
                "routed_bytes": layer.routed_bytes,
                "n_expert": layer.n_expert,
                "expert_bytes": layer.expert_bytes,
                "shards": list(layer.shards),
            }
            for layer in m.layers
        ],
        "shards": [
            {
                "index": s.index,
                "file": s.file,
                "offset": s.offset,
                "length": s.length,
                "tensor_bytes": s.tensor_bytes,
                "layer": s.layer,
                "routed": s.routed,
            }
            for s in m.shards
        ],
    }


def render(r: dict) -> str:
    fb = format_bytes
    files = len(r["files"])
    lines = [
        f"model    {r['name']} ({r['architecture']}), {files} file{'s' if files > 1 else ''}, {fb(sum(r['file_bytes']))}",
    ]
    if r["n_expert"]:
        dense = r["n_layers"] - r["n_moe_layers"]
        lines.append(
            f"layers   {r['n_layers']} ({dense} dense, {r['n_moe_layers']} MoE); {r['n_expert']} experts, "
            f"{r['n_expert_used']} used per token, {r['n_expert_shared']} shared"
        )
        lines.append(
            f"bytes    trunk {fb(r['trunk_bytes'])}, routed experts {fb(r['routed_bytes'])}, "
            f"one expert {fb(r['bytes_per_expert'])}"
        )
    else:
        lines.append(f"layers   {r['n_layers']} (dense)")
        lines.append(f"bytes    {fb(r['tensor_bytes'])} of weights, all trunk")
    lines.append(f"token    touches {fb(r['active_bytes_per_token'])}")
    lines.append(f"shards   {r['n_shards']} (target {fb(r['shard_size'])}, never across layers)")
    floor = r["tok_s_floor"]
    speed = (
        "nothing to read: compute-bound"
        if floor is None
        else f"{floor:.3g} tok/s at {format_rate(r['bandwidth'])}"
    )
    lines.append(f"budget   {fb(r['budget'])} pinned: reads {fb(r['read_bytes_per_token'])} per token, {speed}")
    lines.append("")
    header = ("layer", "bytes", "trunk", "experts", "1 expert", "shards")
    rows = [("—", fb(r["nonlayer"]["bytes"]), fb(r["nonlayer"]["bytes"]), "—", "—", str(len(r["nonlayer"]["shards"])))]
    # runs of identical layers collapse into one row: a 61-layer model stays a short table
    runs: list[list] = []
    for layer in r["layers"]:
        key = (layer["bytes"], layer["trunk_bytes"], layer["routed_bytes"], layer["expert_bytes"], len(layer["shards"]))
        if runs and runs[-1][0] == key:
            runs[-1][2] = layer["index"]
        else:
            runs.append([key, layer["index"], layer["index"]])
    for (n_bytes, trunk, routed, expert, n_shards), first, last in runs:
        label = str(first) if first == last else f"{first}-{last}"
        rows.append(
            (label, fb(n_bytes), fb(trunk), fb(routed) if routed else "—", fb(expert) if expert else "—", str(n_shards))
        )
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        lines.append("  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))).rstrip())
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        shard_size = parse_size(args.shard_size) if args.shard_size else DEFAULT_SHARD_SIZE
    except ValueError as exc:
        raise UserError(f"--shard-size: {exc}") from None
    bandwidth = parse_bandwidth(args.bandwidth)
    budget = _budget(args.budget)
    report = summarize(load_model_map(args.model, shard_size), bandwidth, budget)
    print(json.dumps(report, indent=1) if args.json else render(report))
    return 0
