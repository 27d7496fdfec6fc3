"""`kimitui bench-load`: from `kimitui` start to ready, against plain llama-cpp-python's load.

The app runs for real, headless, in a child process built from its own command line
(config file included, as a user starts it); the clock starts in this process just before
the child is spawned and stops when the child's "ready" line arrives, so interpreter start
and imports count: that is what a user waits for. Ready is the model loaded; reading the
pinned set comes after and is not counted. Storage reads are the child's own I/O counter
at that moment. The baseline constructs ``llama_cpp.Llama`` with stock settings (same
n_ctx and threads) from a fresh interpreter too, timed the same way. Both run in the same
kind of memory cgroup with ``--cgroup-limit``, with the model dropped from the page cache
before every run, alternating so that drift on the machine hits both alike.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from kimitui.benchmarks.cgroup import MemoryCgroups
from kimitui.benchmarks.common import cell, noise_note, ratio, run_child, table, write_json
from kimitui.errors import UserError
from kimitui.units import format_bytes

# The fast-start targets, shown beside the figures.
TARGET_READY_S = 3.0
TARGET_SHARE_OF_BASELINE = 0.10
TARGET_READ_SHARE = 0.01


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kimitui.cli import add_common

    add_common(parser)
    parser.add_argument("--cgroup-limit", help="run each start in a fresh memory cgroup of this size, e.g. 2GiB (root)")
    parser.add_argument("--repeat", type=int, default=3, help="starts of each kind (default 3)")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write every figure to FILE as JSON")
    parser.add_argument(
        "--no-baseline", action="store_true",
        help="kimitui's starts only (plain llama-cpp-python reads a model at load: minutes for a huge one)",
    )


def _argv(args: argparse.Namespace, model: Path) -> list[str]:
    """The app's own command line: the flags given here, passed on unchanged."""
    argv = ["--model", str(model)]
    flags = (
        ("--config", args.config), ("--budget", args.budget), ("--address-space", args.address_space),
        ("--n-ctx", args.n_ctx), ("--threads", args.threads),
    )
    for flag, value in flags:
        if value is not None:
            argv += [flag, str(value)]
    return argv


def _figures(run) -> dict:
    ready = run.messages.get("ready", {})
    resident = run.messages.get("resident", {})
    return {
        "error": run.error,
        "ready_s": run.seconds_until("ready") if not run.error else None,
        "load_s": ready.get("load_s"),
        "read_bytes": ready.get("read_bytes"),
        "model_cached_at_ready_bytes": resident.get("model_cached_bytes"),
        "peak_rss_bytes": resident.get("peak_rss_bytes"),
        "cgroup_peak_bytes": run.cgroup_peak,
        "cached_at_start_bytes": run.cached_at_start,
        "others_cpu": run.others_cpu,
        "fast_load_note": ready.get("fast_load_note"),
    }


def _median(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if r[key] is not None]
    return statistics.median(values) if values else None


def _metadata_bytes(model_map) -> int:
    """Header bytes of every file: what precedes its first tensor's data."""
    firsts: dict[int, int] = {}
    for t in model_map.tensors:
        firsts[t.file] = min(firsts.get(t.file, t.offset), t.offset)
    return sum(firsts.values())


def run(args: argparse.Namespace) -> int:
    from kimitui.cli import resolve_model, resolve_settings
    from kimitui.engine.session import default_threads
    from kimitui.model.gguf_map import load_model_map

    if args.repeat < 1:
        raise UserError("--repeat: at least 1")
    settings = resolve_settings(args)
    path = resolve_model(settings).resolve()
    model_map = load_model_map(path)
    limit, cgroups = MemoryCgroups.from_flag(args.cgroup_limit)
    n_ctx = settings["model.n_ctx"]
    threads = settings["model.n_threads"] or default_threads()
    app_spec = {"argv": _argv(args, path)}
    base_spec = {"model": str(path), "n_ctx": n_ctx, "threads": threads}
    app_runs, base_runs = [], []
    for _ in range(args.repeat):
        app_runs.append(_figures(run_child("app-load", app_spec, path, cgroups=cgroups, limit=limit, stop_after="result")))
        if not args.no_baseline:
            base_runs.append(_figures(run_child("llama-load", base_spec, path, cgroups=cgroups, limit=limit, stop_after="result")))
    file_bytes = sum(model_map.file_sizes)
    metadata = _metadata_bytes(model_map)
    summary = {}
    for name, runs in (("kimitui", app_runs), ("baseline", base_runs)):
        summary[name] = {key: _median(runs, key) for key in ("ready_s", "load_s", "read_bytes", "model_cached_at_ready_bytes", "others_cpu")}
        summary[name]["read_share_of_file"] = ratio(summary[name]["read_bytes"], file_bytes)
        summary[name]["cgroup_peak_bytes"] = max((r["cgroup_peak_bytes"] for r in runs if r["cgroup_peak_bytes"] is not None), default=None)
    k, b = summary["kimitui"], summary["baseline"]
    read_allowed = TARGET_READ_SHARE * model_map.tensor_bytes + metadata
    targets = {
        "ready_s_at_most": TARGET_READY_S,
        "share_of_baseline_at_most": TARGET_SHARE_OF_BASELINE,
        "read_bytes_at_most": read_allowed,
        "ready_met": None if k["ready_s"] is None else k["ready_s"] <= TARGET_READY_S,
        "share_of_baseline": ratio(k["ready_s"], b["ready_s"]),
        "read_met": None if k["read_bytes"] is None else k["read_bytes"] <= read_allowed,
    }
    share = targets["share_of_baseline"]
    targets["share_met"] = None if share is None else share <= TARGET_SHARE_OF_BASELINE
    report = {
        "model": {"path": str(path), "file_bytes": file_bytes, "tensor_bytes": model_map.tensor_bytes, "metadata_bytes": metadata},
        "settings": {
            "n_ctx": n_ctx,
            "threads": threads,
            "repeat": args.repeat,
            "app_argv": app_spec["argv"],
            "cgroup_limit_bytes": limit,
            "cgroup_version": cgroups.hierarchy.version if cgroups else None,
        },
        "runs": {"kimitui": app_runs, "baseline": base_runs},
        "median": summary,
        "targets": targets,
    }
    print(render(report))
    if args.json:
        write_json(args.json, report)
    return 1 if any(r["error"] for r in app_runs + base_runs) else 0


