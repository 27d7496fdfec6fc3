"""`kimitui inspect MODEL`: what a GGUF costs to stream, before running it. It lives with the
engine because it prints the engine's plan for the budget.

Layers, shards, trunk and expert sizes, the bytes one token touches, and what a disk of a
given bandwidth allows per second once a memory budget pins the most useful bytes.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from kimitui.config import load_settings
from kimitui.errors import UserError
from kimitui.model.gguf_map import DEFAULT_SHARD_SIZE, ROUTED_EXPERTS, ModelMap, load_model_map
from kimitui.model.placement import assemble_split_set
from kimitui.units import format_bytes, format_rate, size_option


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", type=Path, help="GGUF file, or any file of a split set")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--shard-size", help="target shard size, 4MiB..1GiB (default 64MiB)")
    parser.add_argument("--bandwidth", default="1GB/s", help="storage read bandwidth, e.g. 400MB/s (default 1GB/s)")
    parser.add_argument("--budget", default="auto", help="memory for pinned weights, e.g. 6GiB (default: a safe share of available memory)")
    parser.add_argument("--config", type=Path, help="TOML config whose model.paths are searched for the files (default: the usual one)")


def parse_bandwidth(text: str) -> float:
    """Bytes per second from `1GB/s`, `400MB/s` or a plain size per second."""
    raw = text.strip()
    if raw.lower().endswith("/s"):
        raw = raw[:-2]
    value = size_option(raw, "--bandwidth")
    if value <= 0:
        raise UserError("--bandwidth must be above zero")
    return float(value)


def _budget(text: str) -> int:
    from kimitui.engine.memory import resolve_budget

    return resolve_budget("auto" if text.strip().lower() == "auto" else size_option(text, "--budget"))


def spans(numbers: list[int]) -> str:
    """`0-3, 5, 7-9` from sorted distinct integers; "—" for none."""
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs) or "—"


def file_layout(m: ModelMap) -> tuple[list[dict], list[dict]]:
    """Per file: the layers whose trunk it holds, the layers whose routed experts it holds
    (all experts of each: an expert tensor holds every expert), the non-layer tensors. And
    the layers cut across files: a layer's trunk, or its routed experts, in more than one."""
    files = [  # real paths: a set spread over drives is opened through symlinks
        {"file": os.path.realpath(f), "bytes": size, "tensor_bytes": 0, "trunk_layers": set(), "expert_layers": set(), "nonlayer": []}
        for f, size in zip(m.files, m.file_sizes)
    ]
    where: dict[tuple[int, bool], set[int]] = {}
    for t in m.tensors:
        entry = files[t.file]
        entry["tensor_bytes"] += t.n_bytes
        routed = t.role == ROUTED_EXPERTS
        if t.layer is None:
            entry["nonlayer"].append(t.name)
        else:
            entry["expert_layers" if routed else "trunk_layers"].add(t.layer)
            where.setdefault((t.layer, routed), set()).add(t.file)
    for entry in files:
        entry["trunk_layers"] = sorted(entry["trunk_layers"])
        entry["expert_layers"] = sorted(entry["expert_layers"])
        entry["n_expert"] = max((m.layers[i].n_expert for i in entry["expert_layers"]), default=0)
    cuts = [
        {"layer": layer, "part": "experts" if routed else "trunk", "files": sorted(f)}
        for (layer, routed), f in sorted(where.items())
        if len(f) > 1
    ]
    return files, cuts


PLAN_BANDWIDTHS = (0.3e9, 0.6e9, 1.0e9)  # an external SSD over the phone's USB-C, low to high
PLAN_PROMPT_TOKENS = 32  # a short chat message


