"""`kimitui bench-scale`: what grows with the model, measured on one start and one reply.

Made for the full-size Kimi K3 (a sparse split set from ``kimitui synth --like kimi-k3 --scale 1
--sparse --split-size 46GiB``), where small models hide the counts: the child starts the engine
under the budget (in a fresh memory cgroup of ``--cgroup-limit`` when given) and reports start
to loaded and the bytes that took,
the plan and the pinned set, then one greedy reply with, per token, the bytes the engine read
(its own counters: file holes cost no device I/O, so bytes are the figure and time a
by-product), the eval callback's calls and Python time, and at the end the kernel mappings,
open descriptors and the engine's own memory, each against its limit.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import resource
import sys
import time
from pathlib import Path

from kimitui.units import format_bytes, size_option


def _io() -> dict[str, int]:
    """This process's read syscalls' bytes (rchar: holes included) and device reads (read_bytes)."""
    out = {}
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            key, value = line.split(":")
            out[key] = int(value)
    except OSError:
        pass
    return {"rchar": out.get("rchar", 0), "read_bytes": out.get("read_bytes", 0)}


def _mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def _max_map_count() -> int | None:
    try:
        return int(Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        return None


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def callback_overhead_s(calls: int = 200_000) -> float:
    """What entering and leaving one ctypes callback from C costs, alone: libc's qsort calls a
    Python comparator that does nothing (ggml's eval callback pays the same way in and out)."""
    libc = ctypes.CDLL(None)
    compare_t = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
    counter = [0]

    def compare(_a, _b):
        counter[0] += 1
        return 0

    comparator = compare_t(compare)
    n = 4096
    items = (ctypes.c_int * n)()
    started = time.perf_counter()
    while counter[0] < calls:
        libc.qsort(items, n, ctypes.sizeof(ctypes.c_int), comparator)
    return (time.perf_counter() - started) / counter[0]


def deep_size(root) -> int:
    """Bytes of the Python objects reachable from ``root`` (not modules, classes or functions;
    numpy views of the model's mapping count their headers only)."""
    import types

    skip = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType)
    seen, stack, total = set(), [root], 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, skip):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        stack.extend(gc.get_referents(obj))
    return total


