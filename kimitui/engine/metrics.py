"""One metrics module for the TUI, bench and the HTTP API.

Two sources meet here: a sampler reading the process through psutil at an interval, and
what the engine reports (tokens and requests as they happen; the streaming engine's counters,
read from it when sampled). A value nobody has measured stays ``None`` so every consumer shows "—" instead of
inventing a number.
"""

from __future__ import annotations

import math
import os
import resource
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import psutil

from kimitui.engine import memory
from kimitui.engine.platform import is_darwin

HISTORY_SAMPLES = 120


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile; None for no data."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[rank]


@dataclass
class StreamingCounters:
    """What the streaming engine reports; absent (None) until a streamer attaches."""

    cache_hits: int = 0
    cache_misses: int = 0
    prefetch_queue_depth: int = 0
    prefetch_inflight_bytes: int = 0
    prefetch_used: int = 0  # reads ahead (shards, experts) that compute then used
    prefetch_wasted_bytes: int = 0  # read ahead, dropped unused
    page_cache_fallback_bytes: int = 0  # shard bytes meant for a direct read that went through the page cache
    stall_s: float = 0.0
    expert_hits: int | None = None  # None: the model streams no routed experts
    expert_misses: int | None = None
    expert_routes: int | None = None  # None: expert trimming was never on (trimming.py)
    expert_routes_skipped: int | None = None
    # Which streamer counted these: live tuning that re-reads the pinned set makes a new one,
    # whose counts start from zero (a window across two generations must not subtract them).
    generation: int = 0


@dataclass
class DraftCounts:
    """Speculative decoding so far: decode passes, drafts, drafts kept, tokens those passes gave."""

    passes: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0

    @property
    def tokens_per_pass(self) -> float | None:
        return self.emitted / self.passes if self.passes else None

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None


class EngineMetrics:
    """Thread-safe record of engine events, written by the engine thread, and the sources
    (the streamer's counters among them) that samplers read through."""

    def __init__(self, latency_window: int = 64) -> None:
        self._lock = threading.Lock()
        self.latencies: deque[float] = deque(maxlen=latency_window)
        self.ttft_s: float | None = None
        self.tokens_total = 0
        self.requests_total = 0
        self.prompt_tokens_total = 0
        self.last_decode_tok_s: float | None = None
        # Set by the engine: its budget as it is now (live tuning changes it), never a copy.
        self.budget_source: Callable[[], int | None] | None = None
        # Set by the streaming engine: one state per layer (pinned / resident / in flight / cold).
        self.residency_source: Callable[[], list[str]] | None = None
        # Set by the engine once the model is mapped: resident bytes of the model's mappings.
        self.model_resident_source: Callable[[], int | None] | None = None
        # Set when routed experts stream: (routing counts [layer][expert], hit rate per layer).
        self.experts_source: Callable[[], tuple[list[list[int]], list[float | None]]] | None = None
        # Set when routed experts stream: per layer, (experts resident, cached or pinned; experts).
        self.expert_residency_source: Callable[[], list[tuple[int, int]]] | None = None
        # Set by the engine: the model bytes it has read itself (pinned set, shards, experts).
        # What the SSD panel shows where the OS keeps no per-process I/O counters (iOS, macOS).
        self.engine_read_source: Callable[[], int] | None = None
        # Set by the streaming engine: its counters as they are now, read when a panel asks
        # rather than copied here at every layer (30-120 copies a token, all overhead).
        self.streaming_source: Callable[[], dict] | None = None
        self.streamer_generation = 0
        # Speculative decoding, cumulative: decode passes, drafts, drafts kept, tokens the passes gave.
        self.drafts: DraftCounts | None = None
        self._request_start: float | None = None
        self._first_token_at: float | None = None
        self._last_token_at: float | None = None
        self._request_tokens = 0

    @property
    def budget_bytes(self) -> int | None:
        return self.budget_source() if self.budget_source is not None else None

    def request_started(self) -> None:
        with self._lock:
            self.requests_total += 1
            self._request_start = time.perf_counter()
            self._first_token_at = None
            self._request_tokens = 0

    def draft_pass(self, drafted: int, kept: int, emitted: int) -> None:
        """A decode pass of a speculating reply (speculation.py) ended."""
        with self._lock:
            d = self.drafts = self.drafts or DraftCounts()
            d.passes += 1
            d.drafted += drafted
            d.accepted += kept
            d.emitted += emitted

    def prompt_evaluated(self, n_tokens: int) -> None:
        with self._lock:
            self.prompt_tokens_total += n_tokens

    def token(self, wall_s: float) -> None:
        now = time.perf_counter()
        with self._lock:
            if self._first_token_at is not None:  # a reply's first token carries its prompt: that is TTFT
                self.latencies.append(wall_s)
            self.tokens_total += 1
            self._request_tokens += 1
            if self._first_token_at is None:
                self._first_token_at = now
                if self._request_start is not None:
                    self.ttft_s = now - self._request_start
            self._last_token_at = now
            if self._request_tokens > 1 and self._last_token_at > self._first_token_at:
                self.last_decode_tok_s = (self._request_tokens - 1) / (self._last_token_at - self._first_token_at)

    def request_finished(self) -> None:
        with self._lock:
            self._request_start = None

    def attach_streamer(self, counters: Callable[[], dict]) -> None:
        """A streamer (the first, or one that replaced the last, whose counts start from zero)
        reports through ``counters``: from now on the panels show real values."""
        with self._lock:
            self.streamer_generation += 1
            self.streaming_source = counters

    @property
    def streaming(self) -> StreamingCounters | None:
        with self._lock:
            source, generation = self.streaming_source, self.streamer_generation
        return None if source is None else StreamingCounters(**source(), generation=generation)

    def view(self) -> dict:
        streaming = self.streaming  # before the lock: the property takes it (and reads the streamer outside it)
        with self._lock:
            lat = list(self.latencies)
            drafts = None if self.drafts is None else DraftCounts(**vars(self.drafts))
            return {
                "drafts": drafts,
                "latencies": lat,
                "ttft_s": self.ttft_s,
                "tokens_total": self.tokens_total,
                "requests_total": self.requests_total,
                "prompt_tokens_total": self.prompt_tokens_total,
                "decode_tok_s": self.last_decode_tok_s,
                "streaming": streaming,
                "budget_bytes": self.budget_bytes,
            }