def engine_plan(m: ModelMap, budget: int) -> dict | None:
    """How the streaming engine would spend ``budget`` on this model (None: it cannot start)."""
    from kimitui.engine.budget import budget_shortfall, plan_memory, plan_reads, prompt_bytes, prompt_chunks
    from kimitui.engine.settings import StreamSettings

    shortfall = budget_shortfall(m, budget)
    if shortfall:
        return {"refused": shortfall}
    plan = plan_memory(m, budget, StreamSettings().prefetch_depth, 512)
    pinned_layers = sorted({s.layer for s in plan.pinned if s.layer is not None})
    return {
        "prompt_tokens": PLAN_PROMPT_TOKENS,
        "prompt_chunks": len(prompt_chunks(PLAN_PROMPT_TOKENS, 512, plan.ubatch)),
        "prompt_bytes": prompt_bytes(m, plan, PLAN_PROMPT_TOKENS, 512),
        "prompt_bytes_one_token_at_a_time": prompt_bytes(m, plan, PLAN_PROMPT_TOKENS, 1),
        "pinned_bytes": plan.pinned_bytes,
        "nonlayer_bytes": m.nonlayer_bytes,
        "pinned_trunk_layers": len(pinned_layers),
        "window_bytes": plan.window_bytes,
        "prefetch_depth": plan.prefetch_depth,
        "expert_cache_bytes": plan.expert_bytes,
        "ubatch": plan.ubatch,
        **plan_reads(m, plan),
    }


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def trunk_choices(m: ModelMap, budget: int) -> list[dict]:
    """The trunk as it is and as each `kimitui requant --trunk` would write it: its bytes and
    what a token reads under the engine's plan at `budget` (empty where requant changes nothing
    or the budget cannot start the model as it is)."""
    from kimitui.model.requant import TRUNK_TYPES, requantized_map, requantizes

    matrices = {t.index for t in m.tensors if requantizes(t)}
    choices = []
    for trunk in (None, *TRUNK_TYPES):
        variant = m if trunk is None else requantized_map(m, trunk)
        if trunk is not None and variant.tensor_bytes == m.tensor_bytes:
            continue  # already that type, or rows that do not divide into its blocks
        plan = engine_plan(variant, budget)
        if plan is None or "refused" in plan:
            if trunk is None:
                return []  # the plan line already says why the budget cannot start it
            per_token = None
        else:
            per_token = plan["trunk_bytes_per_token"] + plan["expert_bytes_per_token"]
        types = {t.ggml_type for t in variant.tensors if t.index in matrices}
        choices.append({
            "trunk": trunk, "types": sorted(types), "trunk_bytes": variant.trunk_bytes,
            "tensor_bytes": variant.tensor_bytes, "bytes_per_token": per_token,
        })
    return choices if len(choices) > 1 else []


