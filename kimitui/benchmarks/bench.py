"""`kimitui bench`: decode speed of the kimitui engine against plain llama-cpp-python mmap,
next to the physical limit of this disk and CPU.

Phases, each in a child process with the model dropped from the page cache first
(common.run_child): the disk's cold parallel read bandwidth; compute speed with the weights
in RAM, on the engine's compute path (repacking off, as it must be for weights to stream),
only where the model fits the memory safely available; the kimitui engine (fast-start
load, pinned set, then the measured reply); with ``--baseline`` plain llama-cpp-python with
its stock mmap load. ``--cgroup-limit`` runs the kimitui and baseline runs each in a fresh
memory cgroup with that limit. The benchmark is defined by its command line alone: the
user's config file is not read.

Physical limit = 1 / max(compute time per token, bytes a token must read / disk bandwidth),
where the bytes a token must read are the model map's figure for what the engine pinned.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from kimitui.benchmarks.cgroup import MemoryCgroups
from kimitui.benchmarks.common import cell, noise_note, ratio, run_child, table, write_json
from kimitui.config import key_spec
from kimitui.engine.settings import POLICIES
from kimitui.errors import UserError
from kimitui.units import format_bytes, format_ms, format_rate, size_option

DISK_SAMPLE_BYTES = 2**30
DISK_THREADS = (4, 8)  # both sampled before and after the runs: the best is the disk's rate
# The streaming targets, shown beside the figures: a dense model larger than the budget.
TARGET_STREAM_SPEEDUP = 2.0
TARGET_READ_OVERHEAD = 1.1
TARGET_SHARE_OF_LIMIT = 0.8
TARGET_FIT_GAP = 0.03
# A Mixture-of-Experts model's.
TARGET_MOE_SPEEDUP = 4.0
TARGET_MOE_READ_OVERHEAD = 1.15
INTERLEAVED_ROUNDS = 5  # at least, for a model that fits: alternating replies in one process
COLD_SHARE = 0.9  # a "cold" read must have come from storage for at least this share
CTX_STEP = 256
RATIO_KEYS = (
    "load_s",
    "prefill_tok_s",
    "ttft_s",
    "decode_tok_s",
    "decode_tok_s_p50",
    "token_p50_s",
    "token_p95_s",
    "read_bytes_per_token",
    "peak_rss_bytes",
    "cgroup_peak_bytes",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", "-m", help="GGUF model file (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--budget", default="auto", help="the engine's memory budget, e.g. 1GiB (default auto: a safe share of what the run may use)")
    parser.add_argument("--tokens", type=int, default=32, help="tokens to generate, greedy (default 32)")
    parser.add_argument("--prompt-tokens", type=int, default=32, help="prompt length in tokens (default 32)")
    parser.add_argument("--baseline", action="store_true", help="also run plain llama-cpp-python with stock mmap and print the ratios")
    parser.add_argument("--cgroup-limit", help="run the engine runs in a fresh memory cgroup of this size, e.g. 1536MiB (root)")
    parser.add_argument("--address-space", help="the address space the engine's weights may take, e.g. 40GiB (default auto: under `ulimit -v`)")
    parser.add_argument("--policy", choices=POLICIES, help="the engine's residency policy when it streams (default: the engine's)")
    parser.add_argument("--prefetch-depth", type=int, help="layers read ahead when the engine streams (default: the engine's)")
    parser.add_argument("--io-threads", type=int, help="the engine's I/O threads when it streams (default: the engine's)")
    parser.add_argument("--expert-lookahead", action="store_true", default=None, help="MoE: read the experts the next layer chose last token ahead")
    parser.add_argument("--expert-trim-below", type=float, metavar="SHARE",
                        help="MoE, lossy: skip a routed expert not in memory whose share of the token's routing weight is below SHARE (kimitui quality --trim-below shows the cost)")
    parser.add_argument("--expert-trim-cumulative", type=float, metavar="SHARE",
                        help="MoE, lossy: skip routed experts not in memory past those whose shares reach SHARE")
    parser.add_argument("--n-batch", type=int, help="the engine's prompt batch (model.n_batch; 1 evaluates a prompt one token at a time, for comparison)")
    parser.add_argument("--threads", type=int, help="compute threads for every run (default: one per physical core)")
    parser.add_argument("--n-ctx", type=int, help=f"context length (default: prompt + tokens, rounded up to {CTX_STEP})")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each kind, alternating; each kind's median run (by decode tok/s) is reported (default 1)")
    parser.add_argument(
        "--replies", type=int, default=1,
        help="replies the engine run gives, one after another in one engine, each to a prompt of its own; the first is the "
             "one measured against the baseline, later ones show a conversation's next replies, the caches as the first left "
             "them (default 1)",
    )
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write every figure to FILE as JSON")
    parser.add_argument(
        "--trace", type=Path, metavar="FILE",
        help="write the kimitui run's trace here (routing included: kimitui trace routing FILE judges its expert cache)",
    )


def _check(args: argparse.Namespace) -> None:
    if args.tokens < 2:
        raise UserError("--tokens: at least 2 (decode speed is timed between tokens)")
    if args.prompt_tokens < 1:
        raise UserError("--prompt-tokens: at least 1")
    depth = key_spec("engine.prefetch_depth")
    if args.prefetch_depth is not None and not depth.low <= args.prefetch_depth <= depth.high:
        raise UserError(f"--prefetch-depth: {depth.low:g}..{depth.high:g}")
    if args.rounds < 1:
        raise UserError("--rounds: at least 1")
    if args.replies < 1:
        raise UserError("--replies: at least 1")
    io_threads = key_spec("engine.io_threads")
    if args.io_threads is not None and not io_threads.low <= args.io_threads <= io_threads.high:
        raise UserError(f"--io-threads: {io_threads.low:g}..{io_threads.high:g}")
    for flag, key in (("--expert-trim-below", "expert_trim_below"), ("--expert-trim-cumulative", "expert_trim_cumulative")):
        spec, value = key_spec(f"engine.{key}"), getattr(args, key)
        if value is not None and not spec.low <= value <= spec.high:
            raise UserError(f"{flag}: {spec.low:g}..{spec.high:g}")
    if args.threads is not None and args.threads < 1:
        raise UserError("--threads: at least 1")
    if args.n_ctx is not None and args.n_ctx <= args.prompt_tokens + args.tokens:
        raise UserError(f"--n-ctx {args.n_ctx} does not hold {args.prompt_tokens} prompt + {args.tokens} tokens")


def _model_path(raw: str | None) -> Path:
    from kimitui.model import default_model_path
    from kimitui.model.placement import assemble_split_set

    return assemble_split_set(Path(raw).expanduser()) if raw else default_model_path()


def _disk_sample(run) -> dict:
    out = {"bandwidth_bytes_s": None, "note": None, "cached_at_start_bytes": run.cached_at_start, "others_cpu": run.others_cpu}
    if run.error:
        out["note"] = f"disk read failed: {run.error}"
        return out
    r = run.result
    out.update(r)
    if r["storage_bytes"] is not None and r["storage_bytes"] < COLD_SHARE * r["bytes"]:
        out["note"] = (
            f"not cold: only {format_bytes(r['storage_bytes'])} of {format_bytes(r['bytes'])} came from storage "
            "(another process keeps the model mapped?)"
        )
    else:
        out["buffered_bytes_s"] = out["bandwidth_bytes_s"] = r["bytes"] / r["seconds"]
    # The limit is the disk's best: O_DIRECT reads, which skip the page cache's per-page work,
    # beat buffered ones on this machine, and the engine streams shards that way on Linux.
    if r.get("direct_bytes") and (r["direct_storage_bytes"] is None or r["direct_storage_bytes"] >= COLD_SHARE * r["direct_bytes"]):
        out["direct_bytes_s"] = r["direct_bytes"] / r["direct_seconds"]
        out["bandwidth_bytes_s"] = max(out["bandwidth_bytes_s"] or 0, out["direct_bytes_s"])
    out["random_bandwidth_bytes_s"] = None
    if r.get("random_bytes"):
        cold = r["random_storage_bytes"] is None or r["random_storage_bytes"] >= COLD_SHARE * r["random_bytes"]
        out["random_bandwidth_bytes_s"] = r["random_bytes"] / r["random_seconds"] if cold else None
    return out


def _disk(samples: list[dict]) -> dict:
    """The best of the samples: the limit is what the disk can do, and this disk's rate was
    seen to vary by more than 1.5x from one minute to the next."""
    rates = [s["bandwidth_bytes_s"] for s in samples if s["bandwidth_bytes_s"] is not None]
    random_rates = [s["random_bandwidth_bytes_s"] for s in samples if s.get("random_bandwidth_bytes_s")]
    return {
        "bandwidth_bytes_s": max(rates) if rates else None,
        "random_bandwidth_bytes_s": max(random_rates) if random_rates else None,
        "slice_bytes": next((s["slice_bytes"] for s in samples if s.get("slice_bytes")), None),
        "sample_bytes": next((s["bytes"] for s in samples if "bytes" in s), None),
        "threads": next((s["threads"] for s in samples if s["bandwidth_bytes_s"] == max(rates)), None) if rates else None,
        "chunk_bytes": next((s["chunk_bytes"] for s in samples if "chunk_bytes" in s), None),
        "note": None if rates else "; ".join(s["note"] for s in samples),
        "samples": samples,
    }


def _run_figures(run) -> dict:
    figures = {
        "error": run.error,
        "cached_at_start_bytes": run.cached_at_start,
        "cgroup_peak_bytes": run.cgroup_peak,
        "others_cpu": run.others_cpu,
    }
    if run.result:
        figures.update(run.result)
        figures["decode_tok_s_p50"] = _median_rate(figures)
    return figures


def _interleaved(run) -> dict:
    if run.error:
        return {"error": run.error}
    r = dict(run.result)
    if "skipped" not in r:
        pairs = [k / p for k, p in zip(r["kimitui"], r["plain"]) if k and p]
        r["ratio"] = statistics.median(pairs) if pairs else None
    return r


def _median_run(runs: list[dict]) -> dict:
    """The run with the median decode speed (the lower middle of an even count); a failed
    run wins, so that its error is reported."""
    failed = [r for r in runs if r["error"] or r.get("decode_tok_s") is None]
    if failed:
        return failed[0]
    return sorted(runs, key=lambda r: r["decode_tok_s"])[(len(runs) - 1) // 2]


def _median_rate(figures: dict) -> float | None:
    """Tokens/s at the median token time: unlike the mean it shrugs off a few tokens that
    waited for a CPU other processes held, so it shows what a quiet machine would do."""
    p50 = figures.get("token_p50_s")
    return 1 / p50 if p50 else None


def _compute(run, skipped: str | None) -> dict:
    if skipped:
        return {"s_per_token": None, "decode_tok_s": None, "note": skipped}
    if run.error:
        return {"s_per_token": None, "decode_tok_s": None, "note": f"the in-RAM run failed: {run.error}"}
    r = dict(run.result, others_cpu=run.others_cpu)
    r["decode_tok_s_p50"] = _median_rate(r)
    r["s_per_token"] = 1 / r["decode_tok_s"] if r["decode_tok_s"] else None
    r["note"] = None
    return r


def physical_limit(
    model_map, pinned: int | None, bandwidth: float | None, compute_s: float | None, random_bandwidth: float | None = None
) -> dict:
    """1 / max(compute s/token, must-read bytes/token / bandwidth), with why where a term is
    missing. Routed experts come in small scattered slices: with ``random_bandwidth`` (this
    disk's rate for such reads) their share of the bytes is timed at that rate."""
    out = {
        "pinned_bytes": pinned,
        "must_read_bytes_per_token": None,
        "model_minus_pinned_bytes": None,
        "io_s_per_token": None,
        "compute_s_per_token": compute_s,
        "tok_s": None,
        "bound": None,
        "note": None,
    }
    if pinned is None:
        out["note"] = "the kimitui run failed, so its pinned set is unknown"
        return out
    trunk, experts = model_map.read_split_per_token(pinned)
    need = trunk + experts
    out["must_read_bytes_per_token"] = need
    out["must_read_expert_bytes_per_token"] = experts
    out["model_minus_pinned_bytes"] = max(0, model_map.tensor_bytes - pinned)
    if need == 0:
        out["io_s_per_token"] = 0.0
    elif bandwidth:
        out["io_s_per_token"] = trunk / bandwidth + experts / (random_bandwidth or bandwidth)
    io_s = out["io_s_per_token"]
    if io_s is None:
        out["note"] = "disk bandwidth not measured"
    elif compute_s is None and io_s == 0:
        out["note"] = "nothing to read, and compute speed in RAM not measured"
    elif compute_s is None:
        out["tok_s"], out["bound"] = 1 / io_s, "io"
        out["note"] = "compute speed in RAM not measured: this is the I/O bound alone, an upper bound"
    else:
        slowest = max(compute_s, io_s)
        out["tok_s"], out["bound"] = 1 / slowest, ("io" if io_s > compute_s else "compute")
    return out


def targets(report: dict) -> dict:
    """The streaming targets, judged from this run's figures (None where a figure is missing):
    streaming, at least 2x plain mmap's decode, at most 1.1x (model - pinned) read per token
    and at least 80% of the physical limit; fitting the budget, within 3% of plain."""
    kimitui = report["runs"]["kimitui"]
    ratios = report.get("ratios", {})
    out: dict = {}

    def judge(name: str, value: float | None, ok) -> None:
        out[name] = {"value": value, "met": None if value is None else ok(value)}

    if kimitui.get("streaming") and report["model"]["moe"]:
        judge("decode_vs_plain_at_least_4x", ratios.get("decode_tok_s"), lambda v: v >= TARGET_MOE_SPEEDUP)
        judge("read_vs_needed_at_most_1.15x", kimitui.get("read_vs_needed"), lambda v: v <= TARGET_MOE_READ_OVERHEAD)
        # No judge against the limit here: it assumes uniform routing, and real (or Zipf
        # synthetic) routing lets a cache read less, so it is an estimate, not a bound.
    elif kimitui.get("streaming"):
        judge("decode_vs_plain_at_least_2x", ratios.get("decode_tok_s"), lambda v: v >= TARGET_STREAM_SPEEDUP)
        judge("read_vs_model_minus_pinned_at_most_1.1x", kimitui.get("read_vs_model_minus_pinned"), lambda v: v <= TARGET_READ_OVERHEAD)
        judge("share_of_limit_at_least_80%", kimitui.get("share_of_limit"), lambda v: v >= TARGET_SHARE_OF_LIMIT)
        # Whether 2x is physically possible here at all: the limit over plain's decode.
        judge("2x_within_the_physical_limit", report.get("limit_vs_plain"), lambda v: v >= TARGET_STREAM_SPEEDUP)
    elif kimitui.get("streaming") is False:
        # Judged on the replies that alternated in one process (see phase_interleaved), when run.
        inter = report.get("interleaved") or {}
        value = inter["ratio"] if inter.get("ratio") is not None else ratios.get("decode_tok_s")
        judge("decode_vs_plain_within_3%", value, lambda v: v >= 1 - TARGET_FIT_GAP)
    return out


def _spec(args: argparse.Namespace, path: Path, budget: int | None, threads: int, n_ctx: int) -> dict:
    """What the engine's child runs are told."""
    return {
        "model": str(path),
        "n_ctx": n_ctx,
        "threads": threads,
        "budget": budget,
        "prompt_tokens": args.prompt_tokens,
        "tokens": args.tokens,
        "policy": args.policy,
        "prefetch_depth": args.prefetch_depth,
        "io_threads": args.io_threads,
        "expert_lookahead": args.expert_lookahead,
        "expert_trim_below": args.expert_trim_below,
        "expert_trim_cumulative": args.expert_trim_cumulative,
        "n_batch": args.n_batch,
        "replies": args.replies,
        "trace": str(args.trace) if args.trace else None,
        "address_space": size_option(args.address_space, "--address-space") if args.address_space else "auto",
    }


def _show_pinning(kind: str, message: dict) -> None:
    # The pinned set is read before the measured reply: its progress goes to stderr.
    if kind != "pinning":
        return
    if sys.stderr.isatty():
        print(f"\r{message['line']}", end="\n" if message["finished"] else "", file=sys.stderr, flush=True)
    elif message["finished"]:
        print(message["line"], file=sys.stderr, flush=True)


def _against_limits(figures: dict, limit_figures: dict, disk: dict, compute: dict) -> None:
    """A run's figures set against the physical limit, the disk and compute in RAM (added to ``figures``)."""
    rate = figures.get("decode_tok_s")
    figures["share_of_limit"] = ratio(rate, limit_figures["tok_s"])
    need = limit_figures["model_minus_pinned_bytes"]
    figures["read_vs_model_minus_pinned"] = ratio(figures.get("read_bytes_per_token"), need)
    figures["read_vs_needed"] = ratio(figures.get("read_bytes_per_token"), figures.get("needed_bytes_per_token"))
    # Against what this very run had to read after its cache hits (not an estimate from
    # uniform routing): at the best disk rate of this run, or compute, whichever is slower.
    needed, bandwidth = figures.get("needed_bytes_per_token"), disk["bandwidth_bytes_s"]
    if needed is not None and bandwidth:
        floor_s = max(needed / bandwidth, compute["s_per_token"] or 0.0)
        figures["io_limit_tok_s"] = 1 / floor_s if floor_s else None
        figures["share_of_io_limit"] = ratio(rate, figures["io_limit_tok_s"])
        # The same with the experts' bytes at this disk's rate for expert-sized reads at
        # scattered offsets (measured in this run too), and compute after the reads, not
        # beside them: experts are known only when the router has run.
        expert_needed, random_bw = figures.get("expert_needed_bytes_per_token"), disk["random_bandwidth_bytes_s"]
        if expert_needed is not None and random_bw:
            serial_s = (needed - expert_needed) / bandwidth + expert_needed / random_bw + (compute["s_per_token"] or 0.0)
            figures["serial_limit_tok_s"] = 1 / serial_s if serial_s else None
            figures["share_of_serial_limit"] = ratio(rate, figures["serial_limit_tok_s"])
    distinct = figures.get("prefill_distinct_expert_bytes")
    if distinct:  # bytes against bytes: known even where the disk rate is not
        figures["prefill_read_vs_distinct"] = ratio(figures.get("prefill_expert_read_bytes"), distinct)
    bound = figures.get("prefill_bound_bytes")
    if bound:
        figures["prefill_read_vs_bound"] = ratio(figures.get("prefill_read_bytes"), bound)
        if bandwidth and figures.get("ttft_s"):
            # The bound's bytes at the best disk rate of this run, against the time taken.
            figures["prefill_bound_share"] = bound / bandwidth / figures["ttft_s"]
            # Or the prompt's compute in RAM, where that is longer (this run's in-RAM time to first token).
            figures["prefill_limit_share"] = max(bound / bandwidth, compute.get("ttft_s") or 0.0) / figures["ttft_s"]
    if distinct and bandwidth and figures.get("ttft_s"):
        # The prompt's distinct experts at the best disk rate, or its compute in RAM (the
        # in-RAM run's time to first token), whichever is longer.
        figures["prefill_share_of_limit"] = max(distinct / bandwidth, compute.get("ttft_s") or 0.0) / figures["ttft_s"]
    if figures.get("peak_model_resident_bytes") is not None and figures.get("budget_bytes"):
        figures["model_resident_vs_budget"] = figures["peak_model_resident_bytes"] / figures["budget_bytes"]


def _report(args: argparse.Namespace, path: Path, model_map, spec: dict, limit: int | None, cgroups: MemoryCgroups | None,
            disk: dict, compute: dict, limit_figures: dict, rounds: dict, runs: dict, interleaved: dict | None) -> dict:
    """Every figure of the run, as printed and written by --json (targets not judged yet)."""
    report = {
        "model": {
            "path": str(path),
            "name": model_map.name,
            "architecture": model_map.architecture,
            "n_layers": model_map.n_layers,
            "file_bytes": sum(model_map.file_sizes),
            "tensor_bytes": model_map.tensor_bytes,
            "moe": model_map.is_moe,
        },
        "settings": {
            "prompt_tokens": args.prompt_tokens,
            "tokens": args.tokens,
            "n_batch": args.n_batch,
            "replies": args.replies,
            "threads": spec["threads"],
            "n_ctx": spec["n_ctx"],
            "budget_bytes": spec["budget"],
            "cgroup_limit_bytes": limit,
            "cgroup_version": cgroups.hierarchy.version if cgroups else None,
        },
        "disk": disk,
        "compute": compute,
        "limit": limit_figures,
        "runs": runs,
        "rounds": {name: [r.get("decode_tok_s") for r in each] for name, each in rounds.items()},
        "interleaved": interleaved,
    }
    if "baseline" in runs:
        kimitui, base = runs["kimitui"], runs["baseline"]
        report["ratios"] = {key: ratio(kimitui.get(key), base.get(key)) for key in RATIO_KEYS}
        both = not kimitui["error"] and not base["error"]
        report["same_tokens"] = kimitui["tokens"] == base["tokens"] if both else None
        # The most any engine could beat plain mmap by on this disk and CPU in this run.
        report["limit_vs_plain"] = ratio(limit_figures["tok_s"], base.get("decode_tok_s"))
    return report


def run(args: argparse.Namespace) -> int:
    from kimitui.engine.memory import default_budget
    from kimitui.engine.session import default_threads
    from kimitui.model.gguf_map import load_model_map

    _check(args)
    budget = None if args.budget == "auto" else size_option(args.budget, "--budget")
    limit, cgroups = MemoryCgroups.from_flag(args.cgroup_limit)
    path = _model_path(args.model)
    model_map = load_model_map(path)  # checks the file too: one line on a bad GGUF
    if budget is not None:
        from kimitui.engine.budget import budget_shortfall

        shortfall = budget_shortfall(model_map, budget)
        if shortfall:
            raise UserError(f"--budget: {shortfall}")
    file_bytes = sum(model_map.file_sizes)
    threads = args.threads or default_threads()
    n_ctx = args.n_ctx or -(-(args.prompt_tokens + args.tokens + 1) // CTX_STEP) * CTX_STEP
    spec = _spec(args, path, budget, threads, n_ctx)

    def engine_run(phase: str):
        return run_child(phase, spec, path, cgroups=cgroups, limit=limit, on_message=_show_pinning)

    def disk_samples() -> list[dict]:
        return [
            _disk_sample(run_child("disk", {"model": str(path), "sample_bytes": DISK_SAMPLE_BYTES, "threads": n, "slice_bytes": model_map.expert_slice_bytes}, path))
            for n in DISK_THREADS
        ]

    disk_before = disk_samples()
    room = default_budget()
    skipped = None
    if file_bytes > room:
        skipped = (
            f"the model ({format_bytes(file_bytes)}) does not fit the memory safely available "
            f"({format_bytes(room)}): compute speed with the weights in RAM not measured"
        )
    compute = _compute(None if skipped else run_child("compute", spec, path), skipped)
    rounds: dict[str, list[dict]] = {"kimitui": []} | ({"baseline": []} if args.baseline else {})
    for _ in range(args.rounds):  # alternating, so drift on the machine hits both kinds alike
        rounds["kimitui"].append(_run_figures(engine_run("engine")))
        if args.baseline:
            rounds["baseline"].append(_run_figures(engine_run("llama")))
    runs = {name: _median_run(each) for name, each in rounds.items()}
    interleaved = None
    if args.baseline and runs["kimitui"].get("streaming") is False:
        interleaved = _interleaved(run_child("interleaved", spec | {"rounds": max(args.rounds, INTERLEAVED_ROUNDS)}, path, cgroups=cgroups, limit=limit))
    disk = _disk(disk_before + disk_samples())  # before the runs and after
    kimitui = runs["kimitui"]
    limit_figures = physical_limit(
        model_map,
        None if kimitui["error"] else kimitui["pinned_bytes"],
        disk["bandwidth_bytes_s"],
        compute["s_per_token"],
        disk["random_bandwidth_bytes_s"],
    )
    for figures in runs.values():
        _against_limits(figures, limit_figures, disk, compute)
        for later in figures.get("later_replies") or ():
            later["decode_tok_s_p50"] = _median_rate(later)
            _against_limits(later, limit_figures, disk, compute)
    report = _report(args, path, model_map, spec, limit, cgroups, disk, compute, limit_figures, rounds, runs, interleaved)
    report["targets"] = targets(report)
    print(render(report))
    if args.json:
        write_json(args.json, report)
    return 1 if any(figures["error"] for figures in runs.values()) else 0


def _seconds(v) -> str:
    return "—" if v is None else f"{v:.2f} s"


def _per_s(v) -> str:
    return cell(v, ".2f")


def _share(v) -> str:
    return cell(v, ".0f", scale=100, unit="%")


def _times(v) -> str:
    return cell(v, ".2f", unit="x")


def _count(v) -> str:
    return "—" if v is None else str(v)


def _chunks(sizes) -> str:
    """Micro-batch sizes as runs: "2 x 512 + 37"."""
    if not sizes:
        return "—"
    runs: list[list[int]] = []
    for size in sizes:
        if runs and runs[-1][0] == size:
            runs[-1][1] += 1
        else:
            runs.append([size, 1])
    return " + ".join(f"{n} x {size}" if n > 1 else str(size) for size, n in runs)


def _summary(report: dict) -> list[str]:
    """The model, the settings, and what this machine allows: disk, compute, the physical limit."""
    m, s, disk, compute, lim = report["model"], report["settings"], report["disk"], report["compute"], report["limit"]
    runs = report["runs"]
    used = runs["kimitui"].get("budget_bytes")
    budget = format_bytes(s["budget_bytes"]) if s["budget_bytes"] is not None else f"auto ({format_bytes(used)})"
    cgroup = "none" if s["cgroup_limit_bytes"] is None else f"{format_bytes(s['cgroup_limit_bytes'])} ({s['cgroup_version']})"
    lines = [
        f"kimitui bench: {Path(m['path']).name} ({m['architecture']}, {m['n_layers']} layers, {format_bytes(m['tensor_bytes'])} of tensors)",
        f"  {s['prompt_tokens']} prompt + {s['tokens']} generated tokens, greedy, {s['threads']} threads, "
        f"n_ctx {s['n_ctx']}, budget {budget}, memory cgroup {cgroup}",
    ]
    if disk["bandwidth_bytes_s"] is not None:
        each = ", ".join(
            f"{format_rate(d.get('buffered_bytes_s'))} / {format_rate(d.get('direct_bytes_s'))}" for d in disk["samples"]
        )
        lines.append(
            f"disk: {format_rate(disk['bandwidth_bytes_s'])} cold parallel read, the best of (buffered / O_DIRECT) {each} "
            f"before and after the runs ({format_bytes(disk['sample_bytes'])} each, {' and '.join(map(str, DISK_THREADS))} "
            f"threads x {format_bytes(disk['chunk_bytes'])} preads; best with {disk['threads']})"
        )
    else:
        lines.append(f"disk: — ({disk['note']})")
    if disk.get("random_bandwidth_bytes_s"):
        each = ", ".join(format_rate(d.get("random_bandwidth_bytes_s")) for d in disk["samples"])
        lines.append(
            f"disk, expert-sized reads: {format_rate(disk['random_bandwidth_bytes_s'])} cold, {format_bytes(disk['slice_bytes'])} "
            f"at scattered offsets, read-ahead off, the best of {each}"
        )
    if compute["decode_tok_s"] is not None:
        lines.append(
            f"compute with weights in RAM: {compute['decode_tok_s']:.2f} tok/s ({format_ms(compute['s_per_token'])}/token; "
            f"{compute['decode_tok_s_p50']:.2f} tok/s at the median token)"
        )
    else:
        lines.append(f"compute with weights in RAM: — ({compute['note']})")
    if lim["must_read_bytes_per_token"] is not None:
        lines.append(
            f"must read per token: {format_bytes(lim['must_read_bytes_per_token'])} "
            f"(tensors {format_bytes(m['tensor_bytes'])}, pinned {format_bytes(lim['pinned_bytes'])}"
            + (f"; routed experts {format_bytes(lim['must_read_expert_bytes_per_token'])}, uniform routing assumed" if m["moe"] else "")
            + ")"
        )
    if lim["tok_s"] is not None:
        bound = "I/O bound" if lim["bound"] == "io" else "compute bound"
        lines.append(f"physical limit: {lim['tok_s']:.3g} tok/s ({bound})" + (f"; {lim['note']}" if lim["note"] else ""))
    else:
        lines.append(f"physical limit: — ({lim['note']})")
    if report.get("limit_vs_plain") is not None:
        if m["moe"]:
            lines.append(
                f"physical limit / plain mmap decode: {report['limit_vs_plain']:.2f}x (an estimate for MoE: skewed routing "
                "lets a cache read less than uniform routing, so the limit can be passed)"
            )
        else:
            lines.append(f"physical limit / plain mmap decode: {report['limit_vs_plain']:.2f}x (no engine can beat plain mmap by more here)")
    return lines


def _table(report: dict, names: list[tuple[str, str]]) -> list[tuple[str, ...]]:
    """The runs side by side, a row per figure (and kimitui's over plain's, with a baseline)."""
    runs = report["runs"]
    header = ("",) + tuple(label for _, label in names) + (("kimitui/plain",) if "baseline" in runs else ())
    ratios = report.get("ratios", {})

    def row(label: str, key: str, fmt) -> tuple[str, ...]:
        cells = tuple(fmt(runs[name].get(key)) for name, _ in names)
        if "baseline" in runs:
            cells += (_times(ratios.get(key)) if key in ratios else "",)
        return (label,) + cells

    return [
        header,
        row("streaming", "streaming", lambda v: "—" if v is None else ("on" if v else "off")),
        row("load (setup)", "load_s", _seconds),
        row("pinned (setup)", "pinned_bytes", lambda v: "—" if v is None else format_bytes(v)),
        row("pinning time (setup)", "pin_s", _seconds),
        row("address space", "windows_bytes", lambda v: "whole files" if v is None else f"windows {format_bytes(v)}"),
        row("  layer slots", "slots", _count),
        row("  slots taken over", "slot_claims", _count),
        row("  compute waited for them", "slot_wait_s", _seconds),
        row("  peak of the process", "peak_address_space_bytes", lambda v: "—" if v is None else format_bytes(v)),
        row("RSS after load", "rss_after_load_bytes", format_bytes),
        row("prefill tok/s", "prefill_tok_s", _per_s),
        row("TTFT", "ttft_s", format_ms),
        row("decode tok/s", "decode_tok_s", _per_s),
        row("  at the median token", "decode_tok_s_p50", _per_s),
        row("token p50", "token_p50_s", format_ms),
        row("token p95", "token_p95_s", format_ms),
        row("read per token", "read_bytes_per_token", format_bytes),
        row("  / (model - pinned)", "read_vs_model_minus_pinned", _times),
        row("  needed per token", "needed_bytes_per_token", format_bytes),
        row("  read / needed", "read_vs_needed", _times),
        row("hit rate", "hit_rate", _share),
        row("expert hit rate", "expert_hit_rate", _share),
        row("wasted prefetch/token", "expert_prefetch_wasted_bytes_per_token", format_bytes),
        row("stall per token", "stall_s_per_token", format_ms),
        row("prefill chunks", "prefill_chunks", _chunks),
        row("prefill read", "prefill_read_bytes", format_bytes),
        row("  bound: trunk per chunk + its experts", "prefill_bound_bytes", format_bytes),
        row("  paged in under compute", "prefill_paged_in_bytes", format_bytes),
        row("  read / bound", "prefill_read_vs_bound", _times),
        row("  bound at the disk rate / TTFT", "prefill_bound_share", _share),
        row("  that or compute in RAM / TTFT", "prefill_limit_share", _share),
        row("  layers staged by matrix", "prefill_staged_layers", _count),
        row("prefill experts read", "prefill_expert_read_bytes", format_bytes),
        row("  of which gaps read through", "prefill_gap_bytes", format_bytes),
        row("  distinct experts used", "prefill_distinct_expert_bytes", format_bytes),
        row("  read / distinct", "prefill_read_vs_distinct", _times),
        row("  of the I/O limit", "prefill_share_of_limit", _share),
        row("decode I/O limit tok/s", "io_limit_tok_s", _per_s),
        row("  decode of it", "share_of_io_limit", _share),
        row("serial limit tok/s", "serial_limit_tok_s", _per_s),
        row("  decode of it", "share_of_serial_limit", _share),
        row("peak model resident", "peak_model_resident_bytes", format_bytes),
        row("  of the budget", "model_resident_vs_budget", _share),
        row("peak RSS", "peak_rss_bytes", format_bytes),
        row("peak cgroup", "cgroup_peak_bytes", format_bytes),
        row("of physical limit", "share_of_limit", _share),
        row("CPU used by others", "others_cpu", _share),
    ]


def _rounds(report: dict, names: list[tuple[str, str]]) -> list[str]:
    """The replies that alternated in one process, and every round's decode rate."""
    lines = []
    inter = report.get("interleaved")
    if inter:
        if inter.get("error") or inter.get("skipped"):
            lines.append(f"one process, alternating replies: — ({inter.get('error') or inter.get('skipped')})")
        else:
            lines.append(
                f"one process, alternating replies ({len(inter['kimitui'])} each): kimitui "
                + ", ".join(cell(v, ".1f") for v in inter["kimitui"])
                + " tok/s; plain " + ", ".join(cell(v, ".1f") for v in inter["plain"])
                + f" tok/s; median of the paired ratios {inter['ratio']:.3f}x"
            )
    for number, later in enumerate(report["runs"]["kimitui"].get("later_replies") or (), start=2):
        lines.append(
            f"kimitui reply {number}, the same engine, a prompt of its own: TTFT {format_ms(later['ttft_s'])}, "
            f"decode {cell(later['decode_tok_s'], '.2f')} tok/s ({cell(later['decode_tok_s_p50'], '.2f')} at the median token), "
            f"{_share(later.get('share_of_io_limit'))} of the decode I/O limit, expert hits {_share(later.get('expert_hit_rate'))}, "
            f"stall {format_ms(later.get('stall_s_per_token'))}/token, read {format_bytes(later.get('read_bytes_per_token'))}/token"
        )
    if len(next(iter(report["rounds"].values()))) > 1:
        each = "; ".join(
            f"{label} " + ", ".join(cell(v, ".2f") for v in report["rounds"][name]) for name, label in names
        )
        lines.append(f"decode tok/s of every round: {each} (the median run of each is shown)")
    return lines


def _verdicts(report: dict) -> list[str]:
    """The targets' line: each met, MISSED or — (not judged); none where no target applies."""
    if not report["targets"]:
        return []
    verdicts = []
    for name, judged in report["targets"].items():
        met = "—" if judged["met"] is None else ("met" if judged["met"] else "MISSED")
        value = "" if judged["value"] is None else f" ({judged['value']:.2f})"
        verdicts.append(f"{name.replace('_', ' ')}: {met}{value}")
    return [f"targets ({'MoE' if report['model']['moe'] else 'dense'} streaming): " + "; ".join(verdicts)]


def _notes(report: dict, names: list[tuple[str, str]]) -> list[str]:
    """What a reader needs to trust the figures: how the runs went, and what each one means."""
    m, s, disk, compute, runs = report["model"], report["settings"], report["disk"], report["compute"], report["runs"]
    notes = []
    if report.get("same_tokens") is not None:
        notes.append("same greedy tokens in both runs" if report["same_tokens"] else "the two runs produced DIFFERENT greedy tokens")
    if runs["kimitui"].get("streaming") is False:
        notes.append("hit rate, stall: — (the engine did not stream: the model fits its budget)")
    if runs["kimitui"].get("streaming"):
        notes.append(
            "needed: the streamed bytes compute used that were not in memory before the token "
            "(routed experts that missed the cache, trunk not pinned); read: from storage, readahead included"
        )
    if m["moe"] and runs["kimitui"].get("streaming"):
        hot = runs["kimitui"].get("hot_expert_bytes") or 0
        notes.append(
            f"the pinned set holds {format_bytes(hot)} of hot experts from the heatmap earlier runs saved"
            if hot else "no heatmap from earlier runs: the pinned set is the trunk alone, the expert cache starts empty"
        )
    if "baseline" in runs:
        notes.append("plain mmap has no cache counters: its hit rate and stall are —")
    if s["cgroup_limit_bytes"] is None:
        notes.append("peak cgroup: — (no --cgroup-limit: the runs share the caller's cgroup)")
    if runs["kimitui"].get("streaming"):
        extras = ", expert look-ahead on" if runs["kimitui"].get("expert_lookahead") else ""
        if runs["kimitui"].get("expert_trim"):
            skipped = runs["kimitui"].get("expert_routes_skipped")
            extras += f", expert {runs['kimitui']['expert_trim']} (lossy" + (f": {skipped:.1%} of decode's routes skipped)" if skipped is not None else ")")
        k = runs["kimitui"]
        placement = k.get("placement")
        if placement is None:
            reads = ", shards read into the file's own pages (no placement on this system)"
        else:
            reads = ", direct reads" if placement == "direct" else ", reads through the page cache (no O_DIRECT here) placed in anonymous memory"
            if k.get("page_cache_fallback_bytes_per_token"):
                reads += (
                    f" ({format_bytes(k['page_cache_fallback_bytes_per_token'])} per token stayed in the file's "
                    "pages instead: the buffer pool was spent)"
                )
        notes.append(
            f"kimitui streams with policy {k['policy']}, prefetch depth {k['prefetch_depth']}, "
            f"{k.get('io_threads')} I/O threads{extras}{reads}, prefill micro-batches of {k.get('n_ubatch')} tokens"
        )
        if k.get("plan_note"):
            notes.append(f"kimitui: {k['plan_note']}")
    for name, label in names:
        figures = runs[name]
        if figures["error"]:
            notes.append(f"{label} run failed: {figures['error']}")
        cached = figures["cached_at_start_bytes"]
        if cached and cached > 0.01 * m["file_bytes"]:
            notes.append(f"{label} run not cold: {format_bytes(cached)} of the model stayed cached (mapped by another process?)")
        for key in ("fast_load_note", "pin_note"):
            if figures.get(key):
                notes.append(f"{label}: {figures[key]}")
    noisy = noise_note(
        {f"disk read {i + 1}": d["others_cpu"] for i, d in enumerate(disk["samples"])}
        | {"compute in RAM": compute.get("others_cpu")}
        | {label: runs[name]["others_cpu"] for name, label in names}
    )
    if noisy:
        notes.append(noisy)
    if compute.get("decode_read_bytes"):
        notes.append(f"compute in RAM read {format_bytes(compute['decode_read_bytes'])} from storage while decoding")
    return notes


def render(report: dict) -> str:
    runs = report["runs"]
    names = [("kimitui", "kimitui")] + ([("baseline", "plain mmap")] if "baseline" in runs else [])
    lines = _summary(report) + _rounds(report, names) + ["", table(_table(report, names)), ""] + _verdicts(report)
    return "\n".join(lines + [f"note: {n}" for n in _notes(report, names)])
