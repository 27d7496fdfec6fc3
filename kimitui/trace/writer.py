"""TraceWriter: the engine's Tracer, writing JSON Lines.

Record types (every record has ``type``; times are seconds):

- ``session``: first record of every file: format version, session id, part number.
- ``request``: id, model, wall-clock start ``t``, the engine's tuning (budget, shard size,
  prefetch depth, policy, pinned bytes, streaming) and ``idle``: storage counters that moved
  while no request ran (read-ahead of the previous request landing after its end).
- ``token``: request, index, ``t`` (since the request started), wall, compute (time inside llama_decode less the stall),
  stall, and the storage counters' change over the token: bytes read from storage and found in
  cache, hits, misses, prefetch issued/used/wasted.
- ``read``: one storage read: shard (or expert: its gate, up and down slices together, with
  the first slice's file and offset, their bytes added up and the span from the first start to
  the last end; or neither: a piece of a layer's routed experts read whole for a prompt) and
  layer, bytes, start (since the request that was running or last ran when
  the read began) and duration. Written at the next record of the generation thread, not when
  the read lands.
- ``route``: one router choice of a streamed MoE layer: request, layer, the experts chosen for
  the micro-batch (every token of a prefill batch together) and how many of them were resident.
  The routing a cache policy is judged on (``kimitui trace routing``).
- ``end``: finish reason, token counts, prompt/decode/queue time, ``after_s`` (from the last
  token to the end) and ``tail``: the counters' change over that stretch.
- ``close``: the writer stopped; ``idle`` since the last request ended.

Counter fields are null when the model is not streamed (the engine has no counters then),
never a made-up 0.

How the numbers add up: the counters are cumulative, and the writer cuts them into
consecutive stretches at its snapshots: request start, each token, request end, close. Every
stretch belongs to exactly one record (``idle`` of a request, a token, ``tail`` of an end,
``idle`` of close), so their sum is exactly the change of the engine's counters from the
first snapshot to the last. A byte counts where its read completed: read-ahead issued while
token i computes and landing after token i's snapshot counts in token i+1, or in the tail or
the next idle stretch when no further token comes. Read records cover the same reads one by
one, so their bytes add up to the same total once no read is in flight.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

FORMAT_VERSION = 3  # 2: compute measured in llama_decode; expert reads one record per expert; 3: route records
COUNTERS = (
    "bytes_read", "bytes_from_cache", "hits", "misses", "stall_s",
    "prefetch_issued", "prefetch_used", "prefetch_wasted",
)
MAX_BYTES = 64 * 2**20
KEEP = 4
FLUSH_BYTES = 256 * 2**10  # buffered between flushes; every request end flushes too

Listener = Callable[[dict], None]


def delta(before: dict | None, after: dict | None) -> dict | None:
    if before is None or after is None:
        return None
    out = {k: after[k] - before[k] for k in COUNTERS}
    out["stall_s"] = round(out["stall_s"], 6)
    return out


def _json(value) -> str:
    """An int, None, or an already-encoded JSON string, as JSON text."""
    return "null" if value is None else str(value)


def rotated_path(path: Path, n: int) -> Path:
    """trace.jsonl -> trace.1.jsonl (n = 1 is the most recent older file)."""
    return path.with_name(f"{path.stem}.{n}{path.suffix}")


@dataclass
class _Request:
    id: str
    id_json: str  # the id as a JSON string, for read records
    start: float  # perf_counter at request_started
    record: dict
    mark: dict | None  # counters at the end of the last stretch this request accounted
    last_token: float


class TraceWriter:
    """Thread-safe; the engine calls it from its generation thread and its I/O threads.

    ``attach(engine)`` hooks it to an engine (which then calls it) and lets it snapshot the
    engine's counters at request end and close, so that nothing read goes unaccounted.
    ``subscribe(listener)`` hands every record, as written, to ``listener``.
    """

    def __init__(self, path: Path | str, *, max_bytes: int = MAX_BYTES, keep: int = KEEP) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.keep = keep
        self.session = uuid.uuid4().hex[:12]
        self._lock = threading.Lock()
        self._listeners: list[Listener] = []
        self._buffer: list[str] = []
        self._buffered = 0
        self._size = 0
        self._part = 0
        self._engine = None
        self._mark: tuple[object, dict] | None = None  # (streamer, counters) at the last accounted point
        self._requests: dict[str, _Request] = {}
        self._recent: list[_Request] = []  # newest last: reads are attributed by their start time
        # Reads as the I/O threads report them, written out at the next record of the generation
        # thread: an append is all an I/O thread pays, so a read's future completes at once
        # (a Kimi-shaped token has hundreds of expert reads; a record each, written on the spot,
        # cost 7% of decode).
        self._reads: deque[tuple] = deque()
        self._routes: deque[tuple] = deque()  # (layer, experts, hits), from the compute thread
        self._closed = False
        self._rotating = False
        self.error: str | None = None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Each run starts its own file; the previous run's becomes trace.1.jsonl.
        if self.path.exists() and self.path.stat().st_size > 0:
            self._shift()
        self._file = open(self.path, "w", encoding="ascii", newline="\n")
        self._start_part()

    # -- wiring --------------------------------------------------------------------------

    def attach(self, engine) -> None:
        """Trace ``engine``: it calls this writer from now on (until ``close``)."""
        with self._lock:
            self._engine = engine
            self._mark = self._snapshot()
        engine.set_tracer(self)

    def subscribe(self, listener: Listener) -> None:
        """``listener(record)`` runs on the writing thread with the writer's lock held, in file
        order, for every record from now until ``close``: it must only hand the record on (a
        deque append), never wait for a UI."""
        with self._lock:
            self._listeners.append(listener)

    def _snapshot(self) -> tuple[object, dict] | None:
        streamer = None if self._engine is None else self._engine.streamer
        return None if streamer is None else (streamer, streamer.counters())

    def _since_mark(self, now: tuple[object, dict] | None) -> dict | None:
        # A new streamer (the pinned set was re-read) starts its counters at zero: no stretch.
        if now is None or self._mark is None or self._mark[0] is not now[0]:
            return None
        return delta(self._mark[1], now[1])

    # -- the Tracer protocol ---------------------------------------------------------------

    def request_started(self, request_id: str, model: str, settings: dict) -> None:
        with self._lock:
            if self._closed:
                return
            self._write_reads()
            now = self._snapshot()
            record = {
                "type": "request", "id": request_id, "t": round(time.time(), 6), "model": model,
                "settings": dict(settings), "idle": self._since_mark(now),
            }
            if now is not None:
                self._mark = now
            start = time.perf_counter()
            request = _Request(request_id, json.dumps(request_id), start, record, None if now is None else now[1], start)
            self._requests[request_id] = request
            self._recent = self._recent[-1:] + [request]
            self._emit(record)

    def token(
        self, request_id: str, index: int, wall_s: float, before: dict | None, after: dict | None, decode_s: float
    ) -> None:
        """``decode_s``: the token's time inside llama_decode; its compute is that less the stall."""
        with self._lock:
            request = self._requests.get(request_id)
            if self._closed or request is None:
                return
            self._write_reads()
            now = time.perf_counter()
            # Token 0 starts where request_started's snapshot ended, so nothing that landed
            # between the engine's first snapshot and that one is counted twice.
            d = delta(request.mark if request.mark is not None else before, after)
            request.mark = after
            request.last_token = now
            stall = 0.0 if d is None else d["stall_s"]
            record = {
                "type": "token", "req": request_id, "i": index, "t": round(now - request.start, 6),
                "wall_s": round(wall_s, 6),
                "compute_s": round(max(0.0, decode_s - stall), 6),
            }
            for key in COUNTERS:
                record[key] = None if d is None else d[key]
            self._emit(record)

    def read(self, unit, offset: int, length: int, start: float, seconds: float) -> None:
        self._reads.append((unit, offset, length, start, seconds))  # atomic: no lock, no JSON here

    def route(self, layer: int, experts: list[int], hits: int) -> None:
        self._routes.append((layer, experts, hits))  # written with the reads, at the next record

    def _write_reads(self) -> None:
        """The reads reported so far, as records (lock held), before the record that called.
        Hundreds per token on a MoE model: each line is formatted directly, not via json."""
        reads, recent = self._reads, self._recent
        lines, records = [], []
        routes = self._routes
        current = recent[-1] if recent else None  # routing happens inside the request computing
        while routes:
            layer, experts, hits = routes.popleft()
            lines.append(
                f'{{"type":"route","req":{_json(current and current.id_json)},"layer":{layer},'
                f'"experts":[{",".join(map(str, experts))}],"hits":{hits}}}\n'
            )
            if self._listeners:
                records.append({"type": "route", "req": current and current.id, "layer": layer, "experts": experts, "hits": hits})
        while reads:
            unit, offset, length, start, seconds = reads.popleft()
            # The request that was running (or last ran) when the read began issued it.
            owner = next((r for r in reversed(recent) if r.start <= start), recent[0] if recent else None)
            expert = getattr(unit, "expert", None)
            shard = unit.index if expert is None else None
            start_s = round(start - (start if owner is None else owner.start), 6)
            lines.append(
                f'{{"type":"read","req":{_json(owner and owner.id_json)},"shard":{_json(shard)},'
                f'"expert":{_json(expert)},"layer":{_json(unit.layer)},"file":{unit.file},"offset":{offset},'
                f'"bytes":{length},"start_s":{start_s!r},"dur_s":{round(seconds, 6)!r}}}\n'
            )
            if self._listeners:
                records.append({
                    "type": "read", "req": owner and owner.id, "shard": shard, "expert": expert, "layer": unit.layer,
                    "file": unit.file, "offset": offset, "bytes": length, "start_s": start_s, "dur_s": round(seconds, 6),
                })
        if not lines:
            return
        if self._listeners or self._size + sum(map(len, lines)) >= self.max_bytes:
            for i, line in enumerate(lines):  # one by one: listeners see each record, rotation cuts between them
                self._emit(records[i] if records else None, line)
            return
        size = sum(map(len, lines))
        self._buffer.extend(lines)
        self._buffered += size
        self._size += size
        if self._buffered >= FLUSH_BYTES:
            self._flush()

    def request_finished(self, request_id: str, result) -> None:
        with self._lock:
            if self._closed or request_id not in self._requests:
                return
            self._write_reads()  # while the request still owns what it read
            request = self._requests.pop(request_id)
            end = time.perf_counter()
            now = self._snapshot()
            tail = None
            if now is not None and request.mark is not None:
                tail = delta(request.mark, now[1])
                self._mark = now
            self._emit({
                "type": "end", "req": request_id, "t": round(end - request.start, 6),
                "finish": result.finish_reason, "error": result.error,
                "prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
                "prompt_s": round(result.prompt_s, 6), "decode_s": round(result.decode_s, 6),
                "queued_s": round(result.queued_s, 6), "after_s": round(end - request.last_token, 6),
                "tail": tail,
                # Speculative decoding: decode passes, drafts checked and drafts kept (None: it did not draft).
                **{key: None if result.speculation is None else getattr(result.speculation, key)
                   for key in ("passes", "drafted", "accepted")},
            })
            self._flush()

    # -- output ----------------------------------------------------------------------------

    def _emit(self, record: dict | None, line: str | None = None) -> None:
        """Write ``record`` (or its ready ``line``; record None when no listener wants it)."""
        if line is None:
            line = json.dumps(record, separators=(",", ":"), default=str) + "\n"
        self._buffer.append(line)
        self._buffered += len(line)
        self._size += len(line)
        for listener in self._listeners:
            listener(record)
        if self._buffered >= FLUSH_BYTES:
            self._flush()
        if self._size >= self.max_bytes and not self._rotating:
            self._rotate()

    def _flush(self) -> None:
        if self._buffer and self.error is None:
            try:
                self._file.write("".join(self._buffer))
                self._file.flush()
            except OSError as exc:
                self._fail(exc)
        self._buffer.clear()
        self._buffered = 0

    def _fail(self, exc: OSError) -> None:
        """A full or vanished log drive stops the trace, never the reply: the app shows ``error``."""
        if self.error is None:
            self.error = f"trace stopped: cannot write {self.path}: {exc.strerror or exc}"

    def _start_part(self) -> None:
        self._size = 0
        self._emit({
            "type": "session", "v": FORMAT_VERSION, "session": self.session, "part": self._part,
            "t": round(time.time(), 6), "pid": os.getpid(),
        })

    def _shift(self) -> None:
        """trace.jsonl -> trace.1.jsonl -> trace.2.jsonl ...; the one past ``keep`` goes."""
        if self.keep == 0:
            self.path.unlink()
            return
        oldest = rotated_path(self.path, self.keep)
        if oldest.exists():
            oldest.unlink()
        for n in range(self.keep - 1, 0, -1):
            older = rotated_path(self.path, n)
            if older.exists():
                older.rename(rotated_path(self.path, n + 1))
        self.path.rename(rotated_path(self.path, 1))

    def _rotate(self) -> None:
        self._flush()
        if self.error is not None:
            return
        try:
            self._file.close()
            self._shift()
            self._file = open(self.path, "w", encoding="ascii", newline="\n")
        except OSError as exc:
            self._fail(exc)
            return
        self._part += 1
        # The new file's header never rotates it again, however small max_bytes is.
        self._rotating = True
        self._start_part()
        # Requests in progress start over in the new file, so every file reads on its own.
        for request in self._requests.values():
            self._emit({**request.record, "idle": None, "continued": True})
        self._rotating = False

    def flush(self) -> None:
        with self._lock:
            if not self._closed:
                self._write_reads()
                self._flush()

    def close(self) -> None:
        """Detach from the engine, record what moved since the last request, close the file."""
        engine = self._engine
        if engine is not None and engine.tracer is self:
            engine.set_tracer(None)
        with self._lock:
            if self._closed:
                return
            self._write_reads()
            now = self._snapshot()
            self._emit({"type": "close", "t": round(time.time(), 6), "idle": self._since_mark(now)})
            self._closed = True
            self._flush()
            try:
                self._file.close()
            except OSError as exc:  # what a failed flush left in the file's own buffer
                self._fail(exc)
            self._listeners.clear()
