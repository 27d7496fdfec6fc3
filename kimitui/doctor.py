"""`kimitui doctor [--model M]`: whether this machine can stream the model, one line per
prerequisite, each failure with its fix. Written for the phone (iOS hides most of these until
something dies), useful anywhere. Exit 0 when every check passes, 1 when one fails.
"""

from __future__ import annotations

import argparse
import errno
import os
import platform as host
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kimitui.engine.platform import (
    F_NOCACHE, F_RDAHEAD, address_space_fix, can_reserve, descriptor_limit, is_darwin, is_ios,
)
from kimitui.units import format_bytes, format_rate

READ_CHUNK = 8 * 2**20  # uncached reads of this size, as the engine streams shards and expert slices
READ_THREADS = 4  # the engine's default I/O threads


@dataclass
class Check:
    name: str
    ok: bool
    text: str


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kimitui.cli import add_common

    add_common(parser)
    parser.add_argument("--seconds", type=float, default=10.0, help="how long to measure the model drive's read rate (default 10)")


def check_platform() -> Check:
    machine = host.machine()
    # A jailbreak's Python says "darwin" on iOS, and its machine is the phone's model name.
    where = f"ios arm64 ({machine})" if is_ios() else f"{sys.platform} {machine}"
    text = f"{where}, {host.python_implementation()} {host.python_version()}"
    try:
        import llama_cpp
    except ImportError as exc:
        return Check("platform", False, f"{text}; llama-cpp-python does not import ({exc}): pip install llama-cpp-python")
    supported = sys.platform.startswith("linux") or is_darwin()
    if sys.version_info < (3, 10):
        return Check("platform", False, f"{text}: kimitui needs Python 3.10 or later")
    return Check(
        "platform", supported,
        f"{text}, llama-cpp-python {llama_cpp.__version__}" + ("" if supported else ": streaming is built for Linux, macOS and iOS"),
    )


def check_fast_start() -> Check:
    from kimitui.engine import loadhooks

    try:
        loadhooks.install()
    except loadhooks.HookUnavailable as exc:
        return Check("fast start", False, f"{exc}; without it llama.cpp reads the whole model at start")
    return Check("fast start", True, "libllama's mmap and posix_madvise rebound: the load reads only the file's header")


def check_address_space(
    files: list[Path], model=None, budget: int | None = None, setting="auto", working: int = 0,
    platform: str = sys.platform, reserve=None,
) -> Check:
    """Whether the process can hold the model's weights: mapped whole where the ceiling allows,
    else through windows (engine/addressing.py), whose size is checked against it. ``working``:
    llama.cpp's KV cache and buffers, beside the weights."""
    from kimitui.engine.addressing import address_bound, plan_windows
    from kimitui.engine.platform import EXTENDED_VA_ENTITLEMENT, IOS_ADDRESS_CEILING, IOS_LARGE_FILE_ENTITLEMENT, address_space_limit

    reserve = reserve or (lambda n: can_reserve(n, platform))
    total = sum(os.path.getsize(f) for f in files)
    what = f"{format_bytes(total)} for {files[0].name}" + (f" ({len(files)} files)" if len(files) > 1 else "")
    ios = is_ios(platform)
    ceiling = IOS_ADDRESS_CEILING if ios else address_space_limit()
    named = (
        f"iOS's ceiling {format_bytes(IOS_ADDRESS_CEILING)} (with {EXTENDED_VA_ENTITLEMENT}; past it only an iOS 18 kernel "
        f"and the private {IOS_LARGE_FILE_ENTITLEMENT}, which no user can sign for, so kimitui stays under it)"
        if ios else f"ulimit -v {format_bytes(ceiling)}" if ceiling is not None else "no ceiling"
    )
    bound = address_bound(setting, working, platform)
    if (bound is None or total <= bound) and reserve(total):
        return Check("address space", True, f"{what} can be mapped at once ({named})")
    if model is None or bound is None:  # no ceiling the engine knows of, yet no room: it maps whole and fails
        return Check("address space", False, f"{what} cannot be mapped at once: {address_space_fix(platform, total_bytes=total)}")
    try:
        plan = plan_windows(model, bound, budget or 0)
    except Exception as exc:  # noqa: BLE001 - EngineError: the least windows pass the bound
        return Check("address space", False, f"{what}: {exc}; {named}: {address_space_fix(platform, total_bytes=total)}")
    if not reserve(plan.total_bytes):
        return Check("address space", False, f"{what}: windows of {format_bytes(plan.total_bytes)} cannot be reserved; {address_space_fix(platform)}")
    return Check(
        "address space", True,
        f"{what} streams through windows of {format_bytes(plan.total_bytes)} ({plan.n_slots} layer slots of "
        f"{format_bytes(plan.slot_bytes)}, {format_bytes(plan.store_bytes)} for the pinned set) under {named}",
    )