@dataclass(frozen=True)
class Snapshot:
    time: float
    rss_bytes: int
    rss_peak_bytes: int
    cpu_percent: float | None
    process_read_bytes: int | None  # from storage, cumulative
    process_read_rate: float | None  # bytes/s since the previous sample
    disk_name: str | None  # the disk of the model's first file (a split set's trunk)
    disk_read_rate: float | None  # that whole disk, bytes/s
    budget_bytes: int | None
    latencies: list[float]
    p50_s: float | None
    p95_s: float | None
    ttft_s: float | None
    decode_tok_s: float | None
    tokens_total: int
    requests_total: int
    prompt_tokens_total: int
    streaming: StreamingCounters | None
    rss_history: list[int] = field(default_factory=list)
    # The model's share of rss_bytes (its pinned, streamed and cached pages); None where unknown.
    model_rss_bytes: int | None = None
    read_rate_history: list[float] = field(default_factory=list)
    residency: list[str] | None = None
    # per layer: (routed experts in memory, cached or pinned; the layer's routed experts), (0, 0) for a dense one
    experts_resident: list[tuple[int, int]] | None = None
    experts: tuple[list[list[int]], list[float | None]] | None = None
    # every disk holding a model file, in file order, and its read rate (bytes/s; None until
    # two samples): a split set spread over drives shows each drive
    disk_rates: dict[str, float | None] = field(default_factory=dict)
    # Who counted process_read_bytes: "process" (the OS's per-process counters), "engine" (the
    # engine's own reads, where the OS keeps no such counters), or None (neither).
    read_counted_by: str | None = "process"
    # Darwin: what Mach's task_info says this process's footprint is (jetsam weighs it, not
    # RSS) and, on iOS, the jetsam limit it is weighed against; None elsewhere.
    footprint_bytes: int | None = None
    footprint_limit_bytes: int | None = None
    # Why there is no drive figure (disk_name None), said by the SSD panel.
    disk_note: str | None = None
    # Speculative decoding, where a reply has drafted: tokens per pass and the share of drafts kept.
    drafts: DraftCounts | None = None
    # None: this process's own engine. Else the server the figures come from (remote mode):
    # what it does not report is None above, and the panels say so.
    reported_by: str | None = None

    @property
    def cache_hit_rate(self) -> float | None:
        s = self.streaming
        if s is None or s.cache_hits + s.cache_misses == 0:
            return None
        return s.cache_hits / (s.cache_hits + s.cache_misses)


