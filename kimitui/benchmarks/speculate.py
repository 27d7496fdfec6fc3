"""`kimitui bench-speculate`: speculative decoding against plain decoding, on the same engine
settings, for a task that copies text and for an open chat.

One engine, loaded with speculation on (its context computes attention as a speculating one
does); for each task, its replies without drafts and with them alternate (``--rounds`` each),
greedy, each evaluating its prompt afresh. For each reply: the tokens (both kinds must give the
same ones), the decode passes and tokens per pass, the drafts kept, the model bytes the engine
read for decoding (its own count: trunk shards and experts compute needed and did not have), and
decode tok/s. It runs in this process; nothing else should run beside.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from kimitui.benchmarks.common import cell, ratio, table, write_json
from kimitui.benchmarks.quality import BUILT_IN_TEXT
from kimitui.errors import UserError
from kimitui.units import format_bytes

# The built-in text's first paragraph with a few slips: the reply copies most of it back.
_PARAGRAPH = BUILT_IN_TEXT.split("\n\n")[0].replace("\n", " ")
TASKS = {
    "copy": "Correct the spelling in this paragraph and give it back, otherwise unchanged:\n\n"
            + _PARAGRAPH.replace("harbour", "harbor").replace("quarrelling", "quarreling").replace("breakwater", "brakewater"),
    "chat": "I have two days in Lisbon in spring. What should I see, and where should I eat?",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kimitui.cli import add_common

    add_common(parser)
    parser.add_argument("--tokens", type=int, default=96, help="tokens per reply (default 96)")
    parser.add_argument("--rounds", type=int, default=2, help="replies of each kind per task, alternating (default 2)")
    parser.add_argument("--task", choices=sorted(TASKS), action="append", help="one task (default: both)")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write every figure to FILE as JSON")


def _reply(engine, prompt: str, tokens: int) -> dict:
    from kimitui.engine.generation import Sampling

    def needed() -> int | None:
        return engine.streamer.counters()["bytes_needed"] if engine.streamer is not None else None

    gen = engine.chat([{"role": "user", "content": prompt}], Sampling(temperature=0.0, max_tokens=tokens, cache_prompt=False))
    ids: list[int] = []
    first_at = first_bytes = None
    for event in gen:
        if event.token_id < 0:
            continue
        ids.append(event.token_id)
        if first_at is None:
            first_at, first_bytes = time.perf_counter(), needed()
    ended, end_bytes = time.perf_counter(), needed()
    result = gen.result
    n_decode = len(ids) - 1
    drafts = result.speculation
    return {
        "tokens": ids,
        "decode_tok_s": n_decode / (ended - first_at) if n_decode > 0 and ended > first_at else None,
        "decode_bytes_per_token": (end_bytes - first_bytes) / n_decode if n_decode > 0 and first_bytes is not None else None,
        "passes": drafts.passes if drafts else n_decode,
        "tokens_per_pass": drafts.tokens_per_pass if drafts and drafts.passes else 1.0,
        "drafts_kept": drafts.acceptance if drafts else None,
    }


def run(args: argparse.Namespace) -> int:
    from kimitui.cli import check_budget, resolve_model, resolve_settings
    from kimitui.engine.session import engine_from_settings

    if args.tokens < 2 or args.rounds < 1:
        raise UserError("--tokens: at least 2; --rounds: at least 1")
    settings = resolve_settings(args)
    path = resolve_model(settings)
    budget = check_budget(settings, path)
    settings["engine.speculate"] = "lookup"
    engine = engine_from_settings(settings, path, budget)
    try:
        engine.load()
        engine.pin()
        figures: dict = {"model": str(path), "budget": budget, "streams": engine.streamer is not None, "tasks": {}}
        for task in args.task or sorted(TASKS):
            runs: dict[str, list[dict]] = {"off": [], "lookup": []}
            for n in range(args.rounds):
                for mode in (("off", "lookup") if n % 2 == 0 else ("lookup", "off")):
                    engine.speculate = mode
                    runs[mode].append(_reply(engine, TASKS[task], args.tokens))
            same = all(r["tokens"] == runs["off"][0]["tokens"] for r in runs["off"] + runs["lookup"])
            summary = {mode: _median(rs) for mode, rs in runs.items()}
            figures["tasks"][task] = {"same_tokens": same, **summary, "runs": runs}
            _print(task, summary, same, figures["streams"])
    finally:
        engine.close()
    if args.json:
        write_json(args.json, figures)
    return 0


def _median(runs: list[dict]) -> dict:
    def med(key):
        values = [r[key] for r in runs if r[key] is not None]
        return statistics.median(values) if values else None

    return {key: med(key) for key in ("decode_tok_s", "decode_bytes_per_token", "tokens_per_pass", "drafts_kept", "passes")} | {
        "tokens": len(runs[0]["tokens"]),
    }


def _print(task: str, summary: dict, same: bool, streams: bool) -> None:
    off, on = summary["off"], summary["lookup"]
    rows = [("", "speculation off", "lookup drafts")]
    rows.append(("tokens", str(off["tokens"]), str(on["tokens"])))
    rows.append(("decode passes", cell(off["passes"], ".0f"), cell(on["passes"], ".0f")))
    rows.append(("tokens per pass", cell(off["tokens_per_pass"], ".2f"), cell(on["tokens_per_pass"], ".2f")))
    rows.append(("drafts kept", "—", cell(on["drafts_kept"], ".0%")))
    rows.append(("read per token", *(format_bytes(int(s["decode_bytes_per_token"])) if s["decode_bytes_per_token"] is not None else "—" for s in (off, on))))
    rows.append(("decode tok/s", cell(off["decode_tok_s"], ".2f"), cell(on["decode_tok_s"], ".2f")))
    print(f"\n{task}: {TASKS[task][:60]}...")
    print(table(rows))
    fewer = ratio(off["decode_bytes_per_token"], on["decode_bytes_per_token"])
    faster = ratio(on["decode_tok_s"], off["decode_tok_s"])
    print(f"same tokens: {'yes' if same else 'NO'}; bytes per token {cell(fewer, '.2f', unit='x')} fewer with drafts; "
          f"decode {cell(faster, '.2f', unit='x')} as fast" + ("" if streams else " (the model fits the budget: nothing streams, so nothing is drafted)"))
