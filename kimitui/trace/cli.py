"""`kimitui trace summarize|compare|bench`: read traces back, or time what tracing costs."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from kimitui.errors import UserError
from kimitui.trace.reader import read_trace
from kimitui.trace.summary import summarize
from kimitui.units import format_bytes, format_ms, format_rate

MATTERS_REL = 0.05  # a change of 5% (or 5 points for shares and rates) is worth a look
MATTERS_PP = 0.05


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="summarize|compare|routing|bench")
    s = sub.add_parser("summarize", help="per request and overall: TTFT, tok/s, latency, time split, bytes, hit rate, slowest tokens")
    s.add_argument("files", nargs="+", type=Path, metavar="FILE", help="trace file(s); for a rotated run, oldest first")
    s.add_argument("--slowest", type=int, default=5, metavar="N", help="how many of the slowest tokens to explain (default 5)")
    s.add_argument("--json", action="store_true", help="print the summary as JSON")
    c = sub.add_parser("compare", help="two runs side by side, the differences that matter marked")
    c.add_argument("a", type=Path, metavar="A", help="trace of the first run")
    c.add_argument("b", type=Path, metavar="B", help="trace of the second run")
    c.add_argument("--json", action="store_true", help="print the comparison as JSON")
    r = sub.add_parser("routing", help="the expert cache's hit rate against the offline optimum (Belady), LRU and LFU on the traced routing")
    r.add_argument("files", nargs="+", type=Path, metavar="FILE", help="trace file(s); for a rotated run, oldest first")
    r.add_argument("--slots", type=int, metavar="N", help="experts the cache holds (default: what the trace says)")
    r.add_argument("--json", action="store_true", help="print the report as JSON")
    b = sub.add_parser("bench", help="decode speed with tracing on vs off on a streamed model")
    from kimitui.trace.bench import add_arguments as bench_arguments

    bench_arguments(b)


def run(args: argparse.Namespace) -> int:
    if args.action == "bench":
        from kimitui.trace.bench import run as bench

        return bench(args)
    console = _console()
    if args.action == "routing":
        from kimitui.trace.routing import report

        if args.slots is not None and args.slots < 1:
            raise UserError("--slots must be 1 or more")
        result = report(read_trace(args.files), args.slots)
        if args.json:
            print(json.dumps(result, indent=2))
        elif "error" in result:
            raise UserError(f"{args.files[-1]}: {result['error']}")
        else:
            render_routing(console, result)
        return 0
    if args.action == "summarize":
        summary = summarize(read_trace(args.files), args.slowest)
        if args.json:
            print(json.dumps(summary, indent=2))
        else:
            render_summary(console, summary)
        return 0
    result = compare(summarize(read_trace([args.a])), summarize(read_trace([args.b])))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        render_compare(console, result, args.a.name, args.b.name)
    return 0


def render_routing(console: Console, r: dict) -> None:
    console.print(
        f"{r['choices']} router choices, {r['experts_asked']} experts asked for ({r['distinct_experts']} distinct), "
        f"a cache of {r['slots']} experts (policy {', '.join(r['expert_policies'])})"
    )
    console.print(f"  engine       {_pct(r['engine_hit_rate'])} hits")
    console.print(f"  optimum      {_pct(r['belady_hit_rate'])} (Belady: offline, evicts the expert used farthest ahead)")
    console.print(f"  LRU          {_pct(r['lru_hit_rate'])}")
    console.print(f"  LFU          {_pct(r['lfu_hit_rate'])} (counts from this trace only)")
    console.print(f"  best fixed   {_pct(r['static_hit_rate'])} (the experts this trace used most, chosen in hindsight)")
    ratio = r["engine_vs_belady"]
    console.print(f"  engine / optimum: {'—' if ratio is None else f'{ratio:.0%}'} of the optimum's hits")


def _console() -> Console:
    console = Console(highlight=False)
    if not console.is_terminal:
        console.width = max(console.width, 160)  # piped: whole rows, never wrapped mid-table
    return console


# -- formatting ------------------------------------------------------------------------------

def _pct(x: float | None) -> str:
    return "—" if x is None else f"{x:.0%}"


def _tok_s(x: float | None) -> str:
    return "—" if x is None else f"{x:.1f}"


def _int(x: int | None) -> str:
    return "—" if x is None else f"{x:,}"


def _text(x) -> str:
    return "—" if x is None else str(x)


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}" + ("" if n == 1 else "s")


def _yes_no(x: bool | None) -> str:
    return "—" if x is None else "yes" if x else "no"


def settings_line(s: dict) -> str:
    budget = format_bytes(s.get("budget")) if s.get("budget") is not None else "none"
    return (
        f"budget {budget} · shard {format_bytes(s.get('shard_size'))} · prefetch {_text(s.get('prefetch_depth'))} · "
        f"{_text(s.get('policy'))} · pinned {format_bytes(s.get('pinned_bytes'))} · "
        + ("streaming" if s.get("streaming") else "not streamed")
    )


def _prefetch(m: dict) -> str:
    if m["prefetch_accuracy"] is None:
        return "—"
    return f"{m['prefetch_accuracy']:.0%} of {m['prefetch_issued']:,}"


def render_summary(console: Console, summary: dict) -> None:
    o = summary["overall"]
    console.print(
        Text.assemble(
            (", ".join(summary["files"]), "bold"),
            f" — {_plural(o['requests'], 'request')} · {_plural(o['tokens'], 'token')} · {', '.join(summary['models']) or 'no model'}",
        )
    )
    for n, s in enumerate(summary["settings"], start=1):
        label = "settings" if len(summary["settings"]) == 1 else f"settings {n}"
        console.print(f"{label}: {settings_line(s)}")
    table = Table(box=None, pad_edge=False, header_style="bold")
    for name in ("request", "tokens", "TTFT", "tok/s", "p50", "p95", "I/O wait", "compute", "other", "read/token", "hit rate", "prefetch", "finish"):
        table.add_column(name, justify="left" if name in ("request", "finish") else "right", no_wrap=True)

    def row(name: str, m: dict, finish: str, style: str = "") -> None:
        table.add_row(
            name, _int(m["tokens"]), format_ms(m["ttft_s"]), _tok_s(m["decode_tok_s"]), format_ms(m["p50_s"]),
            format_ms(m["p95_s"]), _pct(m["io_wait_share"]), _pct(m["compute_share"]), _pct(m["other_share"]),
            format_bytes(m["bytes_per_token"]), _pct(m["hit_rate"]), _prefetch(m), finish, style=style,
        )

    for r in summary["requests"]:
        row(r["id"], r, _text(r["finish"]) + (f": {r['error']}" if r["error"] else ""))
    row("overall", o, "", "bold")
    console.print(table)
    if o["streamed_requests"] < o["requests"]:
        console.print(
            f"{o['requests'] - o['streamed_requests']} request(s) of a model not streamed: no storage counters "
            "(I/O wait, bytes, hit rate show —)"
        )
    reads = o["reads"]
    if not reads["count"]:
        line = "storage reads: none recorded"
    else:
        line = f"storage reads: {reads['count']:,} · {format_bytes(reads['bytes'])} · {format_rate(reads['rate_bytes_s'])} while reading"
    if o["idle_bytes_read"]:
        line += f" · {format_bytes(o['idle_bytes_read'])} landed between requests (read-ahead after a reply's last token)"
    console.print(line)
    slow = summary["slowest"]
    if slow:
        console.print(Text("slowest decode tokens", style="bold"))
        for t in slow:
            times = f"{format_ms(t['wall_s'])}" + (f" ({t['x_median']:.1f}× median)" if t["x_median"] else "")
            if t["stall_s"] is None:
                detail = t["why"]
            else:
                detail = (
                    f"{t['why']}: stall {format_ms(t['stall_s'])}, compute {format_ms(t['compute_s'])} · "
                    f"read {format_bytes(t['bytes_read'])} · {t['hits']} hits / {t['misses']} misses"
                )
            style = "red" if t["why"] == "stall-dominated" else ""
            console.print(Text.assemble(f"  {t['req']} #{t['i']}  {times}  ", (detail, style)))


# -- compare ---------------------------------------------------------------------------------

SETTINGS = (
    ("budget", "budget", format_bytes), ("shard_size", "shard size", format_bytes),
    ("prefetch_depth", "prefetch depth", _text), ("policy", "policy", _text),
    ("pinned_bytes", "pinned", format_bytes), ("streaming", "streaming", _yes_no),
)
# key, label, format, which way is better (None: neither), change in % ("rel") or points ("pp")
METRICS = (
    ("requests", "requests", _int, None, "rel"),
    ("tokens", "tokens", _int, None, "rel"),
    ("ttft_s", "TTFT", format_ms, "lower", "rel"),
    ("decode_tok_s", "decode tok/s", _tok_s, "higher", "rel"),
    ("p50_s", "p50 token", format_ms, "lower", "rel"),
    ("p95_s", "p95 token", format_ms, "lower", "rel"),
    ("io_wait_share", "I/O wait", _pct, "lower", "pp"),
    ("compute_share", "compute", _pct, None, "pp"),
    ("other_share", "other", _pct, None, "pp"),
    ("bytes_per_token", "read per token", format_bytes, "lower", "rel"),
    ("cache_bytes_per_token", "cache per token", format_bytes, None, "rel"),
    ("hit_rate", "hit rate", _pct, "higher", "pp"),
    ("prefetch_accuracy", "prefetch accuracy", _pct, "higher", "pp"),
    ("read_rate", "read rate", format_rate, "higher", "rel"),
)


def _setting(summary: dict, key: str):
    values = {repr(s.get(key)) for s in summary["settings"]}
    if len(values) > 1:
        return "varies"
    return summary["settings"][0].get(key) if summary["settings"] else None


def _change(a, b, better: str | None, kind: str) -> dict:
    out = {"change": None, "unit": "%" if kind == "rel" else "pp", "verdict": None, "matters": False}
    if a is None or b is None:
        return out
    if kind == "pp":
        change = (b - a) * 100
        matters = abs(b - a) >= MATTERS_PP
    elif a == 0:
        return out
    else:
        change = (b - a) / abs(a) * 100
        matters = abs(change) >= MATTERS_REL * 100
    out["change"] = round(change, 2)
    out["matters"] = matters and better is not None
    if out["matters"]:
        out["verdict"] = "better" if (b > a) == (better == "higher") else "worse"
    return out


def compare(a: dict, b: dict) -> dict:
    settings = []
    for key, label, _ in SETTINGS:
        va, vb = _setting(a, key), _setting(b, key)
        settings.append({"key": key, "label": label, "a": va, "b": vb, "differs": va != vb})
    metrics = []
    for key, label, _, better, kind in METRICS:
        oa, ob = a["overall"], b["overall"]
        va = oa["reads"]["rate_bytes_s"] if key == "read_rate" else oa[key]
        vb = ob["reads"]["rate_bytes_s"] if key == "read_rate" else ob[key]
        metrics.append({"key": key, "label": label, "a": va, "b": vb, "better": better, **_change(va, vb, better, kind)})
    return {
        "a": {"files": a["files"], "models": a["models"], "overall": a["overall"]},
        "b": {"files": b["files"], "models": b["models"], "overall": b["overall"]},
        "settings": settings,
        "metrics": metrics,
    }


def render_compare(console: Console, result: dict, name_a: str, name_b: str) -> None:
    table = Table(box=None, pad_edge=False, header_style="bold")
    table.add_column("")
    table.add_column(name_a, justify="right", no_wrap=True)
    table.add_column(name_b, justify="right", no_wrap=True)
    table.add_column("change", no_wrap=True)
    models_a, models_b = ", ".join(result["a"]["models"]), ", ".join(result["b"]["models"])
    table.add_row("model", models_a, models_b, "≠" if models_a != models_b else "", style="bold" if models_a != models_b else "")
    formats = {key: fmt for key, _, fmt in SETTINGS}
    for s in result["settings"]:
        a, b = (v if v == "varies" else formats[s["key"]](v) for v in (s["a"], s["b"]))
        table.add_row(s["label"], a, b, "≠" if s["differs"] else "", style="bold" if s["differs"] else "")
    table.add_section()
    formats = {key: fmt for key, _, fmt, _, _ in METRICS}
    for m in result["metrics"]:
        fmt = formats[m["key"]]
        if m["change"] is None:
            change = Text("—", style="dim")
        else:
            arrow = "▲" if m["change"] > 0 else "▼" if m["change"] < 0 else "="
            amount = f"{abs(m['change']):.1f}{'%' if m['unit'] == '%' else ' pp'}"
            style = {"better": "green", "worse": "bold red"}.get(m["verdict"], "dim")
            change = Text(f"{arrow} {amount}" + (f"  {m['verdict']}" if m["verdict"] else ""), style=style)
        table.add_row(m["label"], fmt(m["a"]), fmt(m["b"]), change)
    console.print(table)
