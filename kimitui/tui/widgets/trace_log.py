"""Live views of the per-token trace: a filterable log pane and the last token's time split.

Both take records from ``TraceWriter.subscribe(widget.feed)``. ``feed`` runs on the engine's
and I/O threads, so it only appends to a deque (thread-safe appends and pops); a timer on the
UI thread drains it. The threads that read the model never wait for the UI, and many reads
arrive as one repaint.
"""

from __future__ import annotations

import re
from collections import deque

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widget import Widget
from textual.widgets import Input, RichLog

from kimitui.units import format_bytes, format_ms

DRAIN_S = 0.2
TYPES = ("session", "request", "token", "read", "end", "close")
_REQUEST_ID = re.compile(r"^req-\d+$")


def _drain(pending: deque) -> list[dict]:
    batch = []
    while True:
        try:
            batch.append(pending.popleft())
        except IndexError:
            return batch


def record_request(record: dict) -> str | None:
    return record.get("id") if record["type"] == "request" else record.get("req")


def format_record(record: dict) -> Text:
    """One line per record, the request first so a column of ids reads down the pane."""
    kind = record["type"]
    req = record_request(record) or ""
    if kind == "token":
        line = Text.assemble((f"{req} #{record['i']}", "bold"), f" {format_ms(record['wall_s'])}")
        if record["stall_s"] is None:
            line.append(" · not streamed")
        else:
            # The breakdown bar splits the wall time; this line stays short enough for a phone.
            line.append(
                f" · stall {format_ms(record['stall_s'])} · read {format_bytes(record['bytes_read'])}"
                f" · cache {format_bytes(record['bytes_from_cache'])}"
                f" · hits {record['hits']}/{record['hits'] + record['misses']}"
                f" · prefetch {record['prefetch_used']}/{record['prefetch_issued']}"
            )
        return line
    if kind == "read":
        if record["expert"] is not None:
            unit = f"expert {record['expert']}"
        else:  # neither: a layer's routed experts read whole for a prompt
            unit = f"shard {record['shard']}" if record["shard"] is not None else "routed experts (whole)"
        return Text(
            f"{req} read {unit} layer {record['layer']} {format_bytes(record['bytes'])} "
            f"at +{record['start_s']:.3f}s in {format_ms(record['dur_s'])}",
            style="dim",
        )
    if kind == "request":
        s = record["settings"]
        return Text.assemble(
            (f"{req} ▶ {record['model']}", "bold"),
            f" · budget {format_bytes(s.get('budget'))} · shard {format_bytes(s.get('shard_size'))}"
            f" · prefetch {s.get('prefetch_depth', '—')} · {s.get('policy', '—')}"
            + ("" if s.get("streaming") else " · not streamed"),
        )
    if kind == "end":
        line = Text.assemble(
            (f"{req} ■ {record['finish']}", "bold"),
            f" · {record['completion_tokens']} tok · prompt {format_ms(record['prompt_s'])} · decode {format_ms(record['decode_s'])}",
        )
        if record["error"]:
            line.append(f" · {record['error']}", style="red")
        return line
    if kind == "session":
        return Text(f"trace session {record['session']} part {record['part']}", style="dim")
    return Text("trace closed", style="dim")


class TraceFilter:
    """Words of the filter box: a record type (``token``, ``read``...) shows only that type,
    ``-read`` hides one, ``req-3`` shows one request, any other word must appear in the line.
    Words of one kind widen the choice (``token end``); different kinds narrow it."""

    def __init__(self, text: str) -> None:
        self.types: set[str] = set()
        self.hidden: set[str] = set()
        self.requests: set[str] = set()
        self.words: list[str] = []
        for word in text.lower().split():
            bare = word.lstrip("-")
            name = bare if bare in TYPES else bare.removesuffix("s")  # "reads" is "read"
            if name in TYPES:
                (self.hidden if word.startswith("-") else self.types).add(name)
            elif _REQUEST_ID.match(word):
                self.requests.add(word)
            else:
                self.words.append(word)

    def matches(self, record: dict, line: Text) -> bool:
        kind = record["type"]
        if kind in self.hidden or (self.types and kind not in self.types):
            return False
        if self.requests and record_request(record) not in self.requests:
            return False
        plain = line.plain.lower()
        return all(word in plain for word in self.words)


class TraceLog(Vertical):
    """The trace as it is written, newest last; the box on top filters it."""

    DEFAULT_CSS = """
    TraceLog { height: 1fr; border: round $primary 40%; border-title-color: $text-muted; }
    TraceLog > Input { height: 3; border: round $primary 30%; }
    TraceLog > RichLog { height: 1fr; scrollbar-size-vertical: 1; }
    """
    KEEP = 2000  # records kept for re-filtering; the oldest go first

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.border_title = "trace"
        self._pending: deque[dict] = deque(maxlen=self.KEEP)
        self._records: deque[tuple[dict, Text]] = deque(maxlen=self.KEEP)
        self.filter = TraceFilter("")

    def compose(self) -> ComposeResult:
        yield Input(placeholder="filter: token · read · -read · req-3 · any text", id="trace-filter")
        # Wrapped, not cut: on a phone-width pane a record's end matters as much as its start.
        yield RichLog(max_lines=self.KEEP, wrap=True, min_width=20, auto_scroll=True, id="trace-lines")

    def on_mount(self) -> None:
        self.set_interval(DRAIN_S, self.drain)

    def feed(self, record: dict) -> None:
        """Any thread: hand a record over (the TraceWriter listener)."""
        self._pending.append(record)

    def drain(self) -> None:
        log = self.query_one(RichLog)
        for record in _drain(self._pending):
            line = format_record(record)
            self._records.append((record, line))
            if self.filter.matches(record, line):
                log.write(line)

    @on(Input.Changed, "#trace-filter")
    def refilter(self, event: Input.Changed) -> None:
        self.filter = TraceFilter(event.value)
        log = self.query_one(RichLog)
        log.clear()
        for record, line in self._records:
            if self.filter.matches(record, line):
                log.write(line)


