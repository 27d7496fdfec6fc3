"""The live panels and their column. Each panel renders one metrics Snapshot; missing values
show "—" with the reason."""

from __future__ import annotations

from rich.console import Group
from rich.progress_bar import ProgressBar
from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.reactive import reactive
from textual.widgets import Sparkline, Static

from kimitui.engine.metrics import Snapshot, StreamingCounters
from kimitui.units import format_bytes, format_ms, format_rate

# Why the streaming panels show "—"; the app sets it once it knows what was pinned.
NOT_STREAMING = "no streaming counters yet"
NOT_REPORTED = "not reported by this server"


def _level(fraction: float | None) -> str:
    if fraction is None:
        return ""
    return "error" if fraction >= 0.95 else "warning" if fraction >= 0.8 else "success"


class Panel(Vertical, can_focus=True):
    """A bordered panel: a text body and, for some, a sparkline under it. Fed by its screen:
    ``snapshot`` and ``idle_note`` are bound to the screen's (``data_bind``)."""

    TITLE = ""
    KEY = ""  # the key that shows or hides it (the screen's bindings are made from these)
    LABEL = ""  # its name in the footer, where the title is too long; the title otherwise
    HAS_SPARKLINE = False
    snapshot: reactive[Snapshot | None] = reactive(None, init=False, always_update=True)
    idle_note = reactive(NOT_STREAMING, init=False)

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.border_title = f"{self.KEY} {self.TITLE}"
        self.body = Static("—", classes="panel-body")
        self.note = Static("", classes="panel-note -empty")

    def compose(self) -> ComposeResult:
        yield self.body
        yield self.note
        if self.HAS_SPARKLINE:
            yield Sparkline([], summary_function=max, classes="panel-spark -empty")

    def watch_snapshot(self, snap: Snapshot | None) -> None:
        if snap is not None and self.display:
            self.render_snapshot(snap)

    def render_snapshot(self, snap: Snapshot) -> None:
        raise NotImplementedError

    def show_spark(self, data: list[float]) -> None:
        """The sparkline, or no row at all while there is nothing to draw (Textual would draw
        an empty series as a floor of ▁ cells, a zero that was never measured)."""
        spark = self.query_one(Sparkline)
        spark.data = data
        spark.set_class(not data, "-empty")

    def show_note(self, text: str) -> None:
        """The line under the figures; none at all when empty (a blank row is a row less for the others)."""
        self.note.update(text)
        self.note.set_class(not text, "-empty")

    def missing(self, snap: Snapshot) -> str:
        """Why a streaming figure is missing: the local reason; a kimitui server reports streaming
        whenever it streams; any other server does not report it."""
        if snap.reported_by is None:
            return self.idle_note
        return "nothing streams on the server" if snap.reported_by == "kimitui" else NOT_REPORTED

    def set_level(self, level: str) -> None:
        for name in ("success", "warning", "error"):
            self.set_class(name == level, f"-{name}")


class StreamingPanel(Panel):
    """A panel of the streamer's counters: while none streams, ``PLACEHOLDER`` and the reason."""

    PLACEHOLDER = "—"

    def render_snapshot(self, snap: Snapshot) -> None:
        if snap.streaming is None:
            self.body.update(self.PLACEHOLDER)
            self.show_note(self.missing(snap))
        else:
            self.render_streaming(snap, snap.streaming)

    def render_streaming(self, snap: Snapshot, s: StreamingCounters) -> None:
        raise NotImplementedError


class CachePanel(StreamingPanel):
    TITLE = "shard cache"
    KEY = "1"
    LABEL = "cache"
    PLACEHOLDER = "hits — miss —\nhit rate —"

    def render_streaming(self, snap: Snapshot, s: StreamingCounters) -> None:
        rate = snap.cache_hit_rate
        experts = ""
        if s.expert_hits is not None:
            experts = f"\nexperts {s.expert_hits:,}/{s.expert_hits + s.expert_misses:,}"
        self.body.update(
            f"hits {s.cache_hits:,} miss {s.cache_misses:,}\n"
            f"hit rate {'—' if rate is None else f'{rate:.0%}'}{experts}"
        )
        self.show_note("")


