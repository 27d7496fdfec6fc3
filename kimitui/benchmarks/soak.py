"""`kimitui bench-soak`: hours of phone use, squeezed: mixed API traffic and chats in the app
against a streamed model, with the drive cut and restored twice.

The app runs for real, headless (Textual's ``run_test``), with its API served from the same
engine (``--serve``), exactly as ``kimitui --serve`` runs it. Beside it, clients send a few
hundred requests, several at once: plain and streamed completions and chats, streams
abandoned after a chunk or two, requests given up on by a client timeout, streams cancelled,
requests that are the client's own mistake, health and metrics probes. Every few dozen
requests the user sends a chat message in the app. Twice, the model file (a copy: the bench
cuts it) loses its second half for a while and then gets it back, the same inode, as when a
cable is pulled and plugged back in.

What must hold, and is reported: no 5xx except while the file is cut, and there only the
engine's own one-line error; every request after a restore answered; every chat message and
reply in the history database; threads, open descriptors and RSS about the same at the end
as at the start (after a warm-up).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path

from kimitui.benchmarks.common import table, write_json
from kimitui.errors import UserError
from kimitui.units import format_bytes

KINDS = (
    ("completion", 30), ("chat-stream", 18), ("abandon", 14), ("timeout", 8), ("cancel", 10),
    ("bad-json", 4), ("bad-type", 3), ("probe", 13),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, type=Path, help="a GGUF larger than --budget, so that it streams")
    parser.add_argument("--budget", required=True, help="memory budget, e.g. 120MiB")
    parser.add_argument("--requests", type=int, default=300, help="API requests in all (default 300)")
    parser.add_argument("--clients", type=int, default=3, help="requests in flight at once (default 3)")
    parser.add_argument("--chat-every", type=int, default=40, help="an app chat message every N requests (default 40)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--work-dir", type=Path, help="where the model's working copy goes (default: beside the model)")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write every figure to FILE as JSON")


def _process_figures(engine) -> dict:
    """Threads, descriptors, RSS, and RSS outside the model's pages (which come and go with
    what streams, within the budget)."""
    import gc

    import psutil

    gc.collect()
    proc = psutil.Process()
    rss = proc.memory_info().rss
    source = engine.metrics.model_resident_source
    model = source() if source is not None else None
    return {
        "threads": proc.num_threads(),
        "fds": len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else proc.num_fds(),
        "rss_bytes": rss,
        "model_bytes": model,
        "other_bytes": rss - model if model is not None else None,
    }


class Drive:
    """The model file's working copy, cut to half and made whole again on demand."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.size = path.stat().st_size
        with open(path, "rb") as f:
            f.seek(self.size // 2)
            self._tail = f.read()
        self.cut_now = False

    def cut(self) -> None:
        os.truncate(self.path, self.size // 2)
        self.cut_now = True

    def restore(self) -> None:
        with open(self.path, "r+b") as f:
            f.seek(self.size // 2)
            f.write(self._tail)
        self.cut_now = False


async def _one(client, url: str, kind: str, rng: random.Random) -> tuple[int | None, str]:
    """One request of ``kind``; (status, what happened)."""
    import httpx

    prompt = rng.choice(["Once upon a time", "The weather today", "Tell me a story", "List three colours"])
    chat = {"messages": [{"role": "user", "content": prompt}], "temperature": 0.7, "seed": rng.randrange(1 << 30)}
    if kind == "completion":
        r = await client.post(url + "/completion", json={"prompt": prompt, "n_predict": rng.randint(2, 12)})
        return r.status_code, r.text[:400] if r.status_code >= 400 else "ok"
    if kind in ("chat-stream", "abandon", "cancel"):
        body = {**chat, "stream": True, "max_tokens": 24 if kind != "chat-stream" else rng.randint(4, 16)}
        chunks = 0
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return r.status_code, (await r.aread()).decode(errors="replace")[:400]
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    chunks += 1
                    if '"error"' in line:
                        return 500, line[:400]  # the stream's own error event (the engine's failure)
                if kind == "abandon" and chunks >= 2:
                    return 200, "abandoned"  # leaving the block closes the connection mid-stream
        return 200, "ok"
    if kind == "timeout":
        try:
            await client.post(url + "/completion", json={"prompt": prompt, "n_predict": 200}, timeout=0.3)
        except httpx.TimeoutException:
            return None, "timed out"
        return 200, "ok"
    if kind == "bad-json":
        r = await client.post(url + "/v1/chat/completions", content=b"{not json", headers={"Content-Type": "application/json"})
        return r.status_code, "refused" if r.status_code == 400 else r.text[:200]
    if kind == "bad-type":
        r = await client.post(url + "/completion", content=json.dumps({"prompt": prompt}), headers={"Content-Type": "text/plain"})
        return r.status_code, "refused" if r.status_code == 415 else r.text[:200]
    path = rng.choice(["/health", "/metrics", "/props"])
    r = await client.get(url + path)
    return r.status_code, "ok" if r.status_code < 400 else r.text[:200]


def _message(body: str) -> str:
    """The error message in a JSON error body or SSE error event."""
    try:
        return json.loads(body.removeprefix("data: "))["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return body[:160]


async def _ready(app, pilot) -> None:
    """Until the app has its model, its API and its streamer (10 minutes at most)."""
    deadline = time.monotonic() + 600
    while not (app.main.ready and app.main.api_url is not None and app.engine.streamer is not None):
        if time.monotonic() > deadline:
            raise UserError("the app did not get ready in 10 minutes")
        await pilot.pause(0.1)


async def _chat_in_app(app, pilot, text: str) -> str:
    """Type ``text`` into the app's prompt and send it; the reply's note once it ends."""
    from kimitui.tui.widgets.chat import MessageView, PromptInput

    app.query_one(PromptInput).focus()
    await pilot.press(*text)
    await pilot.press("enter")
    waited = 0.0
    while app.main.reply is not None or not app.query(MessageView).last().border_subtitle:
        await pilot.pause(0.05)
        waited += 0.05
        if waited > 300:
            raise UserError("a chat reply in the app did not end in 5 minutes")
    return str(app.query(MessageView).last().border_subtitle)


def _tally(figures: dict, kind: str, cut: bool, result) -> None:
    """Count one request's outcome; keep it among the unexpected where it should not have
    failed (a 5xx or an unasked-for 4xx while the drive was in place; any failure to answer)."""
    figures["requests"][kind] += 1
    if isinstance(result, asyncio.CancelledError):
        figures["statuses"]["cancelled"] += 1
        return
    if isinstance(result, BaseException):
        status, what = None, f"{type(result).__name__}: {result}"
    else:
        status, what = result
    key = "timeout" if status is None and what == "timed out" else str(status)
    figures["statuses"][key] += 1
    expected_error = kind in ("bad-json", "bad-type")
    if status is None and what != "timed out" or (
        status is not None and status >= 500 and not cut
    ) or (status is not None and 400 <= status < 500 and not expected_error and not cut):
        figures["unexpected"].append({"kind": kind, "status": status, "what": what, "cut": cut})
    if cut and status is not None and status >= 500:
        figures.setdefault("errors_while_cut", Counter())[_message(what)] += 1


async def _soak(app, args, drive: Drive) -> dict:
    import httpx

    from kimitui.config import data_dir
    from kimitui.history import HistoryStore

    rng = random.Random(args.seed)
    figures: dict = {"requests": Counter(), "statuses": Counter(), "unexpected": [], "chats": []}
    async with app.run_test(size=(120, 40)) as pilot:
        await _ready(app, pilot)
        url = app.main.api_url
        app.main.sampling.max_tokens = 12

        async def chat_in_app(text: str) -> None:
            figures["chats"].append({"text": text, "reply_note": await _chat_in_app(app, pilot, text)})

        plan = [kind for kind, weight in KINDS for _ in range(weight)]
        cuts = {args.requests // 3: "cut", args.requests // 3 + 12: "restore",
                2 * args.requests // 3: "cut", 2 * args.requests // 3 + 12: "restore"}
        limits = httpx.Limits(max_connections=args.clients * 2)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            await chat_in_app("Warm up")
            warm_up = max(args.clients, args.requests // 10)
            start = None
            sent = 0
            series = []  # (requests sent, figures): growth that flattens is warm-up, growth that goes on is a leak
            step = max(1, args.requests // 5)
            while sent < args.requests:
                if start is None and sent >= warm_up:
                    # First-use growth (the server's thread pool, client connections, caches)
                    # is not a leak: the figures start after the first tenth of the requests.
                    start = _process_figures(app.engine)
                if start is not None and (not series or sent - series[-1][0] >= step):
                    series.append((sent, _process_figures(app.engine)))
                # Cut or restore between batches, while no request runs: each request then
                # meets the drive in one state from its start.
                for i in range(sent, min(args.requests, sent + args.clients)):
                    action = cuts.get(i)
                    if action == "cut":
                        drive.cut()
                    elif action == "restore":
                        drive.restore()
                batch = []
                for _ in range(args.clients):
                    if sent >= args.requests:
                        break
                    kind = rng.choice(plan)
                    batch.append((kind, drive.cut_now))
                    sent += 1
                tasks = [asyncio.ensure_future(_one(client, url, kind, rng)) for kind, _ in batch]
                for (kind, _), task in zip(batch, tasks):
                    if kind == "cancel":
                        await asyncio.sleep(rng.uniform(0.01, 0.2))
                        task.cancel()
                results = await asyncio.gather(*tasks, return_exceptions=True)
                for (kind, cut), result in zip(batch, results):
                    _tally(figures, kind, cut, result)
                if sent % args.chat_every < args.clients and not drive.cut_now:
                    await chat_in_app(f"Message {sent}")
            # Replies of the last batch may still be giving up their turn: let the engine settle.
            while app.engine.turns.waiting:
                await pilot.pause(0.05)
            await pilot.pause(0.5)
            end = _process_figures(app.engine)
            series.append((sent, end))
        conversation = app.main.conversation_id
        model_peak = app.engine.metrics.view().get("model_rss_peak_bytes")
    saved = HistoryStore(data_dir() / "history.sqlite3").messages(conversation)
    figures.update(start=start, end=end, model_peak=model_peak, series=series)
    figures["history"] = {
        "sent": [c["text"] for c in figures["chats"]],
        "saved_user": [m.content for m in saved if m.role == "user"],
        "saved_replies": sum(1 for m in saved if m.role == "assistant" and m.content),
    }
    return figures


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record) -> None:
        text = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            text += f": {type(record.exc_info[1]).__name__}: {record.exc_info[1]}"
        self.lines.append(text)


def run(args: argparse.Namespace) -> int:
    from kimitui.cli import build_app, build_parser

    if not args.model.is_file():
        raise UserError(f"--model: {args.model} is not a file")
    work = Path(tempfile.mkdtemp(prefix="kimitui-soak-", dir=args.work_dir or args.model.parent))
    home = Path(tempfile.mkdtemp(prefix="kimitui-soak-home-"))
    try:
        copy = work / args.model.name
        shutil.copyfile(args.model, copy)
        drive = Drive(copy)
        # A history database of its own: the soak's chats must not land in the user's.
        os.environ["XDG_DATA_HOME"] = str(home)
        config = home / "config.toml"
        config.write_text("[sampling]\nmax_tokens = 12\n")
        app = build_app(build_parser().parse_args(
            ["--model", str(copy), "--budget", args.budget, "--serve", "127.0.0.1:0", "--config", str(config)]
        ))
        # The server inside the app is quiet (log lines would tear the screen): what it would
        # have logged (a request that failed inside uvicorn) is collected for the report.
        caught = _Collect()
        for name in ("uvicorn.error", "kimitui.server"):
            logging.getLogger(name).addHandler(caught)
        started = time.perf_counter()
        figures = asyncio.run(_soak(app, args, drive))
        figures["seconds"] = time.perf_counter() - started
        figures["server_log"] = caught.lines
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(home, ignore_errors=True)
    return _report(args, figures)


def _report(args, f: dict) -> int:
    start, end = f["start"], f["end"]
    history = f["history"]
    lost = [text for text in history["sent"] if text not in history["saved_user"]]
    rows = [
        ("figure", "after warm-up", "end", "change"),
        ("threads", str(start["threads"]), str(end["threads"]), f"{end['threads'] - start['threads']:+d}"),
        ("open descriptors", str(start["fds"]), str(end["fds"]), f"{end['fds'] - start['fds']:+d}"),
        ("RSS", format_bytes(start["rss_bytes"]), format_bytes(end["rss_bytes"]),
         f"{(end['rss_bytes'] - start['rss_bytes']) / 2**20:+.1f} MiB"),
    ]
    if start["other_bytes"] is not None and end["other_bytes"] is not None:
        rows.append(("RSS outside the model", format_bytes(start["other_bytes"]), format_bytes(end["other_bytes"]),
                     f"{(end['other_bytes'] - start['other_bytes']) / 2**20:+.1f} MiB"))
    print(f"kimitui bench-soak: {sum(f['requests'].values())} requests ({args.clients} at once) in {f['seconds']:.0f} s, "
          f"the drive cut and restored twice")
    print("requests: " + ", ".join(f"{k} {v}" for k, v in sorted(f["requests"].items())))
    print("answers:  " + ", ".join(f"{k} {v}" for k, v in sorted(f["statuses"].items())))
    for what, n in (f.get("errors_while_cut") or {}).items():
        print(f"while cut ({n}x): {what}")
    print(table(rows))
    print("RSS outside the model along the way: " + ", ".join(
        f"{n} req {format_bytes(fig['other_bytes'] if fig['other_bytes'] is not None else fig['rss_bytes'])}" for n, fig in f["series"]))
    print(f"history: {len(history['sent'])} chat messages sent in the app, {len(history['saved_user'])} saved, "
          f"{history['saved_replies']} replies saved; lost: {lost or 'none'}")
    for u in f["unexpected"][:10]:
        print(f"UNEXPECTED: {u}")
    for line in f["server_log"][:10]:
        print(f"server log: {line}")
    if args.json:
        write_json(args.json, {**f, "requests": dict(f["requests"]), "statuses": dict(f["statuses"]),
                               "errors_while_cut": dict(f.get("errors_while_cut") or {})})
    return 1 if f["unexpected"] or lost else 0
