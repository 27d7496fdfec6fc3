"""What the benchmark commands share: a cold page cache, measured child processes, output.

Every measured phase runs in a child process of its own, so its page cache state, RSS and
I/O counters belong to that run alone; the model file is dropped from the page cache
before each child starts, and how much of it was still cached is recorded, because pages
another process keeps mapped cannot be dropped and would make a "cold" run warm.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from kimitui.benchmarks.cgroup import MemoryCgroups, RunCgroup
from kimitui.benchmarks.messages import parse
from kimitui.errors import UserError
from kimitui.model.gguf_map import split_set
from kimitui.units import format_bytes


_LOW_BIT = bytes(i & 1 for i in range(256))


def drop_from_page_cache(path: Path) -> None:
    """A cold start for the whole model: every file of a split set leaves the page cache."""
    for file in split_set(Path(path)):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cached_bytes(path: Path) -> int | None:
    """Bytes of the model ``path`` (all files of a split set) in the page cache; None where
    mincore is not reachable."""
    total = 0
    for file in split_set(Path(path)):
        cached = _cached_file_bytes(file)
        if cached is None:
            return None
        total += cached
    return total


def _cached_file_bytes(path: Path) -> int | None:
    """mincore over a mapping that is never touched."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        mincore = libc.mincore
    except (OSError, AttributeError):
        return None
    size = os.path.getsize(path)
    if size == 0:
        return 0
    page = mmap.PAGESIZE
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    finally:
        os.close(fd)
    if address in (None, ctypes.c_void_p(-1).value):
        return None
    try:
        pages = (size + page - 1) // page
        vec = (ctypes.c_ubyte * pages)()
        if mincore(address, size, vec) != 0:
            return None
        resident = bytes(vec).translate(_LOW_BIT).count(1)  # bit 0: page resident; the rest reserved
    finally:
        libc.munmap(address, size)
    return min(size, resident * page)


def _cpu_seconds() -> tuple[float, float] | None:
    """(CPU seconds the whole machine has been busy, CPU seconds of this process and its
    reaped children); None where psutil cannot read the machine's counters."""
    import resource

    import psutil

    try:
        t = psutil.cpu_times()
    except (psutil.Error, OSError):
        return None
    busy = t.user + t.system + getattr(t, "nice", 0.0) + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0) + getattr(t, "steal", 0.0)
    ours = sum(resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return busy, ours


def storage_read_bytes() -> int | None:
    """Bytes this process has caused to be read from storage; None where the OS has no
    per-process counter (Darwin)."""
    import psutil

    try:
        return int(psutil.Process().io_counters().read_bytes)
    except (AttributeError, NotImplementedError, psutil.Error):
        return None


@dataclass
class ChildRun:
    """One measured child process, as the parent saw it."""

    phase: str
    spawned_at: float  # parent perf_counter just before the child was spawned
    messages: dict[str, dict] = field(default_factory=dict)  # kind -> the child's last message of that kind
    arrived: dict[str, float] = field(default_factory=dict)  # kind -> parent perf_counter when it arrived
    returncode: int | None = None
    error: str | None = None
    cached_at_start: int | None = None  # bytes of the model still in the page cache after the drop
    cgroup_peak: int | None = None
    # Share of the machine's CPU time that other processes used while the run lasted: work
    # that competed with the run and makes its figures noisy.
    others_cpu: float | None = None

    @property
    def result(self) -> dict | None:
        return None if self.error else self.messages.get("result")

    def seconds_until(self, kind: str) -> float | None:
        at = self.arrived.get(kind)
        return None if at is None else at - self.spawned_at


def run_child(
    phase: str,
    spec: dict,
    model: Path,
    *,
    cgroups: MemoryCgroups | None = None,
    limit: int | None = None,
    stop_after: str | None = None,
    on_message: Callable[[str, dict], None] | None = None,
) -> ChildRun:
    """Drop ``model`` from the page cache, run ``python -m kimitui.benchmarks.child phase``
    (in a fresh cgroup when ``cgroups`` is given) and collect its messages. With
    ``stop_after`` the child is killed as soon as it sends that message kind: what comes
    after (the app's pinned set, teardown) is not part of the measurement. ``on_message``
    sees every message as it arrives (progress to show while the child runs)."""
    drop_from_page_cache(model)
    cgroup: RunCgroup | None = cgroups.create(limit) if cgroups is not None else None
    run = ChildRun(phase, 0.0)
    run.cached_at_start = cached_bytes(model)
    command = [sys.executable, "-m", "kimitui.benchmarks.child", phase, json.dumps(spec)]
    if cgroup is not None:
        command = cgroup.command(command)
    proc = None
    try:
        with tempfile.TemporaryFile("w+") as stderr:
            cpu_before = _cpu_seconds()
            run.spawned_at = time.perf_counter()
            proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True)
            for line in proc.stdout:
                now = time.perf_counter()
                parsed = parse(line)
                if parsed is None:
                    continue
                kind, message = parsed
                run.messages[kind], run.arrived[kind] = message, now
                if on_message is not None:
                    on_message(kind, message)
                if kind == stop_after:
                    proc.kill()
                    break
            proc.stdout.close()
            run.returncode = proc.wait()
            wall = time.perf_counter() - run.spawned_at
            cpu_after = _cpu_seconds()
            if cpu_before is not None and cpu_after is not None and wall > 0:
                # The child has been reaped, so its CPU time is in RUSAGE_CHILDREN.
                others = (cpu_after[0] - cpu_before[0]) - (cpu_after[1] - cpu_before[1])
                run.others_cpu = min(1.0, max(0.0, others / (wall * (os.cpu_count() or 1))))
            stopped = stop_after is not None and stop_after in run.messages
            if "error" in run.messages:
                run.error = run.messages["error"]["message"]
            elif cgroup is not None and cgroup.oom_kills():
                run.error = f"killed by the kernel's OOM killer at the cgroup limit of {format_bytes(limit)}"
            elif run.returncode != 0 and not stopped:
                stderr.seek(0)
                tail = [line.strip() for line in stderr.read().splitlines() if line.strip()]
                run.error = f"exited with status {run.returncode}" + (f": {tail[-1]}" if tail else "")
            elif "result" not in run.messages and not stopped:
                run.error = "ended without reporting a result"
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        if cgroup is not None:
            run.cgroup_peak = cgroup.peak_bytes()
            cgroup.remove()
    return run


NOISY_OTHERS_CPU = 0.10


def noise_note(shares: dict[str, float | None]) -> str | None:
    """One line naming the runs during which other processes used the CPU, if any did."""
    noisy = [f"{name} {share:.0%}" for name, share in shares.items() if share is not None and share > NOISY_OTHERS_CPU]
    if not noisy:
        return None
    return "other processes (kernel threads included) used this share of the CPUs during: " + ", ".join(noisy) + ": those figures are noisy, run again"


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def cell(value: float | None, fmt: str, *, scale: float = 1.0, unit: str = "") -> str:
    """A table cell: the em dash for a figure nobody measured."""
    return "—" if value is None else f"{value * scale:{fmt}}{unit}"


def table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        first, *rest = row
        lines.append("  ".join([first.ljust(widths[0])] + [c.rjust(w) for c, w in zip(rest, widths[1:])]).rstrip())
    return "\n".join(lines)


def write_json(path: Path, figures: dict) -> None:
    try:
        Path(path).write_text(json.dumps(figures, indent=2, default=str) + "\n")
    except OSError as exc:
        raise UserError(f"--json: cannot write {path} ({exc.strerror})") from None