def _peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, Darwin bytes.
    return peak if is_darwin() else peak * 1024


def linux_block_device_of(path: Path, sys_root: Path = Path("/sys")) -> str | None:
    """Whole-disk name (e.g. ``nvme0n1``) holding ``path``; None on overlay or unknown devices."""
    try:
        dev = os.stat(path).st_dev
    except OSError:
        return None
    link = sys_root / "dev" / "block" / f"{os.major(dev)}:{os.minor(dev)}"
    try:
        target = link.resolve(strict=True)
    except OSError:
        return None
    if (target / "partition").exists():
        target = target.parent
    return target.name


def _model_files(model_path: Path | None) -> list[Path]:
    """The files of the model at ``model_path``: its whole split set where it is one."""
    if model_path is None:
        return []
    from kimitui.errors import UserError
    from kimitui.model.gguf_map import split_set

    try:
        return split_set(Path(model_path))
    except UserError:  # not there (yet): the disk is unknown, as for any unreadable path
        return [Path(model_path)]


class DutyLimited:
    """A costly reading (the model's resident pages: a walk of the process's page tables) taken
    at most ``duty`` of the time: after a reading that took t seconds the next one comes t /
    duty later at the earliest, and calls before then get the last value. The panels and the
    bench's peak sample it often; unlimited, its cost would be the engine's stall."""

    def __init__(self, read: Callable[[], int | None], duty: float = 0.05) -> None:
        self._read = read
        self._duty = duty
        self._lock = threading.Lock()
        self._due = 0.0
        self._value: int | None = None

    def __call__(self) -> int | None:
        with self._lock:
            now = time.perf_counter()
            if now >= self._due:
                self._value = self._read()
                self._due = now + (time.perf_counter() - now) / self._duty
            return self._value