def phase_scale(spec: dict) -> None:
    from kimitui.benchmarks.messages import emit
    from kimitui.engine.memory import mapped_resident_bytes
    from kimitui.engine.generation import Sampling
    from kimitui.engine.session import Engine
    from kimitui.engine.streaming import StreamSettings

    io0, maps0, fds0 = _io(), _mappings(), _open_fds()
    started = time.perf_counter()
    engine = Engine(
        Path(spec["model"]), n_ctx=spec["n_ctx"], n_threads=spec["threads"], budget=spec["budget"],
        stream_settings=StreamSettings(prefetch_depth=spec["prefetch_depth"]),
    )
    engine.load()
    loaded_s = time.perf_counter() - started
    io1 = _io()
    emit(
        "loaded", seconds=loaded_s, rchar=io1["rchar"] - io0["rchar"], read_bytes=io1["read_bytes"] - io0["read_bytes"],
        model_bytes=engine.inspect().file_bytes, files=len(engine.inspect().files), mappings=_mappings() - maps0,
        fds=_open_fds() - fds0, working_bytes=engine.working_bytes, fast_load_note=engine.fast_load_note,
    )
    started = time.perf_counter()
    engine.pin()
    streamer = engine.streamer
    if streamer is None:
        emit("error", message="the model fits the budget: nothing streams, nothing to measure at scale")
        return
    plan = engine.plan
    emit(
        "pinned", seconds=time.perf_counter() - started, pinned_bytes=engine.pinned.bytes,
        pinned_shards=len(plan.pinned), hot_expert_bytes=plan.hot_expert_bytes, prefetch_depth=plan.prefetch_depth,
        expert_cache_bytes=plan.expert_bytes, ubatch=plan.ubatch, pin_note=engine.pinned.note,
    )
    spans = [(m.address, m.address + m.length) for m in engine.mappings.values()]
    tokens, marks = [], []

    def mark() -> None:
        now = time.perf_counter()  # before the /proc reads below, which are not the token's
        c = streamer.counters()
        marks.append({
            "t": now, "bytes_read": c["bytes_read"], "expert_bytes_needed": c["expert_bytes_needed"] or 0,
            "bytes_needed": c["bytes_needed"], "stall_s": c["stall_s"],
            **{k: c[k] for k in ("eval_asks", "eval_ask_s", "eval_observed", "eval_observe_s")},
            "expert_hits": c["expert_hits"] or 0, "expert_misses": c["expert_misses"] or 0,
            "model_resident": mapped_resident_bytes(spans), "mappings": _mappings(),
        })

    peak_maps = _mappings()
    mark()
    reply = engine.complete(spec["prompt"], Sampling(temperature=0.0, max_tokens=spec["tokens"]))
    for event in reply:
        if event.token_id >= 0:
            tokens.append(event.token_id)
            mark()
            peak_maps = max(peak_maps, marks[-1]["mappings"])
            emit("token", n=len(tokens), seconds=marks[-1]["t"] - marks[-2]["t"], bytes_read=marks[-1]["bytes_read"] - marks[-2]["bytes_read"])
    per_token = [{k: b[k] - a[k] for k in b if k not in ("model_resident", "mappings")} | {"model_resident": b["model_resident"]}
                 for a, b in zip(marks, marks[1:])]
    experts = streamer.experts
    emit(
        "result",
        tokens=tokens,
        prompt_tokens=reply.result.prompt_tokens if hasattr(reply.result, "prompt_tokens") else None,
        finish=reply.result.finish_reason,
        per_token=per_token,
        callback_overhead_s=callback_overhead_s(),
        mappings=_mappings(), peak_mappings=peak_maps, max_map_count=_max_map_count(),
        fds=_open_fds(), fd_limit=resource.getrlimit(resource.RLIMIT_NOFILE)[0],
        rss=_rss_bytes(), model_resident=mapped_resident_bytes(spans), working_bytes=engine.working_bytes,
        heatmap_bytes=deep_size(experts.counts) if experts is not None else 0,
        expert_tables_bytes=deep_size(experts) - (deep_size(experts.counts) + deep_size(experts.model)) if experts is not None else 0,
        model_map_bytes=deep_size(engine.model_map()),
        streamer_bytes=deep_size(streamer) ,
        budget=spec["budget"],
    )
    engine.close()


def _rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


# --- the parent ----------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", "-m", type=Path, required=True, help="GGUF (any file of a split set)")
    parser.add_argument("--budget", required=True, help="memory budget, e.g. 6GiB")
    parser.add_argument("--cgroup-limit", help="run in a fresh memory cgroup of this size, e.g. 8GiB (root)")
    parser.add_argument("--tokens", type=int, default=4, help="tokens to generate (default 4)")
    parser.add_argument("--prompt", default="Hi", help="prompt text (default 'Hi': a short prefill)")
    parser.add_argument("--n-ctx", type=int, default=256, help="context length (default 256)")
    parser.add_argument("--threads", type=int, default=0, help="compute threads (0 = one per physical core)")
    parser.add_argument("--prefetch-depth", type=int, default=1, help="layers read ahead (default 1; the plan may lower it)")
    parser.add_argument("--json", type=Path, help="also write every figure to FILE as JSON")


def run(args: argparse.Namespace) -> int:
    from kimitui.benchmarks.cgroup import MemoryCgroups
    from kimitui.benchmarks.common import run_child, write_json
    from kimitui.engine.session import default_threads
    from kimitui.errors import UserError

    budget = size_option(args.budget, "--budget")
    limit, cgroups = MemoryCgroups.from_flag(args.cgroup_limit)
    spec = {
        "model": str(args.model), "budget": budget, "tokens": args.tokens, "prompt": args.prompt, "n_ctx": args.n_ctx,
        "threads": args.threads or default_threads(), "prefetch_depth": args.prefetch_depth,
    }

    def progress(kind: str, message: dict) -> None:
        if kind == "loaded":
            print(f"loaded in {message['seconds']:.2f} s", flush=True)
        elif kind == "pinned":
            print(f"pinned {format_bytes(message['pinned_bytes'])} in {message['seconds']:.1f} s", flush=True)
        elif kind == "token":
            print(f"token {message['n']}: {message['seconds']:.1f} s, {format_bytes(message['bytes_read'])} read", flush=True)

    run_ = run_child("scale", spec, args.model, cgroups=cgroups, limit=limit, on_message=progress)
    if run_.error:
        raise UserError(f"bench-scale: {run_.error}")
    figures = {"spec": spec, "cgroup_limit": limit, "cgroup_peak": run_.cgroup_peak, **{k: run_.messages.get(k) for k in ("loaded", "pinned", "result")}}
    for line in report(figures):
        print(line)
    if args.json:
        write_json(args.json, figures)
    return 0


