"""The `kimitui` command: the chat app by default, tools as subcommands.

User mistakes end with one line on stderr and exit code 2; tracebacks are for our bugs only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NoReturn, Sequence

from kimitui.config import Settings, apply_override, load_settings
from kimitui.errors import UserError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="TOML config file (default: $KIMITUI_CONFIG or the user config dir)")
    parser.add_argument("--model", "-m", help="GGUF model file (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--budget", help="memory budget, e.g. 6GiB, or 'auto'")
    parser.add_argument("--address-space", help="address space the model's weights may take, e.g. 40GiB, or 'auto'")
    parser.add_argument("--n-ctx", help="context length in tokens")
    parser.add_argument("--threads", help="compute threads (0 = one per physical core)")
    parser.add_argument("--expert-trim-below", metavar="SHARE",
                        help="MoE, lossy: skip a routed expert not in memory whose share of the token's routing weight is below SHARE")
    parser.add_argument("--draft-model", metavar="FILE.gguf",
                        help="a small model with the same vocabulary that drafts tokens for speculative decoding")
    parser.add_argument("--expert-trim-cumulative", metavar="SHARE",
                        help="MoE, lossy: skip routed experts not in memory past those whose shares reach SHARE")


def build_parser() -> argparse.ArgumentParser:
    commands = "; ".join(f"{name}: {text}" for name, (_, text) in COMMANDS.items())
    parser = _Parser(
        prog="kimitui",
        description="Chat with a GGUF model while watching how it streams."
        + (f" Subcommands (kimitui NAME --help): {commands}" if commands else ""),
    )
    add_common(parser)
    parser.add_argument("--theme", help="UI theme (kimitui-dusk, kimitui-paper or any Textual theme)")
    parser.add_argument("--serve", metavar="[HOST:]PORT", help="also serve the HTTP API from this app's engine")
    parser.add_argument("--remote", metavar="URL", help="chat with a kimitui, llama-server or OpenAI-compatible server")
    parser.add_argument("--api-key", help="API key: required by --serve on a non-loopback host; sent by --remote")
    parser.add_argument("--trace", metavar="FILE", help="write the per-token trace (JSON Lines) to FILE; see kimitui trace")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    return parser


def parse_serve(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    try:
        number = int(port)
    except ValueError:
        raise UserError(f"--serve: expected [HOST:]PORT such as 8080 or 0.0.0.0:8080, got {value!r}") from None
    if not 0 <= number <= 65535:
        raise UserError(f"--serve: port {number} is out of range 0-65535")
    return host.strip("[]") or "127.0.0.1", number


FLAG_KEYS = {
    "model": ("model.path", "--model"),
    "budget": ("engine.budget", "--budget"),
    "address_space": ("engine.address_space", "--address-space"),
    "n_ctx": ("model.n_ctx", "--n-ctx"),
    "threads": ("model.n_threads", "--threads"),
    "expert_trim_below": ("engine.expert_trim_below", "--expert-trim-below"),
    "expert_trim_cumulative": ("engine.expert_trim_cumulative", "--expert-trim-cumulative"),
    "draft_model": ("engine.draft_model", "--draft-model"),
    "theme": ("ui.theme", "--theme"),
    "trace": ("trace.path", "--trace"),
}


def resolve_settings(args: argparse.Namespace) -> Settings:
    settings = load_settings(args.config, explicit=args.config is not None)
    for attr, (dotted, flag) in FLAG_KEYS.items():
        value = getattr(args, attr, None)
        if value is not None:
            apply_override(settings, dotted, value, flag)
    if getattr(args, "trace", None) is not None:
        apply_override(settings, "trace.enabled", True, "--trace")
    return settings


def resolve_model(settings: Settings) -> Path:
    """The model file to open: configured, flagged, or the embedded default; checked before llama.cpp.

    A file not where model.path says is looked for in the model.paths directories; so is
    every file of a split set, and a set spread over several of them comes back as the first
    file of a directory of symlinks (llama.cpp only looks next to the first file)."""
    from kimitui.model import default_model_path, read_model_info
    from kimitui.model.placement import assemble_split_set

    raw = settings["model.path"]
    if not raw:
        path = default_model_path()
    else:
        search = [Path(d).expanduser() for d in settings["model.paths"]]
        path = Path(raw).expanduser()
        if not path.exists() and not search:
            raise UserError(f"model file not found: {path} (from {settings.origin('model.path')})")
        try:
            path = assemble_split_set(path, search)
        except UserError as exc:
            raise UserError(f"{exc} (from {settings.origin('model.path')})") from None
    read_model_info(path)
    return path


def check_budget(settings: Settings, model_path: Path) -> int:
    """The budget in bytes ("auto" worked out once, here); one that cannot hold one layer is
    refused before llama.cpp is called."""
    from kimitui.engine.memory import SAFE_SHARE, resolve_budget
    from kimitui.engine.budget import budget_shortfall
    from kimitui.model import read_model_info
    from kimitui.model.gguf_map import load_model_map

    budget = settings["engine.budget"]
    resolved = resolve_budget(budget)
    if resolved >= read_model_info(model_path).tensor_bytes:
        return resolved  # it holds the whole model, so its working set too (and start-up skips a parse)
    shortfall = budget_shortfall(load_model_map(model_path, shard_size=settings["engine.shard_size"]), resolved)
    if shortfall and budget == "auto":
        raise UserError(
            f"budget auto ({SAFE_SHARE:.0%} of the memory available, cgroup limits included): {shortfall}; "
            "free memory or give --budget"
        )
    if shortfall:
        raise UserError(f"{settings.origin('engine.budget')}: {shortfall}")
    return resolved


def check_theme(settings: Settings) -> None:
    from kimitui.tui.themes import check_theme as check

    check(settings["ui.theme"], settings.origin("ui.theme"))


def run_app(args: argparse.Namespace) -> int:
    app = build_app(args)
    app.run()
    return app.return_code or 0


def build_app(args: argparse.Namespace):
    """The app as the command line asks for it, its model already loading; not yet running.
    Python's cyclic collector stays off until the app is mounted (see startup.py)."""
    from kimitui.startup import start_up_begins, start_up_finished

    start_up_begins()
    try:
        return _build_app(args)
    except BaseException:
        start_up_finished()
        raise