class Sampler:
    """Reads psutil and the engine's events into Snapshots at ``interval`` seconds.

    ``sample()`` may be called directly (bench) or by the background thread (``start``),
    which hands each snapshot to subscribers.
    """

    def __init__(
        self,
        metrics: EngineMetrics,
        *,
        interval: float = 0.25,
        model_path: Path | None = None,
        model_paths: Sequence[Path] | None = None,
        process: psutil.Process | None = None,
        disk_counters: Callable[[], dict] | None = None,
        device_of: Callable[[Path], str | None] | None = None,
        footprint: Callable[[], tuple[int, int] | None] | None = None,
        footprint_limit: int | None = None,
    ) -> None:
        """``model_paths``: the model's files; else ``model_path`` and the other files of its
        split set. ``device_of`` maps a file to its disk's name in ``disk_counters``.
        ``footprint``: (resident, footprint) from the OS's own call (Darwin's task_info), also
        the resident figure where psutil has none; ``footprint_limit``: jetsam's (iOS)."""
        self.metrics = metrics
        self.interval = interval
        self.paused = False
        self._process = process or psutil.Process()
        self._disk_counters = disk_counters or (lambda: psutil.disk_io_counters(perdisk=True) or {})
        self._footprint = footprint or memory.darwin_footprint
        self._footprint_limit = footprint_limit if footprint is not None else memory.jetsam_limit_bytes()
        linux = sys.platform.startswith("linux")
        # Which drive holds a file is found on Linux only (iOS shows no drive counters at all).
        self._disk_note = None if linux else "drive rate: Linux only"
        if device_of is None:
            device_of = linux_block_device_of if linux else (lambda path: None)
        self._disks: list[str] = []
        for path in model_paths or _model_files(model_path):
            disk = device_of(path)
            if disk is not None and disk not in self._disks:
                self._disks.append(disk)
        self._prev: tuple[float, int | None, dict[str, int | None]] | None = None
        self._peak_seen = 0
        self._rss_history: deque[int] = deque(maxlen=HISTORY_SAMPLES)
        self._rate_history: deque[float] = deque(maxlen=HISTORY_SAMPLES)
        self._subscribers: list[Callable[[Snapshot], None]] = []
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.errors = 0  # samples that failed (see _run)
        self.last_error: str | None = None
        self.latest: Snapshot | None = None
        self._cpu_percent()  # the first call primes psutil's CPU delta

    def _cpu_percent(self) -> float | None:
        """The process's CPU share, None where the OS refuses it (a sandboxed iOS process)."""
        try:
            return self._process.cpu_percent(None)
        except (AttributeError, NotImplementedError, OSError, psutil.Error):
            return None

    def _read_bytes(self) -> tuple[int | None, str | None]:
        """(bytes read, who counted them): the OS's count for the process where it keeps one,
        else the engine's own count of the model bytes it read (psutil has no per-process I/O
        counters on Darwin, and iOS shows none to anyone)."""
        try:
            return int(self._process.io_counters().read_bytes), "process"
        except (AttributeError, psutil.Error, NotImplementedError):
            source = self.metrics.engine_read_source
            return (source(), "engine") if source is not None else (None, None)

    def _disk_read_bytes(self) -> dict[str, int | None]:
        if not self._disks:
            return {}
        counters = self._disk_counters()
        return {d: None if counters.get(d) is None else int(counters[d].read_bytes) for d in self._disks}

    def sample(self) -> Snapshot:
        now = time.monotonic()
        darwin = self._footprint()
        try:
            rss = int(self._process.memory_info().rss)
        except (AttributeError, NotImplementedError, OSError, psutil.Error):
            if darwin is None:
                raise
            rss = darwin[0]  # psutil refused (a sandboxed iOS process): Mach's own count
        self._peak_seen = max(self._peak_seen, rss, _peak_rss_bytes() if self._process.pid == os.getpid() else 0)
        read_bytes, read_counted_by = self._read_bytes()
        disk_bytes = self._disk_read_bytes()
        proc_rate = None
        disk_rates: dict[str, float | None] = dict.fromkeys(self._disks)
        if self._prev is not None:
            t0, r0, d0 = self._prev
            dt = max(now - t0, 1e-6)
            if read_bytes is not None and r0 is not None:
                proc_rate = max(0, read_bytes - r0) / dt
            for disk, now_bytes in disk_bytes.items():
                before = d0.get(disk)
                if now_bytes is not None and before is not None:
                    disk_rates[disk] = max(0, now_bytes - before) / dt
        self._prev = (now, read_bytes, disk_bytes)
        disk_name = self._disks[0] if self._disks else None
        self._rss_history.append(rss)
        if proc_rate is not None:
            self._rate_history.append(proc_rate)
        view = self.metrics.view()
        lat = view["latencies"]
        snap = Snapshot(
            time=now,
            rss_bytes=rss,
            rss_peak_bytes=self._peak_seen,
            cpu_percent=self._cpu_percent(),
            process_read_bytes=read_bytes,
            process_read_rate=proc_rate,
            disk_name=disk_name,
            disk_read_rate=disk_rates.get(disk_name) if disk_name else None,
            budget_bytes=view["budget_bytes"],
            latencies=lat,
            p50_s=percentile(lat, 50),
            p95_s=percentile(lat, 95),
            ttft_s=view["ttft_s"],
            decode_tok_s=view["decode_tok_s"],
            tokens_total=view["tokens_total"],
            requests_total=view["requests_total"],
            prompt_tokens_total=view["prompt_tokens_total"],
            streaming=view["streaming"],
            drafts=view["drafts"],
            rss_history=list(self._rss_history),
            read_rate_history=list(self._rate_history),
            disk_rates=disk_rates,
            read_counted_by=read_counted_by,
            footprint_bytes=None if darwin is None else darwin[1],
            footprint_limit_bytes=self._footprint_limit,
            disk_note=self._disk_note if not self._disks else None,
            model_rss_bytes=self.metrics.model_resident_source() if self.metrics.model_resident_source else None,
            residency=self.metrics.residency_source() if self.metrics.residency_source else None,
            experts_resident=self.metrics.expert_residency_source() if self.metrics.expert_residency_source else None,
            experts=self.metrics.experts_source() if self.metrics.experts_source else None,
        )
        self.latest = snap
        return snap

    def subscribe(self, callback: Callable[[Snapshot], None]) -> None:
        self._subscribers.append(callback)

    def set_interval(self, seconds: float) -> None:
        self.interval = min(10.0, max(0.05, seconds))
        self._wake.set()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kimitui-sampler", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=2)

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.paused:
                # One failed sample (a /proc read racing a teardown, a subscriber's bug) must not
                # freeze every panel for the rest of the session: it is counted, and the next runs.
                try:
                    snap = self.sample()
                    for callback in list(self._subscribers):
                        callback(snap)
                except Exception as exc:  # noqa: BLE001 - the thread lives on
                    self.errors += 1
                    self.last_error = f"{type(exc).__name__}: {exc}"
            self._wake.wait(self.interval)
            self._wake.clear()