class PrefetchPanel(StreamingPanel):
    TITLE = "prefetch"
    KEY = "2"
    PLACEHOLDER = "queue —\nstall —\nused —\nwasted —"

    def render_streaming(self, snap: Snapshot, s: StreamingCounters) -> None:
        self.body.update(
            f"queue {s.prefetch_queue_depth}, {format_bytes(s.prefetch_inflight_bytes)}\n"
            f"stall {format_ms(s.stall_s)}\n"
            f"used {s.prefetch_used}\nwasted {format_bytes(s.prefetch_wasted_bytes)}"
        )
        # Direct reads ran out of buffers (a window larger than the pool): slower, so say so.
        spilled = s.page_cache_fallback_bytes
        self.show_note(f"{format_bytes(spilled)} via page cache: read pool spent" if spilled else "")


class DiskPanel(Panel):
    TITLE = "SSD"
    KEY = "3"
    HAS_SPARKLINE = True

    def render_snapshot(self, snap: Snapshot) -> None:
        if len(snap.disk_rates) > 1:  # a split set over several drives: one short line each
            disk = "\n".join(f"{name[:8]} {format_rate(rate)}" for name, rate in snap.disk_rates.items())
        else:
            disk = "disk —" if snap.disk_name is None else f"{snap.disk_name} {format_rate(snap.disk_read_rate)}"
        counted = " (engine)" if snap.read_counted_by == "engine" else ""  # no OS counters (iOS)
        self.body.update(
            f"read{counted} {format_rate(snap.process_read_rate)}\n"
            f"total {format_bytes(snap.process_read_bytes)}\n{disk}"
        )
        if snap.reported_by is not None and snap.process_read_bytes is None:
            self.show_note(NOT_REPORTED)
        else:
            self.show_note(snap.disk_note or "")
        self.show_spark(snap.read_rate_history)


class MemoryPanel(Panel):
    TITLE = "memory"
    KEY = "4"
    summary = "RSS —"

    def render_snapshot(self, snap: Snapshot) -> None:
        # The budget is the model's: its pages are measured against it, the rest of the process
        # (interpreter, UI, llama.cpp's KV cache and buffers) is shown beside it.
        if snap.reported_by is not None and snap.rss_bytes is None:
            self.summary = "RSS —"
            self.body.update("RSS —\npeak —\nbudget —")
            self.show_note(NOT_REPORTED)
            self.set_level("")
            return
        budget = snap.budget_bytes
        model = snap.model_rss_bytes
        held = model if model is not None else snap.rss_bytes
        fraction = held / budget if budget and held is not None else None
        share = "" if fraction is None else f" ({fraction:.0%})"
        if model is None:
            self.summary = f"RSS {format_bytes(snap.rss_bytes)}\npeak {format_bytes(snap.rss_peak_bytes)}\nof {format_bytes(budget)}{share}"
        else:
            self.summary = (
                f"model {format_bytes(model)}\nof {format_bytes(budget)}{share}\n"
                f"other {format_bytes(max(0, snap.rss_bytes - model))}\npeak RSS {format_bytes(snap.rss_peak_bytes)}"
            )
        # On Darwin jetsam weighs the footprint, not RSS: shown beside, against its limit on iOS.
        footprint, limit = snap.footprint_bytes, snap.footprint_limit_bytes
        level = fraction
        if footprint is not None:
            self.summary += f"\nfootprint {format_bytes(footprint)}" + (f" of {format_bytes(limit)}" if limit else "")
            if limit:
                level = max(fraction or 0.0, footprint / limit)
        text = Text(self.summary)
        # Rich's bar takes the width it is given at render time, whatever the layout.
        bar = ProgressBar(total=1.0, completed=min(1.0, fraction)) if fraction is not None else Text("—")
        self.body.update(Group(text, bar))
        self.show_note("")
        self.set_level(_level(level))