def summarize(m: ModelMap, bandwidth: float, budget: int) -> dict:
    layout, cuts = file_layout(m)
    read = m.read_bytes_per_token(budget)
    return {
        "plan": engine_plan(m, budget),
        "trunk_choices": trunk_choices(m, budget),
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
        "file_layout": layout,
        "cut_layers": cuts,
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
    lines.append(render_cuts(len(r["file_layout"]), r["cut_layers"]))
    floor = r["tok_s_floor"]
    speed = (
        "nothing to read: compute-bound"
        if floor is None
        else f"at most {floor:.3g} tok/s at {format_rate(r['bandwidth'])}"
    )
    lines.append(f"budget   {fb(r['budget'])} all pinned: reads {fb(r['read_bytes_per_token'])} per token, {speed}")
    plan = r.get("plan")
    if plan and "refused" in plan:
        lines.append(f"plan     {plan['refused']}")
    elif plan:
        lines.append(
            f"plan     pins {fb(plan['pinned_bytes'])} (non-layer {fb(plan['nonlayer_bytes'])}, "
            f"trunk of {_count(plan['pinned_trunk_layers'], 'layer')}), reads {_count(plan['prefetch_depth'], 'layer')} ahead "
            f"({fb(plan['window_bytes'])} in flight), caches {plan['cached_experts']} experts "
            f"({fb(plan['expert_cache_bytes'])}), prefills {_count(plan['ubatch'], 'token')} at once"
        )
        per_token = plan["trunk_bytes_per_token"] + plan["expert_bytes_per_token"]
        lines.append(
            f"         per token reads trunk {fb(plan['trunk_bytes_per_token'])} + experts {fb(plan['expert_bytes_per_token'])} "
            f"(flat routing: {plan['flat_hit_rate']:.1%} expert hits)"
        )
        if per_token:
            floors = ", ".join(f"{rate / per_token:.3g} tok/s at {format_rate(rate)}" for rate in PLAN_BANDWIDTHS)
            lines.append(f"         the I/O floor: {floors} ({per_token / 1e9:.1f} GB a token)")
        prompt = plan["prompt_bytes"]
        if prompt:
            waits = ", ".join(f"{_minutes(prompt / rate)} at {format_rate(rate)}" for rate in PLAN_BANDWIDTHS)
            lines.append(
                f"         a {plan['prompt_tokens']}-token prompt reads {fb(prompt)} in {_count(plan['prompt_chunks'], 'chunk')} "
                f"(one token at a time: {fb(plan['prompt_bytes_one_token_at_a_time'])}): {waits}"
            )
    for choice in r.get("trunk_choices", []):
        label = "trunk as it is" if choice["trunk"] is None else f"requant --trunk {choice['trunk']}"
        head = "requant  " if choice["trunk"] is None else "         "
        per_token = choice["bytes_per_token"]
        reads = (
            "the plan refuses the budget" if per_token is None
            else f"a token reads {fb(per_token)}: " + ", ".join(f"{rate / per_token:.3g} tok/s at {format_rate(rate)}" for rate in PLAN_BANDWIDTHS)
            if per_token else "a token reads nothing"
        )
        lines.append(f"{head}{label} ({'/'.join(choice['types'])}, trunk {fb(choice['trunk_bytes'])}): {reads}")
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
    lines += _table(header, rows, range(1, len(header)))
    if len(r["file_layout"]) > 1:
        lines.append("")
        lines += render_layout(r["file_layout"])
    return "\n".join(lines)


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]], right: range) -> list[str]:
    """Aligned columns; those in `right` (numbers) flush right."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return [
        "  ".join(cell.rjust(w) if i in right else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))).rstrip()
        for row in [header, *rows]
    ]


def render_cuts(n_files: int, cuts: list[dict]) -> str:
    if not cuts:
        return f"files    {n_files}, no layer cut across files"
    shown = "; ".join(f"layer {c['layer']} {c['part']} in files {', '.join(str(f + 1) for f in c['files'])}" for c in cuts[:4])
    more = f"; {len(cuts) - 4} more" if len(cuts) > 4 else ""
    return f"files    {n_files}: {len(cuts)} layer parts cut across files ({shown}{more})"


def render_layout(layout: list[dict]) -> list[str]:
    """Which layers and experts each file holds, one row per file."""
    header = ("file", "bytes", "trunk layers", "expert layers", "other")
    spread = len({Path(f["file"]).parent for f in layout}) > 1  # then where each file is matters
    rows = []
    for f in layout:
        experts = spans(f["expert_layers"])
        if f["expert_layers"]:
            experts += f" ({f['n_expert']} experts)"
        other = ", ".join(name.rsplit(".", 1)[0] for name in f["nonlayer"]) or "—"
        name = f["file"] if spread else Path(f["file"]).name
        rows.append((name, format_bytes(f["bytes"]), spans(f["trunk_layers"]), experts, other))
    return _table(header, rows, range(1, 2))


def run(args: argparse.Namespace) -> int:
    shard_size = size_option(args.shard_size, "--shard-size") if args.shard_size else DEFAULT_SHARD_SIZE
    bandwidth = parse_bandwidth(args.bandwidth)
    budget = _budget(args.budget)
    search = [Path(d).expanduser() for d in load_settings(args.config, explicit=args.config is not None)["model.paths"]]
    report = summarize(load_model_map(assemble_split_set(args.model, search), shard_size), bandwidth, budget)
    print(json.dumps(report, indent=1) if args.json else render(report))
    return 0
