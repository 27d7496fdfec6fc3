"""Read trace files back, checking every record: a bad line is one error naming file and line."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kimitui.errors import UserError
from kimitui.trace.writer import COUNTERS, FORMAT_VERSION


class TraceFormatError(UserError):
    pass


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _counters_ok(v) -> bool:
    return isinstance(v, dict) and all(_is_num(v.get(k)) for k in COUNTERS)


def _or_null(check):
    return lambda v: v is None or check(v)


NUM = ("a number", _is_num)
INT = ("an integer", _is_int)
STR = ("a string", lambda v: isinstance(v, str))
NUM_OR_NULL = ("a number or null", _or_null(_is_num))
INT_OR_NULL = ("an integer or null", _or_null(_is_int))
STR_OR_NULL = ("a string or null", _or_null(lambda v: isinstance(v, str)))
COUNTERS_OR_NULL = (f"null or an object of {', '.join(COUNTERS)}", _or_null(_counters_ok))

FIELDS: dict[str, dict[str, tuple]] = {
    "session": {"v": INT, "session": STR, "part": INT, "t": NUM},
    "request": {"id": STR, "t": NUM, "model": STR, "settings": ("an object", lambda v: isinstance(v, dict)), "idle": COUNTERS_OR_NULL},
    "token": {"req": STR, "i": INT, "t": NUM, "wall_s": NUM, "compute_s": NUM_OR_NULL, **{k: NUM_OR_NULL for k in COUNTERS}},
    "read": {
        "req": STR_OR_NULL, "shard": INT_OR_NULL, "expert": INT_OR_NULL, "layer": INT_OR_NULL, "file": INT,
        "offset": INT, "bytes": INT, "start_s": NUM, "dur_s": NUM,
    },
    "route": {
        "req": STR_OR_NULL, "layer": INT, "hits": INT,
        "experts": ("a list of integers", lambda v: isinstance(v, list) and all(_is_int(x) for x in v)),
    },
    "end": {
        "req": STR, "t": NUM, "finish": STR, "error": STR_OR_NULL, "prompt_tokens": INT, "completion_tokens": INT,
        "prompt_s": NUM, "decode_s": NUM, "queued_s": NUM, "after_s": NUM, "tail": COUNTERS_OR_NULL,
    },
    "close": {"t": NUM, "idle": COUNTERS_OR_NULL},
}


@dataclass
class RequestTrace:
    session: str
    id: str
    model: str
    t: float  # wall-clock start
    settings: dict
    idle: dict | None  # counters that moved between the previous request and this one
    tokens: list[dict] = field(default_factory=list)
    reads: list[dict] = field(default_factory=list)
    routes: list[dict] = field(default_factory=list)  # router choices in order (route records)
    end: dict | None = None


@dataclass
class Trace:
    paths: list[Path]
    requests: list[RequestTrace]  # by start time
    stray_reads: list[dict]  # reads of requests whose records are in files not given
    idle: list[dict]  # every non-null idle stretch: of requests and of close records


def _check(path: Path, number: int, record) -> str:
    if not isinstance(record, dict) or not isinstance(record.get("type"), str):
        raise TraceFormatError(f"{path} line {number}: not a trace record (a JSON object with a \"type\")")
    kind = record["type"]
    spec = FIELDS.get(kind)
    if spec is None:
        raise TraceFormatError(f"{path} line {number}: unknown record type {kind!r} (known: {', '.join(FIELDS)})")
    for name, (what, ok) in spec.items():
        if name not in record:
            raise TraceFormatError(f"{path} line {number}: {kind} record lacks {name!r}")
        if not ok(record[name]):
            raise TraceFormatError(f"{path} line {number}: {kind} record: {name} should be {what}, got {record[name]!r}")
    return kind


def _lines(path: Path):
    """(line number, record) for each record; an unfinished last line (the writer was killed
    mid-line) is skipped with a note, any other bad line is an error."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise TraceFormatError(f"trace file not found: {path}") from None
    except OSError as exc:
        raise TraceFormatError(f"cannot read trace file {path}: {exc.strerror or exc}") from None
    lines = data.split(b"\n")
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            yield number, json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            if number == len(lines):  # no newline after it: cut off, not corrupt
                print(f"kimitui: {path} line {number}: unfinished last record skipped", file=sys.stderr)
                return
            reason = "not UTF-8 text" if isinstance(exc, UnicodeDecodeError) else f"not JSON ({exc})"
            raise TraceFormatError(f"{path} line {number}: {reason}") from None


def read_trace(paths: list[Path]) -> Trace:
    """Files in the order given (trace.2.jsonl trace.1.jsonl trace.jsonl for a rotated run)."""
    requests: dict[tuple[str, str], RequestTrace] = {}
    stray: list[dict] = []
    idle: list[dict] = []
    for path in paths:
        session = None
        count = 0
        for number, record in _lines(path):
            kind = _check(path, number, record)
            count += 1
            if session is None and kind != "session":
                raise TraceFormatError(f"{path} line {number}: not a kimitui trace: it starts with a {kind} record, not a session record")
            if kind == "session":
                if record["v"] > FORMAT_VERSION:
                    raise TraceFormatError(
                        f"{path} line {number}: trace format {record['v']} is newer than this kimitui reads ({FORMAT_VERSION})"
                    )
                session = record["session"]
            elif kind == "request":
                key = (session, record["id"])
                if key not in requests:  # a continued request is already known from the previous part
                    requests[key] = RequestTrace(session, record["id"], record["model"], record["t"], record["settings"], record["idle"])
                    if record["idle"] is not None:
                        idle.append(record["idle"])
            elif kind == "close":
                if record["idle"] is not None:
                    idle.append(record["idle"])
            elif kind == "read":
                owner = requests.get((session, record["req"]))
                (owner.reads if owner is not None else stray).append(record)
            elif kind == "route":
                owner = requests.get((session, record["req"]))
                if owner is not None:
                    owner.routes.append(record)
            else:
                owner = requests.get((session, record["req"]))
                if owner is None:
                    raise TraceFormatError(f"{path} line {number}: {kind} record of request {record['req']!r} before its request record")
                if kind == "token":
                    owner.tokens.append(record)
                else:
                    owner.end = record
        if count == 0:
            raise TraceFormatError(f"{path}: empty: no trace records")
    ordered = sorted(requests.values(), key=lambda r: r.t)
    for r in ordered:
        r.tokens.sort(key=lambda t: t["i"])  # files given out of order still read in token order
    return Trace(list(paths), ordered, stray, idle)