def _build_app(args: argparse.Namespace):
    import os

    settings = resolve_settings(args)
    api_key = args.api_key or os.environ.get("KIMITUI_API_KEY") or settings["server.api_key"] or None
    if args.remote:
        if args.serve or args.model or args.trace:
            raise UserError("--remote chats with a server's model: it cannot be combined with --serve, --model or --trace")
        if not args.remote.startswith(("http://", "https://")):
            raise UserError(f"--remote: expected a URL such as http://192.168.1.20:8080, got {args.remote!r}")
        check_theme(settings)
        return make_app(settings, remote=(args.remote, api_key))
    model_path = resolve_model(settings)
    budget = check_budget(settings, model_path)
    api_socket, host = None, ""
    if args.serve:
        from kimitui.server.runner import bind_socket, check_bind

        host, port = parse_serve(args.serve)
        check_bind(host, api_key)
        api_socket = bind_socket(host, port)
    from kimitui.engine.session import engine_from_settings

    engine = engine_from_settings(settings, model_path, budget)
    engine.inspect()  # a damaged header is one line here, before any thread starts
    engine.start_loading()  # llama.cpp loads while Textual is imported and starts
    try:
        engine.wait_until_loading_in_c()
        check_theme(settings)  # imports Textual's themes: after the load has started
        return make_app(settings, model_path, engine=engine, api_socket=api_socket, api_host=host, api_key=api_key)
    except BaseException:
        engine.cancel_loading()  # never leave llama.cpp running in a thread at exit
        raise


