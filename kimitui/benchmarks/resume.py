"""`kimitui bench-resume`: a restart in the middle of a long conversation, with its saved state
against evaluating the conversation again.

Three fresh processes, the model dropped from the page cache before each: the first has a
conversation of ``--conversation-tokens`` (a long message and a short reply) and saves its
state as the app does; then, alternating, the conversation's next message from the saved state
and the same message with no state (every earlier token evaluated again), each timed from the
request to its first token, with the model bytes the engine read and the storage bytes the
process read (the state file's included). Greedy: both must give the same first token.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
from pathlib import Path

from kimitui.benchmarks.cgroup import MemoryCgroups
from kimitui.benchmarks.child import CONVERSATION_KEY
from kimitui.engine.saved_states import SavedStates
from kimitui.benchmarks.common import cell, ratio, run_child, table, write_json
from kimitui.errors import UserError
from kimitui.units import format_bytes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kimitui.cli import add_common

    add_common(parser)
    parser.add_argument("--conversation-tokens", type=int, default=2000, help="tokens of the conversation before the restart (default 2000)")
    parser.add_argument("--cgroup-limit", help="run each process in a fresh memory cgroup of this size, e.g. 8GiB (root)")
    parser.add_argument("--repeat", type=int, default=2, help="restarts of each kind (default 2)")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write every figure to FILE as JSON")


def run(args: argparse.Namespace) -> int:
    from kimitui.cli import resolve_model, resolve_settings
    from kimitui.engine.session import default_threads

    if args.conversation_tokens < 16 or args.repeat < 1:
        raise UserError("--conversation-tokens: at least 16; --repeat: at least 1")
    settings = resolve_settings(args)
    path = resolve_model(settings).resolve()
    limit, cgroups = MemoryCgroups.from_flag(args.cgroup_limit)
    budget = settings["engine.budget"]
    n_ctx = max(settings["model.n_ctx"], args.conversation_tokens + 256)
    with tempfile.TemporaryDirectory(prefix="kimitui-resume-") as states:
        base = {
            "model": str(path), "n_ctx": n_ctx, "threads": settings["model.n_threads"] or default_threads(),
            "budget": None if budget == "auto" else budget, "address_space": settings["engine.address_space"],
            "states_dir": states, "conversation_tokens": args.conversation_tokens, "reply_tokens": 8,
        }

        def child(**spec):
            run = run_child("conversation", {**base, **spec}, path, cgroups=cgroups, limit=limit)
            if run.error:
                raise UserError(f"bench-resume: {run.error}")
            return {**run.result, "cgroup_peak_bytes": run.cgroup_peak, "others_cpu": run.others_cpu}

        built = child(build=True, use_state=True)
        runs: dict[str, list[dict]] = {"saved state": [], "evaluated again": []}
        for n in range(args.repeat):
            # Each restart from a copy of the built state: a measured run saves its own at its end.
            copy = Path(states) / f"run-{n}"
            copy.mkdir()
            saved = SavedStates(Path(states), 0, "", 0, "").path(CONVERSATION_KEY)
            shutil.copyfile(saved, copy / saved.name)
            with open(copy / saved.name, "rb+") as written:  # on the disk, so the child can drop it from the cache
                os.fsync(written.fileno())
            runs["saved state"].append(child(build=False, use_state=True, messages=built["messages"], states_dir=str(copy)))
            runs["evaluated again"].append(child(build=False, use_state=False, messages=built["messages"]))
    median = {
        name: {key: statistics.median(r[key] for r in rs if r[key] is not None) if any(r[key] is not None for r in rs) else None
               for key in ("ttft_s", "engine_read_bytes", "storage_read_bytes", "evaluated_tokens", "prompt_tokens")}
        for name, rs in runs.items()
    }
    firsts = {r["first_token"] for rs in runs.values() for r in rs}
    report = {
        "model": str(path), "n_ctx": n_ctx, "budget": base["budget"], "cgroup_limit_bytes": limit,
        "conversation_tokens": built["prompt_tokens"], "state_bytes": built["state_bytes"],
        "runs": runs, "median": median, "same_first_token": len(firsts) == 1,
    }
    print(render(report))
    if args.json:
        write_json(args.json, report)
    notices = [n for rs in runs.values() for r in rs for n in r["notices"]]
    for notice in notices:
        print(f"notice: {notice}")
    return 0 if report["same_first_token"] and not notices else 1


def render(report: dict) -> str:
    m = report["median"]
    s, e = m["saved state"], m["evaluated again"]
    cgroup = "none" if report["cgroup_limit_bytes"] is None else format_bytes(report["cgroup_limit_bytes"])
    budget = "auto" if report["budget"] is None else format_bytes(report["budget"])
    lines = [
        f"kimitui bench-resume: {Path(report['model']).name}, a conversation of {report['conversation_tokens']} tokens, "
        f"budget {budget}, memory cgroup {cgroup}, n_ctx {report['n_ctx']}; its saved state {format_bytes(report['state_bytes'] or 0)}; "
        f"page cache dropped before each process",
        "",
    ]
    rows = [
        ("median of the restarts", "saved state", "evaluated again", "saved/again"),
        ("request to first token", cell(s["ttft_s"], ".2f", unit=" s"), cell(e["ttft_s"], ".2f", unit=" s"), cell(ratio(s["ttft_s"], e["ttft_s"]), ".3f", unit="x")),
        ("tokens evaluated (prompt " + f"{s['prompt_tokens']})", f"{s['evaluated_tokens']}", f"{e['evaluated_tokens']}", ""),
        ("model bytes the engine read", format_bytes(s["engine_read_bytes"] or 0), format_bytes(e["engine_read_bytes"] or 0),
         cell(ratio(s["engine_read_bytes"], e["engine_read_bytes"]), ".3f", unit="x")),
        ("storage bytes the process read", format_bytes(s["storage_read_bytes"] or 0), format_bytes(e["storage_read_bytes"] or 0),
         cell(ratio(s["storage_read_bytes"], e["storage_read_bytes"]), ".3f", unit="x")),
    ]
    lines.append(table(rows))
    lines.append("")
    lines.append("same greedy first token: " + ("yes" if report["same_first_token"] else "NO"))
    return "\n".join(lines)
