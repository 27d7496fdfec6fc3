"""The tuning strip: the streaming engine's live settings, stepped by key while the panels stay
in view, and what the last change did to them over the tokens since (tok/s, bytes read per
token, hit rate, the model's memory), beside the same figures just before it."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, fields, replace

from rich.text import Text
from textual.binding import Binding
from textual.message import Message
from textual.reactive import reactive
from textual.widget import Widget

from kimitui.config import SCHEMA
from kimitui.engine.interface import TuningValues
from kimitui.engine.metrics import Snapshot
from kimitui.engine.settings import EXPERT_POLICIES, POLICIES
from kimitui.units import format_bytes

MIB = 2**20


def _step_budget(value: int, up: bool) -> int:
    """A tenth more or less, in whole MiB: fine near a minimum, quick across gigabytes."""
    step = max(MIB, value // 10 // MIB * MIB)
    return max(16 * MIB, value + step if up else value - step)


def _step_choice(choices: tuple):
    def step(value, up: bool):
        return choices[(choices.index(value) + (1 if up else -1)) % len(choices)]

    return step


def _step_among(choices: tuple[float, ...]):
    """The next of ``choices`` (ascending) above or below the value, which need not be one of them."""
    def step(value: float, up: bool) -> float:
        if up:
            return next((c for c in choices if c > value + 1e-9), choices[-1])
        return next((c for c in reversed(choices) if c < value - 1e-9), choices[0])

    return step


def _trim_share(off: float):
    return lambda v: "off" if v == off else f"{v * 100:.3g}%"


def _clamp_int(key: str):
    """One more or less, within what the config file takes for ``engine.<key>``."""
    spec = SCHEMA["engine"][key]
    return lambda value, up: min(int(spec.high), max(int(spec.low), value + (1 if up else -1)))


def _step_shard(value: int, up: bool) -> int:
    spec = SCHEMA["engine"]["shard_size"]
    return min(int(spec.high), max(int(spec.low), value * 2 if up else value // 2))


@dataclass(frozen=True)
class Row:
    field: str
    label: str
    step: object  # (value, up) -> value
    show: object  # value -> str


ROWS = (
    Row("budget", "budget", _step_budget, lambda v: format_bytes(v)),
    Row("prefetch_depth", "prefetch", _clamp_int("prefetch_depth"), str),
    Row("shard_size", "shard size", _step_shard, lambda v: format_bytes(v)),
    Row("policy", "policy", _step_choice(POLICIES), str),
    Row("expert_policy", "experts", _step_choice(EXPERT_POLICIES), str),
    Row("io_threads", "I/O threads", _clamp_int("io_threads"), str),
    Row("expert_lookahead", "look-ahead", lambda v, up: not v, lambda v: "on" if v else "off"),
    # Expert trimming (lossy; engine/trimming.py): misses below a share, or past a cumulative share.
    Row("expert_trim_below", "trim below", _step_among((0.0, 0.02, 0.05, 0.1, 0.2)), _trim_share(0.0)),
    Row("expert_trim_cumulative", "trim past", _step_among((0.5, 0.6, 0.7, 0.8, 0.9, 1.0)), _trim_share(1.0)),
)
assert [r.field for r in ROWS] == [f.name for f in fields(TuningValues)]


@dataclass(frozen=True)
class Window:
    """The panels' figures between two snapshots."""

    tokens: int
    tok_s: float | None
    read_per_token: float | None
    hit_rate: float | None
    model_bytes: int | None

    @classmethod
    def between(cls, a: Snapshot, b: Snapshot) -> "Window":
        tokens = b.tokens_total - a.tokens_total
        recent = b.latencies[-tokens:] if tokens > 0 else []
        tok_s = len(recent) / sum(recent) if recent and sum(recent) > 0 else None
        read = None
        if tokens > 0 and a.process_read_bytes is not None and b.process_read_bytes is not None:
            read = (b.process_read_bytes - a.process_read_bytes) / tokens
        def counts(snap: Snapshot) -> tuple[int, int]:
            s = snap.streaming
            if s is None:
                return 0, 0
            return s.cache_hits + (s.expert_hits or 0), s.cache_misses + (s.expert_misses or 0)

        (hits_a, misses_a), (hits_b, misses_b) = counts(a), counts(b)
        if a.streaming is None or b.streaming is None or a.streaming.generation != b.streaming.generation:
            hits_a = misses_a = 0  # a re-pin made a new streamer: it counts from zero
        hits, misses = hits_b - hits_a, misses_b - misses_a
        rate = hits / (hits + misses) if hits + misses > 0 else None
        model = b.model_rss_bytes if b.model_rss_bytes is not None else b.rss_bytes
        return cls(tokens, tok_s, read, rate, model)

    def line(self, name: str, compact: bool = False) -> str:
        tok_s = "—" if self.tok_s is None else f"{self.tok_s:.2f}"
        read = "—" if self.read_per_token is None else format_bytes(int(self.read_per_token))
        hits = "—" if self.hit_rate is None else f"{self.hit_rate:.0%}"
        if compact:  # a phone's 46 cells: the model's memory is the memory panel's, beside
            return f"{name:<6} {tok_s} tok/s {read}/tok {hits} ({self.tokens})"
        return f"{name:<7}{tok_s:>7} {read:>10} {hits:>5} {format_bytes(self.model_bytes):>10}  {self.tokens} tok"


