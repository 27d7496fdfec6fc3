"""A fake engine (engine.interface.ChatEngine) and a sampler that replays a fixed sequence of
snapshots: the app runs on them in a fraction of a second, the same on every run, for widget
tests and screen snapshots. The figures are made up, in the shape the real engine reports for
a streamed Kimi K3 cut (4 layers, 896 experts); the engine tests run the real thing."""

from __future__ import annotations

import threading
from dataclasses import replace

from kimitui.engine.interface import PinOutcome, TuningValues
from kimitui.engine.metrics import EngineMetrics, Snapshot, StreamingCounters
from kimitui.engine.pinning import PinProgress
from kimitui.engine.generation import GenerationResult, TokenEvent
from kimitui.engine.state import EngineError

MIB = 2**20


class FakeReply:
    def __init__(self, pieces: list[str], gate: threading.Event | None, error: str | None) -> None:
        self.pieces, self.gate, self.error = pieces, gate, error
        self.result = GenerationResult()
        self._cancel = threading.Event()

    def cancel(self) -> None:
        self._cancel.set()
        if self.gate is not None:
            self.gate.set()

    def __iter__(self):
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


class FakeEngine:
    """A streaming K3 cut as the UI sees it: named, loaded at once, 96 MiB pinned, tunable."""

    def __init__(self, *, reply: str = "Hello! I am a fake Kimi, streamed word by word.", fail_reply: str | None = None,
                 fail_load: str | None = None, budget: int = 160 * MIB) -> None:
        self.metrics = EngineMetrics()
        self.metrics.budget_bytes = budget
        self.load_s: float | None = None
        self.reply_words = [w + " " for w in reply.split(" ")]
        self.fail_reply, self.fail_load = fail_reply, fail_load
        self.gate: threading.Event | None = None  # set by a test to hold a reply mid-stream
        self.values = TuningValues(budget, 2, 64 * MIB, "pin-stream", "lfu", 4, False)
        self.retuned: list[dict] = []
        self.asked: list[list[dict]] = []

    def label(self):
        return "k3-cut.gguf", 210 * MIB

    def load(self, on_progress=None) -> None:
        if self.fail_load:
            raise EngineError(self.fail_load)
        if on_progress is not None:
            on_progress(1.0)
        self.load_s = 0.4

    def notices(self) -> list[str]:
        return []

    def pin(self, on_progress=None) -> PinOutcome:
        if on_progress is not None:
            on_progress(PinProgress(96 * MIB, 96 * MIB, 0.1))
        return PinOutcome(96 * MIB, None, whole_model=False)

    def chat(self, messages, sampling) -> FakeReply:
        self.asked.append(messages)
        return FakeReply(self.reply_words, self.gate, self.fail_reply)

    def abort_load(self) -> None:
        pass

    def tuning(self) -> TuningValues:
        return self.values

    def retune(self, **changes) -> str:
        if changes.get("budget", self.values.budget) < 40 * MIB:
            raise EngineError("budget 30.0 MiB is below the minimum working set of k3-cut.gguf: 44.1 MiB")
        self.retuned.append(changes)
        self.values = replace(self.values, **changes)
        self.metrics.budget_bytes = self.values.budget
        return "applies from the next token, after the pinned set is re-read" if "budget" in changes else "applies from the next token"


def recorded_snapshots(budget: int = 160 * MIB) -> list[Snapshot]:
    """Eight samples a quarter second apart of one streamed reply: tokens, reads, hits and the
    model's pages climbing together."""
    out = []
    for i in range(8):
        tokens = 6 * i
        out.append(Snapshot(
            time=100.0 + 0.25 * i,
            rss_bytes=(260 + 3 * i) * MIB,
            rss_peak_bytes=(262 + 3 * i) * MIB,
            cpu_percent=180.0,
            process_read_bytes=(96 + 14 * tokens) * MIB,
            process_read_rate=None if i == 0 else 336.0 * MIB,
            disk_name="nvme0n1",
            disk_read_rate=None if i == 0 else 352.0 * MIB,
            budget_bytes=budget,
            latencies=[0.040 + 0.002 * (k % 5) for k in range(tokens)],
            p50_s=0.044 if tokens else None,
            p95_s=0.048 if tokens else None,
            ttft_s=0.31 if tokens else None,
            decode_tok_s=23.1 if tokens else None,
            tokens_total=tokens,
            requests_total=1,
            prompt_tokens_total=12,
            streaming=StreamingCounters(
                cache_hits=3 * tokens, cache_misses=tokens, prefetch_queue_depth=2, prefetch_inflight_bytes=12 * MIB,
                prefetch_used=2 * tokens, prefetch_wasted_bytes=MIB, stall_s=0.002 * tokens,
                expert_hits=5 * tokens, expert_misses=11 * tokens,
            ),
            rss_history=[(260 + 3 * k) * MIB for k in range(i + 1)],
            model_rss_bytes=(120 + 2 * i) * MIB,
            read_rate_history=[336.0 * MIB] * i,
            residency=["pinned", "resident", "in flight", "cold"],
            experts_resident=[(0, 0), (40 + i, 896), (33, 896), (12 + 2 * i, 896)],
            experts=([[0] * 896] + [[(e * 7 + layer) % 5 for e in range(896)] for layer in range(3)], [None, 0.31, 0.28, 0.35]),
            disk_rates={"nvme0n1": None if i == 0 else 352.0 * MIB},
        ))
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
    sampler = RecordedSampler(recorded_snapshots(engine.metrics.budget_bytes) if snapshots is None else snapshots)
    return KimituiApp(settings, engine, sampler, HistoryStore(data_dir() / "history.sqlite3"))
