"""A fake engine (engine.interface.ChatEngine) and a sampler that replays recorded snapshots:
the app runs on them in a fraction of a second, the same on every run, for widget tests and
screen snapshots. The snapshots are the real engine's, recorded streaming a Kimi K3 cut
(tests/data/record_metrics.py); the engine tests run the real thing."""

from __future__ import annotations

import json
import threading
from dataclasses import replace
from pathlib import Path

from kimitui.engine.interface import PinOutcome, TuningValues
from kimitui.engine.metrics import EngineMetrics, Snapshot, StreamingCounters
from kimitui.engine.pinning import PinProgress
from kimitui.engine.generation import GenerationResult, TokenEvent
from kimitui.engine.state import EngineError, EngineState, Lifecycle

MIB = 2**20
PINNED = 35_463_168  # what the recorded run had resident when its reply began


class FakeReply:
    def __init__(self, pieces: list[str], gate: threading.Event | None, error: str | None, lifecycle: Lifecycle) -> None:
        self.pieces, self.gate, self.error = pieces, gate, error
        self.lifecycle = lifecycle
        self.result = GenerationResult()
        self._cancel = threading.Event()

    def cancel(self) -> None:
        self._cancel.set()
        if self.gate is not None:
            self.gate.set()

    def __iter__(self):
        self.lifecycle.begin_reply()
        try:
            for index, piece in enumerate(self.pieces):
                if self._cancel.is_set():
                    self.result.finish_reason = "cancelled"
                    return
                if index == len(self.pieces) // 2 and self.gate is not None:
                    self.gate.wait(30)  # a test holds the reply here to look at the screen mid-stream
                self.result.completion_tokens = index + 1
                self.result.text += piece
                yield TokenEvent(piece, 100 + index, index, 0.01)
            if self.error is not None:
                raise EngineError(self.error)
            self.result.decode_s = 0.5
        finally:
            self.lifecycle.end_reply()


class FakeEngine:
    """A streaming K3 cut as the UI sees it: named, loaded at once, 33.8 MiB pinned, tunable;
    its budget is the recorded run's."""

    def __init__(self, *, reply: str = "Hello! I am a fake Kimi, streamed word by word.", fail_reply: str | None = None,
                 fail_load: str | None = None, budget: int = 54_646_416) -> None:
        self.metrics = EngineMetrics()
        self.metrics.budget_source = lambda: self.values.budget
        self.lifecycle = Lifecycle()
        self.load_s: float | None = None
        self.reply_words = [w + " " for w in reply.split(" ")]
        self.fail_reply, self.fail_load = fail_reply, fail_load
        self.gate: threading.Event | None = None  # set by a test to hold a reply mid-stream
        self.values = TuningValues(budget, 2, 64 * MIB, "pin-stream", "lfu", 4, False, 0.0, 1.0)
        self.retuned: list[dict] = []
        self.asked: list[list[dict]] = []
        self.kept: set[str] = set()  # conversations whose state it would resume
        self.lossy: str | None = None  # what lossy_setting() says (a test sets it)

    def label(self):
        return "k3-cut.gguf", 210 * MIB

    def load(self, on_progress=None) -> None:
        self.lifecycle.move(EngineState.LOADING)
        if self.fail_load:
            self.lifecycle.fail(self.fail_load)
            raise EngineError(self.fail_load)
        if on_progress is not None:
            on_progress(1.0)
        self.load_s = 0.4
        self.lifecycle.move(EngineState.READY)

    def notices(self) -> list[str]:
        return []

    def pin(self, on_progress=None) -> PinOutcome:
        if on_progress is not None:
            on_progress(PinProgress(PINNED, PINNED, 0.1))
        return PinOutcome(PINNED, None, whole_model=False)

    def resumes(self, key: str) -> bool:
        return key in self.kept

    def forget_state(self, key: str) -> None:
        self.kept.discard(key)

    def chat(self, messages, sampling, keep=None) -> FakeReply:
        self.asked.append(messages)
        if keep is not None:
            self.kept.add(keep)
        return FakeReply(self.reply_words, self.gate, self.fail_reply, self.lifecycle)

    def abort_load(self) -> None:
        pass

    def tuning(self) -> TuningValues:
        return self.values

    def lossy_setting(self) -> str | None:
        return self.lossy

    def retune(self, **changes) -> str:
        if changes.get("budget", self.values.budget) < 46 * MIB:
            raise EngineError("budget below the minimum working set of k3-cut.gguf: 46.1 MiB")
        self.retuned.append(changes)
        self.values = replace(self.values, **changes)
        return "applies from the next token, after the pinned set is re-read" if "budget" in changes else "applies from the next token"


RECORDED = Path(__file__).with_name("data") / "k3_metrics.json"