def report(f: dict) -> list[str]:
    loaded, pinned, r = f["loaded"], f["pinned"], f["result"]
    lines = [
        f"start to loaded: {loaded['seconds']:.2f} s; read {format_bytes(loaded['rchar'])} by syscalls "
        f"({loaded['rchar'] / loaded['model_bytes']:.4%} of {format_bytes(loaded['model_bytes'])} in {loaded['files']} files), "
        f"{format_bytes(loaded['read_bytes'])} from the device",
        f"pinned set: {format_bytes(pinned['pinned_bytes'])} ({pinned['pinned_shards']} shards) in {pinned['seconds']:.1f} s; "
        f"prefetch depth {pinned['prefetch_depth']}, prefill micro-batch {pinned['ubatch']}",
    ]
    per = r["per_token"]
    if not per:
        return lines + [f"reply: no token ({r['finish']}): nothing per token to report"]
    decode = per[1:] or per
    lines.append(f"reply: {len(r['tokens'])} tokens {r['tokens']} ({r['finish']})")
    entry = r["callback_overhead_s"]
    for i, t in enumerate(per):
        # What is not waiting on reads: compute, and the engine's own work on the compute thread.
        compute = t["t"] - t["stall_s"]
        asking = t["eval_ask_s"] + t["eval_asks"] * entry
        work = t["eval_observe_s"] + t["eval_observed"] * entry - t["stall_s"]
        lines.append(
            f"  token {i + 1}{' (prompt)' if i == 0 else ''}: {t['t']:.1f} s, read {format_bytes(t['bytes_read'])} "
            f"(experts needed {format_bytes(t['expert_bytes_needed'])}, expert hits {t['expert_hits']}/{t['expert_hits'] + t['expert_misses']}), "
            f"stall {t['stall_s']:.1f} s; eval callback: {t['eval_asks']:,} nodes asked about in {asking * 1000:.1f} ms "
            f"({asking / max(compute, 1e-9):.2%} of the {compute:.1f} s not stalled), {t['eval_observed']:,} observed, "
            f"their streaming work {work * 1000:.0f} ms beside the stall ({work / max(compute, 1e-9):.1%})"
        )
    mean_read = sum(t["bytes_read"] for t in decode) / len(decode)
    lines.append(f"decode: {format_bytes(mean_read)} read per token on average")
    margin = lambda used, limit: f"{used:,} of {limit:,} ({used / limit:.1%})" if limit else f"{used:,}"  # noqa: E731
    lines += [
        f"kernel mappings: {margin(r['peak_mappings'], r['max_map_count'])} at the peak, {r['mappings']:,} at the end",
        f"open descriptors: {margin(r['fds'], r['fd_limit'])}",
        f"memory: the model's pages {format_bytes(r['model_resident'])} of the {format_bytes(r['budget'])} budget "
        f"({r['model_resident'] / r['budget']:.0%}; peak over the reply {format_bytes(max(t['model_resident'] for t in per))}); "
        f"RSS {format_bytes(r['rss'])} (llama.cpp's working memory beside the budget, by its address space: "
        f"{format_bytes(r['working_bytes'])}); cgroup peak "
        f"{format_bytes(f['cgroup_peak']) if f['cgroup_peak'] else '—'} of {format_bytes(f['cgroup_limit']) if f['cgroup_limit'] else '—'}",
        f"engine's own: heatmap {format_bytes(r['heatmap_bytes'])}, expert cache tables {format_bytes(r['expert_tables_bytes'])}, "
        f"model map {format_bytes(r['model_map_bytes'])}, streamer in all {format_bytes(r['streamer_bytes'])}",
    ]
    return lines