def check_descriptors(files: list[Path]) -> Check:
    limit = descriptor_limit(len(files))
    soft = limit.shown(limit.soft)
    if limit.enough:
        return Check("descriptors", True, f"limit {soft}, about {limit.needed} needed (raised at start where lower)")
    return Check("descriptors", False, f"limit {soft} (hard {limit.hard}), about {limit.needed} needed: run `ulimit -n {limit.needed}` first")


def _open_uncached(path: Path, direct: bool = True) -> tuple[int, str]:
    """A descriptor whose reads skip the page cache, and how: O_DIRECT (Linux), F_NOCACHE
    (Darwin), or "" where neither is had or ``direct`` is False (reads go through the cache)."""
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, os.O_RDONLY | os.O_DIRECT), "O_DIRECT"
        except OSError:
            pass
    fd = os.open(path, os.O_RDONLY)
    if is_darwin():
        import fcntl

        try:
            fcntl.fcntl(fd, F_NOCACHE, 1)
            fcntl.fcntl(fd, F_RDAHEAD, 0)
            return fd, "F_NOCACHE"
        except OSError:
            pass
    return fd, ""


def _buffer(size: int) -> memoryview:
    """Page-aligned memory (O_DIRECT's rule), faulted in, filled with a poison byte."""
    import mmap

    buf = mmap.mmap(-1, size)
    view = memoryview(buf)
    view[:] = b"\xa5" * size
    return view