def recorded_snapshots() -> list[Snapshot]:
    """Eight samples, a quarter second apart, of the real engine streaming one greedy reply
    from a Kimi K3 cut under a budget near its minimum working set (recorded by
    tests/data/record_metrics.py on this project's development machine)."""
    out = []
    for raw in json.loads(RECORDED.read_text()):
        raw["streaming"] = StreamingCounters(**raw["streaming"]) if raw["streaming"] else None
        raw["experts"] = tuple(raw["experts"]) if raw["experts"] else None
        raw["experts_resident"] = [tuple(pair) for pair in raw["experts_resident"]] if raw["experts_resident"] else None
        out.append(Snapshot(**raw))
    return out


class RecordedSampler:
    """The metrics sampler's interface, with no thread: ``play`` hands the next recorded
    snapshot to subscribers."""

    def __init__(self, snapshots: list[Snapshot]) -> None:
        self.snapshots = list(snapshots)
        self.interval = 0.25
        self.paused = False
        self._subscribers = []
        self.started = False

    def subscribe(self, callback) -> None:
        self._subscribers.append(callback)

    def start(self) -> None:
        self.started = True

    def stop(self) -> None:
        self.started = False

    def set_interval(self, seconds: float) -> None:
        self.interval = seconds

    def play(self, count: int | None = None) -> None:
        for _ in range(len(self.snapshots) if count is None else count):
            if not self.snapshots:
                return
            snap = self.snapshots.pop(0)
            for callback in self._subscribers:
                callback(snap)


def fake_app(engine: FakeEngine | None = None, snapshots: list[Snapshot] | None = None):
    """The real app on the fake engine and the recorded metrics."""
    from kimitui.cli import build_parser, resolve_settings
    from kimitui.config import data_dir
    from kimitui.history import HistoryStore
    from kimitui.tui.app import KimituiApp

    settings = resolve_settings(build_parser().parse_args([]))
    engine = engine or FakeEngine()
    sampler = RecordedSampler(recorded_snapshots() if snapshots is None else snapshots)
    return KimituiApp(settings, engine, sampler, HistoryStore(data_dir() / "history.sqlite3"))


class FakeLlamaServer:
    """A stand-in for a stock llama-server, as `kimitui --remote` meets one: its /health,
    /v1/models and /props, a /metrics that reports only some of llama-server's own
    metrics (no memory, reads or streaming, and its predicted_tokens_seconds gauge at 0, as
    llama-server's reads between replies), and streamed chat replies of fixed words with the
    timings llama-server sends. ``start()`` serves it on loopback; ``url``; ``stop()``."""

    WORDS = ["Hello", " from", " a", " stock", " llama", "-server", "."]

    def __init__(self, delay_s: float = 0.02) -> None:
        self.delay_s = delay_s
        self.requests: list[str] = []
        self.server = None

    def app(self):
        import asyncio
        import json

        from sse_starlette import EventSourceResponse
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse, Response
        from starlette.routing import Route

        async def health(request):
            return JSONResponse({"status": "ok"})

        async def models(request):
            return JSONResponse({"object": "list", "data": [{"id": "stock.gguf", "object": "model", "owned_by": "llamacpp",
                                                            "meta": {"n_ctx_train": 2048, "size": 1 << 30}}]})

        async def props(request):
            return JSONResponse({"default_generation_settings": {"n_ctx": 2048, "params": {}}, "total_slots": 1,
                                 "model_path": "/models/stock.gguf", "build_info": "b6000-stock"})

        async def metrics(request):
            return Response("# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.\n"
                            "# TYPE llamacpp:prompt_tokens_total counter\nllamacpp:prompt_tokens_total 12\n"
                            "llamacpp:tokens_predicted_total 7\nllamacpp:predicted_tokens_seconds 0\n"
                            "llamacpp:requests_processing 0\n", media_type="text/plain")

        async def chat(request):
            self.requests.append((await request.body()).decode())

            async def sse():
                for word in self.WORDS:
                    await asyncio.sleep(self.delay_s)
                    yield json.dumps({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": word}, "finish_reason": None}]})
                timings = {"prompt_n": 12, "prompt_ms": 30.0, "predicted_n": len(self.WORDS), "predicted_ms": len(self.WORDS) * self.delay_s * 1000}
                yield json.dumps({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "timings": timings})
                yield "[DONE]"

            return EventSourceResponse(sse(), ping=0)

        return Starlette(routes=[
            Route("/health", health), Route("/v1/models", models), Route("/props", props), Route("/metrics", metrics),
            Route("/v1/chat/completions", chat, methods=["POST"]),
        ])

    def start(self) -> "FakeLlamaServer":
        from kimitui.server.runner import ServerThread, bind_socket

        self.server = ServerThread(self.app(), bind_socket("127.0.0.1", 0)).start()
        return self

    @property
    def url(self) -> str:
        return self.server.url

    def stop(self) -> None:
        self.server.stop()