def _busy_within(intervals: list[tuple[float, float]], low: float, high: float) -> float:
    """Time in [low, high] covered by at least one interval."""
    total, reach = 0.0, low
    for start, end in sorted(intervals):
        start, end = max(start, reach), min(end, high)
        if end > start:
            total += end - start
            reach = end
    return total


class TokenBreakdown(Widget):
    """The last token's wall time as a bar of three parts: stall (compute waiting for
    storage), I/O (computing while reads were in flight: storage hidden by prefetch) and
    compute (computing alone)."""

    COMPONENT_CLASSES = {
        "token-breakdown--stall", "token-breakdown--overlap", "token-breakdown--compute", "token-breakdown--other",
    }
    DEFAULT_CSS = """
    TokenBreakdown { height: 3; }
    TokenBreakdown > .token-breakdown--stall { color: $error; }
    TokenBreakdown > .token-breakdown--overlap { color: $warning; }
    TokenBreakdown > .token-breakdown--compute { color: $success; }
    TokenBreakdown > .token-breakdown--other { color: $text-muted; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._pending: deque[dict] = deque(maxlen=4096)
        # Reads of the current request as (start, end) since its start. A read still running
        # when a token ends arrives after that token's record and counts only for the next.
        self._reads: list[tuple[float, float]] = []
        self.last: dict | None = None  # {"wall", "stall", "overlap", "compute", "other", "bytes_read"}

    def on_mount(self) -> None:
        self.set_interval(DRAIN_S, self.drain)

    def feed(self, record: dict) -> None:
        """Any thread: hand a record over (the TraceWriter listener)."""
        if record["type"] in ("request", "read", "token"):
            self._pending.append(record)

    def drain(self) -> None:
        changed = False
        for record in _drain(self._pending):
            kind = record["type"]
            if kind == "request":
                self._reads.clear()
            elif kind == "read":
                self._reads.append((record["start_s"], record["start_s"] + record["dur_s"]))
            else:
                self.last = self._split(record)
                changed = True
        if changed:
            self.refresh()

    def _split(self, token: dict) -> dict:
        """wall = stall + I/O hidden behind compute + compute alone + other (sampling, Python)."""
        wall, stall = token["wall_s"], token["stall_s"]
        low = token["t"] - wall
        # Reads ended before this token began are of no further use.
        self._reads = [r for r in self._reads if r[1] > low]
        measured = token.get("compute_s")
        if stall is None:
            compute = wall if measured is None else min(measured, wall)
            return {"wall": wall, "stall": None, "overlap": None, "compute": compute, "other": wall - compute, "bytes_read": None}
        stall = min(stall, wall)
        compute = wall - stall if measured is None else min(measured, wall - stall)
        busy = _busy_within(self._reads, low, token["t"])
        overlap = min(max(0.0, busy - stall), compute)
        return {
            "wall": wall, "stall": stall, "overlap": overlap, "compute": compute - overlap,
            "other": wall - stall - compute, "bytes_read": token["bytes_read"],
        }

    def render(self) -> Text:
        last = self.last
        if last is None:
            return Text("last token —", style="dim")
        head = f"last token {format_ms(last['wall'])}"
        if last["stall"] is None:
            return Text(
                f"{head}\nnot streamed: compute {last['compute'] * 1000:.0f} · other {last['other'] * 1000:.0f} ms",
                style="dim", no_wrap=True, overflow="ellipsis",
            )
        styles = {name: self.get_component_rich_style(f"token-breakdown--{name}") for name in ("stall", "overlap", "compute", "other")}
        width = max(1, self.size.width)
        bar = Text(no_wrap=True)
        used = 0
        for name, char in (("stall", "█"), ("overlap", "▓"), ("compute", "█")):
            cells = round(width * last[name] / last["wall"]) if last["wall"] > 0 else 0
            cells = min(cells, width - used)
            bar.append(char * cells, style=styles[name])
            used += cells
        bar.append("░" * (width - used), style=styles["other"])  # the remainder absorbs rounding

        def ms(seconds: float) -> str:
            return f"{seconds * 1000:.0f}"

        return Text.assemble(
            bar, "\n", f"{head} · read {format_bytes(last['bytes_read'])}", "\n",
            (f"stall {ms(last['stall'])}", styles["stall"]), " · ",
            (f"I/O {ms(last['overlap'])}", styles["overlap"]), " · ",
            (f"compute {ms(last['compute'])}", styles["compute"]), " · ",
            (f"other {ms(last['other'])} ms", styles["other"]),
            no_wrap=True, overflow="ellipsis",
        )