def render(report: dict) -> str:
    m, s, runs, med, t = report["model"], report["settings"], report["runs"], report["median"], report["targets"]
    cgroup = "none" if s["cgroup_limit_bytes"] is None else f"{format_bytes(s['cgroup_limit_bytes'])} ({s['cgroup_version']})"
    lines = [
        f"kimitui bench-load: {Path(m['path']).name} ({format_bytes(m['file_bytes'])}, metadata {format_bytes(m['metadata_bytes'])}), "
        f"memory cgroup {cgroup}, n_ctx {s['n_ctx']}, {s['threads']} threads, {s['repeat']} starts each, page cache dropped before each",
        "",
    ]

    def seconds(v):
        return cell(v, ".2f", unit=" s")

    def spread(name, key, fmt):
        return " ".join(fmt(r[key]) for r in runs[name])

    rows = [
        ("median of the starts", "kimitui app", "plain llama-cpp-python", "kimitui/plain"),
        ("start to ready", seconds(med["kimitui"]["ready_s"]), seconds(med["baseline"]["ready_s"]), cell(t["share_of_baseline"], ".3f", unit="x")),
        ("  each start", spread("kimitui", "ready_s", seconds), spread("baseline", "ready_s", seconds), ""),
        ("load call alone", seconds(med["kimitui"]["load_s"]), seconds(med["baseline"]["load_s"]), ""),
        ("read from storage", format_bytes(med["kimitui"]["read_bytes"]), format_bytes(med["baseline"]["read_bytes"]), ""),
        ("  of the model file", cell(med["kimitui"]["read_share_of_file"], ".2%"), cell(med["baseline"]["read_share_of_file"], ".2%"), ""),
        ("model cached at ready", format_bytes(med["kimitui"]["model_cached_at_ready_bytes"]), format_bytes(med["baseline"]["model_cached_at_ready_bytes"]), ""),
        ("peak cgroup (max)", format_bytes(med["kimitui"]["cgroup_peak_bytes"]), format_bytes(med["baseline"]["cgroup_peak_bytes"]), ""),
        ("CPU used by others", cell(med["kimitui"]["others_cpu"], ".0%"), cell(med["baseline"]["others_cpu"], ".0%"), ""),
    ]
    lines += [table(rows), ""]

    def verdict(met):
        return "—" if met is None else ("met" if met else "MISSED")

    lines.append(
        f"targets (fast start): ready <= {TARGET_READY_S:g} s: {verdict(t['ready_met'])}; "
        f"<= {TARGET_SHARE_OF_BASELINE:.0%} of plain: {verdict(t['share_met'])}; "
        f"read <= 1% of tensors + metadata ({format_bytes(t['read_bytes_at_most'])}): {verdict(t['read_met'])}"
    )
    notes = sorted({r["fast_load_note"] for r in runs["kimitui"] if r["fast_load_note"]})
    for name, label in (("kimitui", "kimitui app"), ("baseline", "plain llama-cpp-python")):
        for r in runs[name]:
            if r["error"]:
                notes.append(f"a {label} start failed: {r['error']}")
            if r["cached_at_start_bytes"] and r["cached_at_start_bytes"] > 0.01 * m["file_bytes"]:
                notes.append(f"a {label} start was not cold: {format_bytes(r['cached_at_start_bytes'])} of the model stayed cached")
    noisy = noise_note({f"{label} start {i + 1}": r["others_cpu"] for name, label in (("kimitui", "app"), ("baseline", "plain")) for i, r in enumerate(runs[name])})
    if noisy:
        notes.append(noisy)
    lines += [f"note: {n}" for n in notes]
    return "\n".join(lines)