class LatencyPanel(Panel):
    TITLE = "token latency"
    LABEL = "latency"
    KEY = "5"
    HAS_SPARKLINE = True

    def render_snapshot(self, snap: Snapshot) -> None:
        tok_s = "—" if snap.decode_tok_s is None else f"{snap.decode_tok_s:.1f}"
        drafts = snap.drafts
        speculated = ""
        if drafts is not None and drafts.drafted:  # passes that checked drafts: what they gave
            speculated = f"\n{drafts.tokens_per_pass:.1f} tok/pass, {drafts.acceptance:.0%} drafts kept"
        self.body.update(
            f"p50 {format_ms(snap.p50_s)}\np95 {format_ms(snap.p95_s)}\n"
            f"TTFT {format_ms(snap.ttft_s)}\n{tok_s} tok/s{speculated}"
        )
        # A server's replies are timed here, as their tokens arrive: the network is in them.
        self.show_note("timed here, network included" if snap.reported_by is not None else "")
        self.show_spark([x * 1000 for x in snap.latencies])


RESIDENCY_STYLE = {"pinned": ("█", "bold"), "resident": ("▓", ""), "in flight": ("▒", "italic"), "cold": ("░", "dim")}


class ResidencyPanel(Panel):
    """One cell per layer: the trunk (█ pinned, ▓ resident, ▒ in flight, ░ cold) and, for a
    streamed MoE model, a second row with the share of each layer's experts in memory, where
    the bytes are."""

    TITLE = "residency"
    KEY = "7"

    def render_snapshot(self, snap: Snapshot) -> None:
        if snap.residency is None:
            pinned = snap.reported_by in (None, "kimitui") and snap.streaming is None
            self.body.update("every layer pinned" if pinned else "—")
            self.show_note(self.missing(snap) if snap.streaming is None else "")
            return
        width = max(8, self.body.size.width - 8)
        per_cell = max(1, -(-len(snap.residency) // width))  # K3's 93 layers fit 50 columns in pairs
        order = list(RESIDENCY_STYLE)
        trunk = Text("trunk   ")
        for i in range(0, len(snap.residency), per_cell):
            state = max(snap.residency[i : i + per_cell], key=order.index)  # the least ready wins
            char, style = RESIDENCY_STYLE[state]
            trunk.append(char, style=style)
        lines = [trunk]
        resident = snap.experts_resident
        if resident is not None:
            row = Text("experts ")
            for i in range(0, len(resident), per_cell):
                cell = [r / n for r, n in resident[i : i + per_cell] if n]
                share = max(cell, default=None)
                row.append(" " if share is None else "·" if share == 0 else HEAT[min(4, 1 + int(share * 4))])
            lines.append(row)
            held, total = sum(r for r, _ in resident), sum(n for _, n in resident)
            lines.append(Text(f"in memory {held:,}/{total:,}"))
        self.body.update(Text("\n").join(lines))
        self.show_note("█ pinned ▓ resident ▒ in flight ░ cold" + ("; experts: share in memory" if resident is not None else ""))


HEAT = " ░▒▓█"


class ExpertPanel(Panel):
    """Routing heatmap: a row per MoE layer, experts bucketed to the panel's width, and the
    layer's cache hit rate at the end."""

    TITLE = "experts"
    KEY = "8"

    def render_snapshot(self, snap: Snapshot) -> None:
        if snap.experts is None:
            self.body.update("—")
            self.show_note(NOT_REPORTED if snap.reported_by is not None else "no routed experts stream (dense model, or it fits)")
            return
        counts, rates = snap.experts
        width = max(8, self.body.size.width - 10)
        peak = max((max(row) for row in counts if row), default=0) or 1
        lines = Text()
        for layer, row in enumerate(counts):
            if not any(row) and rates[layer] is None:
                continue
            per_cell = max(1, -(-len(row) // width))
            cells = [max(row[i : i + per_cell]) for i in range(0, len(row), per_cell)]
            lines.append(f"{layer:>3} ")
            lines.append("".join(HEAT[min(4, -(-4 * c // peak))] for c in cells))
            rate = rates[layer]
            lines.append(f" {'—' if rate is None else f'{rate:.0%}':>4}\n")
        lines.rstrip()  # the last row's newline: no blank row under the map
        s = snap.streaming
        total = "—"
        if s is not None and s.expert_hits is not None and s.expert_hits + s.expert_misses:
            total = f"{s.expert_hits / (s.expert_hits + s.expert_misses):.0%}"
        self.body.update(lines)
        self.show_note(f"expert hit rate {total} · █ most routed")


class ApiPanel(Panel):
    """Requests served by `--serve`, newest last; shown only while the API runs."""

    TITLE = "API"
    KEY = "6"
    SHOWN = 6

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.lines: list[str] = []
        self.url = ""

    def add_request(self, record: dict) -> None:
        tokens = record.get("tokens")
        queued = record.get("queue_position")
        self.lines.append(
            f"{record.get('status')} {record.get('method')} {record.get('path')}"
            + (f" {tokens} tok" if tokens else "")
            + (f" q{queued}" if queued else "")
            + f" {record.get('duration_s', 0):.2f}s"
        )
        del self.lines[: -self.SHOWN]
        self.show_requests()

    def show_requests(self) -> None:
        self.body.update("\n".join([self.url, *self.lines]) if self.lines else f"{self.url}\nno requests yet")

    def render_snapshot(self, snap: Snapshot) -> None:
        self.show_requests()


PANEL_TYPES: tuple[type[Panel], ...] = (
    CachePanel, PrefetchPanel, DiskPanel, MemoryPanel, LatencyPanel, ApiPanel, ResidencyPanel, ExpertPanel,
)


class PanelColumn(Vertical):
    """The panels, one under another (two to a row on a phone). More panels than rows scroll
    without a scrollbar: a thumb's block glyphs beside a panel pass for sparkline cells past its
    border. While a panel is out of view, the last row says how many and how to see them."""

    def __init__(self, *panels: Panel, **kwargs) -> None:
        super().__init__(*panels, **kwargs)
        self.more = Static("", classes="panels-more -empty")

    def compose(self) -> ComposeResult:
        yield self.more

    def on_mount(self) -> None:
        # The virtual size changes as a panel grows, shrinks, is shown or hidden.
        for name in ("scroll_y", "virtual_size"):
            self.watch(self, name, lambda: self.call_after_refresh(self.show_more), init=False)

    def on_resize(self, event: events.Resize) -> None:
        self.call_after_refresh(self.show_more)

    def out_of_view(self) -> tuple[int, int]:
        """The shown panels not wholly in view: above it, below it. The note's row is not in
        view: the note covers it whenever a panel is out of view."""
        top = self.scroll_offset.y
        regions = [panel.virtual_region_with_margin for panel in self.query_children(Panel) if panel.display]
        above = sum(region.y < top for region in regions)
        for rows in (self.scrollable_content_region.height, self.scrollable_content_region.height - 1):
            below = sum(region.y >= top and region.bottom > top + rows for region in regions)
            if not above and not below:
                break
        return above, below

    def show_more(self) -> None:
        above, below = self.out_of_view()
        hidden = above + below
        where = "out of view" if above and below else "above" if above else "below"
        noun = "panel" if hidden == 1 else "panels"
        self.more.update(f"+{hidden} {noun} {where}: scroll or hide (1-8)" if hidden else "")
        self.more.set_class(not hidden, "-empty")