class TuningPanel(Widget, can_focus=True):
    """Hidden until ctrl+e; ``current`` is set by the screen from the engine, ``snapshot``
    bound to the screen's. Posts ``Apply`` with the changed fields."""

    BINDINGS = [
        Binding("up,k", "move(-1)", "previous", show=False),
        Binding("down,j", "move(1)", "next", show=False),
        Binding("left,h", "step(False)", "less", show=False),
        Binding("right,l", "step(True)", "more", show=False),
        Binding("enter", "apply", "apply"),
    ]
    HISTORY = 40  # snapshots kept for the "before" figures (10 s at the default interval)

    # layout=True: the strip's height follows its lines (an outcome, the before/after figures)
    current: reactive[TuningValues | None] = reactive(None, init=False, layout=True)
    pending: reactive[TuningValues | None] = reactive(None, init=False, layout=True)
    row = reactive(0)
    outcome = reactive("", layout=True)  # what the engine said of the last change
    snapshot: reactive[Snapshot | None] = reactive(None, init=False, always_update=True)

    @dataclass
    class Apply(Message):
        changes: dict

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.border_title = "tune"
        self._recent: deque[Snapshot] = deque(maxlen=self.HISTORY)
        self._before: Window | None = None
        self._applied_at: Snapshot | None = None

    def watch_snapshot(self, snap: Snapshot | None) -> None:
        if snap is None:
            return
        self._recent.append(snap)
        if self._applied_at is not None:
            self.refresh(layout=True)

    def action_move(self, delta: int) -> None:
        self.row = (self.row + delta) % len(ROWS)

    def action_step(self, up: bool) -> None:
        base = self.pending or self.current
        if base is None:
            return
        row = ROWS[self.row]
        self.pending = replace(base, **{row.field: row.step(getattr(base, row.field), up)})

    def action_apply(self) -> None:
        if self.pending is None or self.current is None:
            return
        changes = {f.name: getattr(self.pending, f.name) for f in fields(TuningValues)
                   if getattr(self.pending, f.name) != getattr(self.current, f.name)}
        self.pending = None
        if changes:
            self.post_message(self.Apply(changes))

    def drop_pending(self) -> bool:
        """Forget the values stepped but not applied; whether there were any."""
        had, self.pending = self.pending is not None, None
        return had

    def applied(self, outcome: str) -> None:
        """The screen says what the engine made of the change: figures restart from here."""
        self.outcome = outcome
        if self._recent:
            self._before = Window.between(self._recent[0], self._recent[-1])
            self._applied_at = self._recent[-1]

    def render(self) -> Text:
        values = self.pending or self.current
        if values is None:
            return Text("tuning: the engine is not loaded yet", style="dim")
        compact = self.size.width < 60
        out = Text()
        if not compact:
            out.append("↑↓ pick  ←→ change  enter apply  esc drop\n", style="dim")
        for index, row in enumerate(ROWS):
            if compact and index != self.row:
                continue
            now = getattr(self.current, row.field) if self.current is not None else None
            new = getattr(values, row.field)
            chosen = index == self.row
            out.append("▸ " if chosen else "  ", style="bold" if chosen else "")
            out.append(f"{row.label:<12}", style="bold" if chosen else "")
            out.append(row.show(now) if now is not None else "—")
            if new != now:
                out.append(f" → {row.show(new)}", style="bold")
            if compact:
                out.append(f"  {index + 1}/{len(ROWS)} ↑↓", style="dim")
            out.append("\n")
        if self.outcome:
            out.append(self.outcome + "\n", style="italic")
        if self._applied_at is not None and self._before is not None and self._recent:
            if not compact:
                out.append(f"{'':<7}{'tok/s':>7} {'read/tok':>10} {'hits':>5} {'model':>10}\n", style="dim")
            out.append(self._before.line("before", compact) + "\n")
            out.append(Window.between(self._applied_at, self._recent[-1]).line("after", compact))
        out.rstrip()
        return out
