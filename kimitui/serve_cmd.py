"""``kimitui serve``: the HTTP API without the TUI.

The socket is bound and the key rule checked before anything else, so mistakes end with one
line; the model then loads in the background while /health answers 503, as llama-server does.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

from kimitui.config import apply_override
from kimitui.errors import UserError

API_KEY_ENV = "KIMITUI_API_KEY"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kimitui.cli import add_common

    add_common(parser)
    parser.add_argument(
        "--host", help="address to listen on, or several comma-separated (default 127.0.0.1; others need an API key)",
    )
    parser.add_argument("--port", help="TCP port (default 8080; 0 = any free port)")
    parser.add_argument("--api-key", help=f"require 'Authorization: Bearer KEY' (or set ${API_KEY_ENV})")
    parser.add_argument("--max-n-predict", help="most tokens one request may ask for")
    parser.add_argument("--max-body", help="largest request body, e.g. 1MiB")
    parser.add_argument("--seed", help="the sampler's seed when a request gives none (default -1: a new one every reply)")
    parser.add_argument("--chat-template-file", help="a Jinja chat template used instead of the model's own")
    parser.add_argument(
        "--chat-template", help="a chat template: one of llama.cpp's built-in names (llama3, chatml, command-r, ...) or Jinja text",
    )
    parser.add_argument("--batch-size", help="prompt tokens evaluated at a time (model.n_batch)")
    parser.add_argument(
        "--alias", help="the model's name in replies and /v1/models, or several comma-separated (default: its file name)",
    )
    parser.add_argument(
        "--parallel", help="slots: the context split into this many prompt caches, kept apart between clients (server.slots)",
    )
    parser.add_argument("--no-slots", action="store_true", help="GET /slots answers 501")
    parser.add_argument("--slot-save-path", help="directory for POST /slots/{id}?action=save|restore (server.slot_save_path)")
    shift = parser.add_mutually_exclusive_group()
    shift.add_argument(
        "--context-shift", dest="context_shift", action="store_true", default=None,
        help="a reply that fills the context drops its older half and goes on (model.context_shift)",
    )
    shift.add_argument("--no-context-shift", dest="context_shift", action="store_false", help="a reply stops when the context is full (default)")
    parser.add_argument("--tags", help="labels listed with the model in /v1/models, comma-separated")
    parser.add_argument("--verbose", action="store_true", help="add llama-server's __verbose object (the prompt as tokenized, ...) to every reply")
    parser.add_argument(
        "--cors-origins", help="web origins allowed to call the API, comma-separated; 'localhost' = pages on this machine, any port",
    )
    parser.add_argument("--trace", metavar="FILE", help="write the per-token trace (JSON Lines) to FILE; see kimitui trace")


def resolve(args: argparse.Namespace):
    from kimitui.cli import resolve_settings

    settings = resolve_settings(args)
    overrides = (  # later ones win: the flag over the environment over the file
        ("server.host", "--host", args.host),
        ("server.port", "--port", args.port),
        ("server.api_key", f"${API_KEY_ENV}", os.environ.get(API_KEY_ENV)),
        ("server.api_key", "--api-key", args.api_key),
        ("server.max_n_predict", "--max-n-predict", args.max_n_predict),
        ("server.max_body", "--max-body", args.max_body),
        ("server.alias", "--alias", args.alias),
        ("model.chat_template_file", "--chat-template-file", args.chat_template_file),
        ("model.chat_template", "--chat-template", args.chat_template),
        ("model.n_batch", "--batch-size", args.batch_size),
        ("server.slots", "--parallel", args.parallel),
        ("server.slot_save_path", "--slot-save-path", args.slot_save_path),
        ("sampling.seed", "--seed", args.seed),
    )
    if args.tags is not None:
        settings["server.tags"] = [t.strip() for t in args.tags.split(",") if t.strip()]
    if args.no_slots:
        apply_override(settings, "server.slots_endpoint", False, "--no-slots")
    if args.context_shift is not None:
        apply_override(settings, "model.context_shift", args.context_shift, "--context-shift" if args.context_shift else "--no-context-shift")
    if args.verbose:
        apply_override(settings, "server.verbose", True, "--verbose")
    if args.cors_origins is not None:
        settings["server.cors_origins"] = [o.strip() for o in args.cors_origins.split(",") if o.strip()]
    for dotted, flag, value in overrides:
        if value is not None:
            apply_override(settings, dotted, value, flag)
    return settings


def run(args: argparse.Namespace) -> int:
    from kimitui.cli import resolve_model
    from kimitui.server.runner import bind_all, check_bind

    settings = resolve(args)
    host, api_key = settings["server.host"], settings["server.api_key"]
    hosts = [h.strip() for h in host.split(",") if h.strip()] or ["127.0.0.1"]
    for name in hosts:
        check_bind(name, api_key)
    model_path = resolve_model(settings)
    sockets = bind_all(hosts, settings["server.port"])
    try:
        return _serve(settings, model_path, sockets, api_key, hosts)
    finally:  # every way out, a failure before uvicorn started included
        for sock in sockets:
            sock.close()


def _serve(settings, model_path, sockets: list, api_key: str, hosts: list[str]) -> int:
    from kimitui.cli import check_budget
    from kimitui.engine.session import engine_from_settings
    from kimitui.engine.state import EngineError
    from kimitui.server.app import create_app
    from kimitui.server.runner import base_url, bound_names, uvicorn_server

    budget = check_budget(settings, model_path)
    # The same engine as the app's: budget, pinned set and streaming settings from the config.
    engine = engine_from_settings(settings, model_path, budget)
    from kimitui.trace import open_trace

    trace = open_trace(settings, list(engine.inspect().files))
    if trace is not None:
        trace.attach(engine)
    server = uvicorn_server(create_app(engine, settings, api_key=api_key, bind_host=bound_names(hosts, sockets)), quiet=False)
    failure: list[str] = []

    shown = [0.0]

    def pinning(progress) -> None:  # what the app's status bar shows, a line every few seconds
        now = time.monotonic()
        if progress.total_bytes and (progress.finished or now - shown[0] >= 5.0):
            shown[0] = now
            print(f"kimitui: {progress.describe()}", file=sys.stderr, flush=True)

    def load() -> None:
        try:
            engine.load()
            for note in (engine.fast_load_note, engine.fit_note):
                if note:
                    print(f"kimitui: {note}", file=sys.stderr, flush=True)
            engine.pin(pinning)
            for note in (engine.pinned.note, engine.plan_note):
                if note:
                    print(f"kimitui: {note}", file=sys.stderr, flush=True)
        except (EngineError, UserError) as exc:
            if not server.should_exit:  # else: stopped while loading, nothing to report
                failure.append(str(exc))
                server.should_exit = True
            return
        print(f"kimitui: {engine.info.name} ready (context {engine.n_ctx} tokens)", file=sys.stderr, flush=True)

    url = base_url(sockets[0])
    also = "".join(f" and {base_url(sock)}" for sock in sockets[1:])
    print(
        f"kimitui: serving {model_path.name} on {url}{also} (OpenAI base URL {url}/v1"
        f"{', API key required' if api_key else ''}); Ctrl-C stops",
        file=sys.stderr,
        flush=True,
    )
    threading.Thread(target=load, name="kimitui-load", daemon=True).start()
    try:
        server.run(sockets=sockets)
    finally:
        engine.abort_load()
        if trace is not None:
            trace.close()
    if failure:
        print(f"kimitui: {failure[0]}", file=sys.stderr)
        return 1
    return 0