def make_app(settings: Settings, model_path: Path | None = None, *, remote: tuple[str, str | None] | None = None,
             engine=None, api_socket=None, api_host: str = "", api_key: str | None = None):
    """The app, handed what it shows: the engine (in-process on ``model_path``, or a server's
    for ``remote`` = (url, api key)), its metrics sampler, the history store, the trace the
    settings ask for, and the HTTP API on ``api_socket`` (already listening, bound for the
    name ``api_host``; ``api_key`` required when given). ``engine``, from the same settings,
    may already be loading."""
    from kimitui.config import data_dir
    from kimitui.engine.metrics import Sampler
    from kimitui.history import HistoryStore
    from kimitui.tui.app import KimituiApp

    store = HistoryStore(data_dir() / "history.sqlite3")
    if remote is not None:
        from kimitui.server.client import RemoteEngine, RemoteSampler

        url, key = remote
        remote_engine = RemoteEngine(url, api_key=key)
        sampler = RemoteSampler(remote_engine, interval=max(1.0, settings["metrics.interval"]))
        return KimituiApp(settings, remote_engine, sampler, store, on_exit=remote_engine.close)
    from kimitui.engine.session import engine_from_settings
    from kimitui.trace import open_trace

    engine = engine or engine_from_settings(settings, model_path)
    sampler = Sampler(engine.metrics, interval=settings["metrics.interval"], model_path=model_path)
    trace = open_trace(settings, list(engine.inspect().files))
    if trace is not None:
        trace.attach(engine)
    servers = []

    def serve(on_request) -> str:
        from kimitui.server.app import create_app
        from kimitui.server.runner import ServerThread, bound_names

        app = create_app(engine, settings, api_key=api_key, on_request=on_request, bind_host=bound_names([api_host], [api_socket]))
        servers.append(ServerThread(app, api_socket, quiet=True).start())
        return servers[-1].url

    def on_exit() -> None:
        for server in servers:
            server.stop()
        if trace is not None:
            trace.close()

    return KimituiApp(settings, engine, sampler, store, trace=trace, api=serve if api_socket is not None else None, on_exit=on_exit)


# Subcommand -> module with ``add_arguments(parser)`` and ``run(args) -> int``; imported only when used.
COMMANDS: dict[str, tuple[str, str]] = {
    "inspect": ("kimitui.engine.inspect_cmd", "show a GGUF's layers, shards, expert sizes and the tok/s its bytes allow"),
    "synth": ("kimitui.model.synth.cli", "write a synthetic GGUF (dense llama or MoE deepseek2) of a given size"),
    "serve": ("kimitui.serve_cmd", "run the llama-server/OpenAI compatible HTTP API headless"),
    "bench-ui": ("kimitui.benchmarks.ui_latency", "time keypress echo in the app while a reply streams"),
    "shard": ("kimitui.model.shard", "rewrite a GGUF as a llama.cpp split set cut at layer boundaries, with a manifest"),
    "requant": ("kimitui.model.requant", "rewrite a model's trunk as Q8_0 or Q4_0, its routed experts copied byte for byte"),
    "quality": ("kimitui.benchmarks.quality", "what a lossy variant (a requantized copy) costs: KL divergence, top-1 agreement, perplexity"),
    "verify": ("kimitui.model.verify_cmd", "check a sharded model's files against its manifest, or a GGUF split set's structure"),
    "bench": ("kimitui.benchmarks.bench", "decode speed of the engine vs plain llama-cpp-python mmap, and the physical limit"),
    "bench-load": ("kimitui.benchmarks.load", "time from start to ready and bytes read, vs plain llama-cpp-python's load"),
    "bench-soak": ("kimitui.benchmarks.soak", "hundreds of mixed API requests and app chats with the drive cut and restored twice"),
    "bench-speculate": ("kimitui.benchmarks.speculate", "speculative decoding against plain decoding: bytes per token, tokens per pass, tok/s"),
    "bench-resume": ("kimitui.benchmarks.resume", "a restart mid-conversation: first token from its saved state vs evaluating it again"),
    "bench-scale": ("kimitui.benchmarks.scale", "start, plan and one reply on a huge model: bytes per token, eval callback cost, mappings, fds, engine memory"),
    "doctor": ("kimitui.doctor", "check this machine can stream the model: one line per prerequisite, each failure with its fix"),
    "trace": ("kimitui.trace.cli", "summarize or compare per-token traces (--trace FILE), or time what tracing costs"),
}


def _run_subcommand(name: str, argv: list[str]) -> int:
    import importlib

    module_name, help_text = COMMANDS[name]
    module = importlib.import_module(module_name)
    parser = _Parser(prog=f"kimitui {name}", description=help_text)
    module.add_arguments(parser)
    return module.run(parser.parse_args(argv))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] in COMMANDS:
            return _run_subcommand(argv[0], argv[1:])
        args = build_parser().parse_args(argv)
        if args.version:
            from kimitui import __version__

            print(f"kimitui {__version__}")
            return 0
        return run_app(args)
    except UserError as exc:
        print(f"kimitui: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `kimitui inspect M | head`: the reader of our output left, not an error of ours. With
        # stdout not a pipe it came from elsewhere: a bug, and it keeps its traceback.
        import os
        import stat

        if not stat.S_ISFIFO(os.fstat(sys.stdout.fileno()).st_mode):
            raise
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # no second error when Python flushes at exit
        os.close(devnull)
        return 0


if __name__ == "__main__":
    sys.exit(main())
