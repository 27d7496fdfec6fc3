"""`kimitui synth`: its flags, their checks, and what it prints."""

from __future__ import annotations

import argparse
from pathlib import Path

from kimitui.errors import UserError
from kimitui.model.synth.archs import DEFAULT_QUANT, K3_LAYOUTS, K3_TRUNK_QUANT, LIKE, QUANTS
from kimitui.model.synth.sizing import Cut, plan_dense, plan_like, plan_moe
from kimitui.model.synth.spec import ModelSpec, default_tokenizer
from kimitui.model.synth.writer import write_model
from kimitui.units import format_bytes, format_rate, size_option


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
    """The spec the flags ask for; UserError for a combination that makes no sense."""
    cut = _check(args)
    target = size_option(args.size, "--size") if args.size else None
    tok = default_tokenizer()
    if args.like:
        return plan_like(args.like, target, args.scale, args.quant, tok, cut, args.layout or "release")
    assert target is not None
    if args.arch == "moe":
        return plan_moe(target, args.quant or DEFAULT_QUANT, tok)
    return plan_dense(target, args.quant or DEFAULT_QUANT, tok)


def _check(args: argparse.Namespace) -> Cut:
    """The flags' checks, in the order their errors are reported; a slice without --size or
    --scale gets scale 1 (its real widths)."""
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
        args.scale = 1.0
    if args.scale is not None and not 0 < args.scale <= 4:
        raise UserError("--scale must be in (0, 4]")
    if args.seed < 0:
        raise UserError("--seed must be 0 or more")
    if args.layout and args.like != "kimi-k3":
        raise UserError("--layout is one of Kimi K3's published sets: use it with --like kimi-k3")
    if args.layout not in (None, "release") and args.quant:
        raise UserError(f"--layout {args.layout} sets the trunk's type (Q8_0): drop --type")
    return cut


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