def check_direct_reads(files: list[Path]) -> Check:
    """The engine's reads skip the page cache, and they return the file's bytes: on some file
    systems a direct read reports success without filling the buffer (seen on Android's FUSE),
    so one is checked against an ordinary read of the same bytes."""
    path = max(files, key=os.path.getsize)
    size = os.path.getsize(path)
    length = min(READ_CHUNK, size // 4096 * 4096)
    offset = (size - length) // 2 // 4096 * 4096
    try:
        fd, how = _open_uncached(path)
    except OSError as exc:
        return Check("direct reads", False, f"cannot open {path.name}: {exc.strerror} (drive removed?)")
    try:
        view = _buffer(max(length, 4096))
        try:
            got = os.preadv(fd, [view[:length]], offset)
        except OSError as exc:
            if how != "O_DIRECT" or exc.errno != errno.EINVAL:
                return Check("direct reads", False, f"cannot read {path.name} at byte {offset}: {exc.strerror} (drive removed or failing?)")
            return Check("direct reads", False, f"{path.name}: the file system takes O_DIRECT at open and refuses its reads ({exc.strerror}); "
                         "the engine reads through the page cache there, one copy more: put the model on a disk's file system")
    finally:
        os.close(fd)
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            expected = f.read(length)
    except OSError as exc:
        return Check("direct reads", False, f"cannot read {path.name} at byte {offset}: {exc.strerror} (drive removed or failing?)")
    if bytes(view[:got]) != expected:
        return Check("direct reads", False, f"{path.name}: {how} reads returned wrong bytes at {offset}: move the model to another file system")
    if not how:
        return Check("direct reads", False, f"{path.name}: no O_DIRECT or F_NOCACHE on its file system; reads go through the page cache "
                     "(slower, one copy more): put the model on a disk's file system")
    return Check("direct reads", True, f"{how} on {path.name}, its bytes checked against a cached read")


def check_memory(model, budget_setting) -> tuple[Check, int]:
    from kimitui.engine.budget import budget_shortfall, minimum_budget
    from kimitui.engine.memory import default_budget, memory_sources, resolve_budget

    sources = memory_sources()
    name, room = min(sources, key=lambda s: s[1])
    budget = resolve_budget(budget_setting, room)
    shown = f"budget {'auto ' if budget_setting == 'auto' else ''}{format_bytes(budget)}"
    head = f"{format_bytes(room)} this process may take (the least of: {', '.join(f'{n} {format_bytes(v)}' for n, v in sources)})"
    if budget > room:
        return Check("memory", False, f"{head}; {shown} is more than that: lower --budget to {format_bytes(default_budget(room))}"), budget
    if budget >= model.tensor_bytes:
        return Check("memory", True, f"{head}; {shown} holds the whole model"), budget
    shortfall = budget_shortfall(model, budget)
    if shortfall:
        return Check("memory", False, f"{head}; {shortfall}"), budget
    return Check("memory", True, f"{head}; {shown} is above the working set, {format_bytes(minimum_budget(model))}"), budget


def measure_read_rate(files: list[Path], seconds: float, threads: int = READ_THREADS) -> tuple[int, float, str]:
    """(bytes, seconds, how) of uncached reads of READ_CHUNK at scattered aligned offsets over
    the model's files, from ``threads`` threads, for about ``seconds``."""
    try:
        return _timed_reads(files, seconds, threads, direct=True)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return _timed_reads(files, seconds, threads, direct=False)  # O_DIRECT taken at open, refused for reads


def _timed_reads(files: list[Path], seconds: float, threads: int, direct: bool) -> tuple[int, float, str]:
    chunks = [(i, offset) for i, f in enumerate(files) for offset in range(0, os.path.getsize(f) - READ_CHUNK + 1, READ_CHUNK)]
    if not chunks:
        chunks = [(0, 0)]
    random.Random(0).shuffle(chunks)
    opened: list[tuple[int, str]] = []
    try:
        for f in files:
            opened.append(_open_uncached(f, direct))
    except OSError:
        for fd, _ in opened:
            os.close(fd)
        raise
    if not any(how for _, how in opened):
        for fd, _ in opened:  # through the cache: start cold
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    deadline = time.perf_counter() + seconds
    lock, total, cursor = threading.Lock(), [0], iter(chunks)

    def worker() -> None:
        view = _buffer(READ_CHUNK)  # a buffer per thread
        while time.perf_counter() < deadline:
            with lock:
                chunk = next(cursor, None)
            if chunk is None:
                return
            got = os.preadv(opened[chunk[0]][0], [view], chunk[1])
            with lock:
                total[0] += got

    started = time.perf_counter()
    try:
        with ThreadPoolExecutor(threads) as pool:
            for future in [pool.submit(worker) for _ in range(threads)]:
                future.result()
    finally:
        for fd, _ in opened:
            os.close(fd)
    return total[0], time.perf_counter() - started, next((how for _, how in opened if how), "through the page cache")


def _sparse(files: list[Path]) -> bool:
    return sum(os.stat(f).st_blocks * 512 for f in files) < 0.5 * sum(os.path.getsize(f) for f in files)


def check_drive(files: list[Path], model, budget: int | None, seconds: float) -> Check:
    """``budget``: None where the memory check refused it (no floor is shown for it)."""
    from kimitui.engine.budget import plan_memory, plan_reads
    from kimitui.engine.settings import StreamSettings

    try:
        got, elapsed, how = measure_read_rate(files, seconds)
    except OSError as exc:
        return Check("drive", False, f"cannot read {files[0].name}: {exc.strerror or exc} (drive removed or failing?)")
    rate = got / elapsed if elapsed > 0 else 0.0
    text = f"{format_rate(rate)} over {elapsed:.1f} s ({format_bytes(got)} in {READ_CHUNK // 2**20} MiB reads, {how})"
    if _sparse(files):
        text += "; the files are mostly holes, so this is not the drive's rate"
    if budget is None:
        return Check("drive", got > 0, f"{text}; no tok/s floor: the budget is refused above")
    if budget >= model.tensor_bytes:
        return Check("drive", got > 0, f"{text}; the whole model fits the budget: no reads per token")
    plan = plan_memory(model, budget, StreamSettings().prefetch_depth, 512)
    reads = plan_reads(model, plan)
    per_token = reads["trunk_bytes_per_token"] + reads["expert_bytes_per_token"]
    floor = f"{rate / per_token:.3g} tok/s" if per_token else "compute-bound"
    return Check("drive", got > 0, f"{text}; at {format_bytes(budget)} a token reads {format_bytes(per_token)}: at most {floor}")


def _report(check: Check) -> Check:
    print(f"{check.name:<14} {'ok  ' if check.ok else 'FAIL'}  {check.text}", flush=True)
    return check


def run(args: argparse.Namespace) -> int:
    from kimitui.cli import resolve_model, resolve_settings
    from kimitui.model.gguf_map import load_model_map, split_set

    settings = resolve_settings(args)
    checks = [_report(check_platform())]  # before the model: a missing llama-cpp-python says so first
    model_path = resolve_model(settings)
    files = split_set(model_path)
    model = load_model_map(model_path, shard_size=settings["engine.shard_size"])
    checks.append(_report(check_fast_start()))
    memory, budget = check_memory(model, settings["engine.budget"])
    from kimitui.engine.budget import working_estimate

    working = working_estimate(model, settings["model.n_ctx"], settings["model.n_batch"], settings["server.slots"])
    checks.append(_report(check_address_space(files, model, budget, settings["engine.address_space"], working)))
    for step in (check_descriptors, check_direct_reads):
        checks.append(_report(step(files)))
    checks.append(_report(memory))
    checks.append(_report(check_drive(files, model, budget if memory.ok else None, args.seconds)))
    return 0 if all(c.ok for c in checks) else 1
