"""The metrics sampler reads the real process; streaming values stay None until reported."""

from __future__ import annotations

import os
import threading
import time
from collections import namedtuple

from kimitui.engine.memory import cgroup_headroom
from kimitui.engine.metrics import EngineMetrics, Sampler, percentile
from kimitui.engine.turns import TurnQueue

DiskCounters = namedtuple("DiskCounters", "read_bytes")


def test_percentile_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 95) == 95.0
    assert percentile([], 50) is None
    assert percentile([7.0], 95) == 7.0


def test_sampler_reads_rss_and_storage_reads(tmp_path):
    metrics = EngineMetrics()
    sampler = Sampler(metrics, interval=0.05)
    first = sampler.sample()
    assert first.rss_bytes > 10 * 2**20
    assert first.rss_peak_bytes >= first.rss_bytes
    assert first.process_read_rate is None  # a rate needs two samples
    # Read a file the page cache has not seen, so the kernel counts storage reads.
    path = tmp_path / "blob"
    path.write_bytes(os.urandom(8 * 2**20))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        while os.read(fd, 2**20):
            pass
    finally:
        os.close(fd)
    second = sampler.sample()
    assert second.process_read_rate is not None and second.process_read_rate >= 0
    if first.process_read_bytes is not None:
        assert second.process_read_bytes >= first.process_read_bytes
    assert second.cpu_percent is not None


def test_streaming_counters_absent_until_reported():
    metrics = EngineMetrics()
    sampler = Sampler(metrics)
    snap = sampler.sample()
    assert snap.streaming is None and snap.cache_hit_rate is None
    counts = {"cache_hits": 3, "cache_misses": 1, "prefetch_queue_depth": 2}
    metrics.attach_streamer(lambda: dict(counts))
    snap = sampler.sample()
    assert snap.streaming.cache_hits == 3 and snap.cache_hit_rate == 0.75
    assert snap.streaming.prefetch_queue_depth == 2 and snap.streaming.generation == 1
    counts["cache_hits"] = 7  # read when sampled: what the streamer counts now
    assert sampler.sample().streaming.cache_hits == 7
    metrics.attach_streamer(lambda: {"cache_hits": 0})  # a new streamer's counts: a new generation
    assert sampler.sample().streaming.generation == 2


def test_token_events_give_latency_window_and_rates():
    metrics = EngineMetrics(latency_window=4)
    metrics.request_started()
    for wall in (0.2, 0.005, 0.01, 0.02, 0.03, 0.04):
        time.sleep(0.01)
        metrics.token(wall)
    snap = Sampler(metrics).sample()
    # The window keeps the last four decode tokens; the first token's 0.2 s is the prompt (TTFT).
    assert snap.latencies == [0.01, 0.02, 0.03, 0.04]
    metrics.request_started()
    metrics.token(0.5)
    assert Sampler(metrics).sample().latencies == [0.01, 0.02, 0.03, 0.04]
    assert snap.p50_s == 0.02 and snap.p95_s == 0.04
    assert snap.ttft_s is not None and snap.ttft_s > 0
    assert snap.decode_tok_s is not None and snap.tokens_total == 6


def test_model_disk_rate_by_injection(tmp_path):
    reads = iter([1_000_000, 3_000_000])
    sampler = Sampler(
        EngineMetrics(),
        model_path=tmp_path / "model.gguf",
        disk_counters=lambda: {"nvme9n1": DiskCounters(next(reads))},
        device_of=lambda path: "nvme9n1",  # what linux_block_device_of finds for a real block device
    )
    sampler.sample()
    time.sleep(0.05)
    snap = sampler.sample()
    assert snap.disk_name == "nvme9n1"
    assert snap.disk_read_rate is not None and snap.disk_read_rate > 0


def test_split_set_over_two_drives_reports_each_drive(tmp_path):
    """The trunk's disk stays disk_name; every drive of the set gets its own rate."""
    counters = iter([{"nvme0n1": 0, "sda": 0}, {"nvme0n1": 4_000_000, "sda": 1_000_000}])
    files = [tmp_path / f"m-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    drive = {files[0]: "nvme0n1", files[1]: "sda", files[2]: "sda"}
    sampler = Sampler(
        EngineMetrics(),
        model_paths=files,
        disk_counters=lambda: {name: DiskCounters(n) for name, n in next(counters).items()},
        device_of=drive.get,
    )
    first = sampler.sample()
    assert first.disk_rates == {"nvme0n1": None, "sda": None}  # a rate needs two samples
    time.sleep(0.05)
    snap = sampler.sample()
    assert list(snap.disk_rates) == ["nvme0n1", "sda"] and snap.disk_name == "nvme0n1"
    assert snap.disk_rates["nvme0n1"] == 4 * snap.disk_rates["sda"] > 0
    assert snap.disk_read_rate == snap.disk_rates["nvme0n1"]


def test_sampler_finds_every_file_of_a_split_set(tmp_path):
    files = [tmp_path / f"m-0000{i}-of-00002.gguf" for i in (1, 2)]
    for f in files:
        f.write_bytes(b"GGUF")
    seen = []
    Sampler(EngineMetrics(), model_path=files[0], device_of=lambda path: seen.append(path))
    assert seen == files


def test_background_sampler_delivers_and_pauses():
    got = []
    sampler = Sampler(EngineMetrics(), interval=0.05)
    sampler.subscribe(got.append)
    sampler.start()
    try:
        deadline = time.time() + 5
        while len(got) < 3 and time.time() < deadline:
            time.sleep(0.02)
        assert len(got) >= 3
        sampler.paused = True
        time.sleep(0.15)
        count = len(got)
        time.sleep(0.2)
        assert len(got) == count
    finally:
        sampler.stop()


def test_cgroup_v1_limit_is_read(tmp_path):
    proc = tmp_path / "proc" / "self"
    proc.mkdir(parents=True)
    (proc / "cgroup").write_text("4:memory:/phone\n0::/\n")
    group = tmp_path / "cg" / "memory" / "phone"
    group.mkdir(parents=True)
    (group / "memory.limit_in_bytes").write_text(str(2 * 2**30))
    (group / "memory.usage_in_bytes").write_text(str(2**30))
    assert cgroup_headroom(tmp_path / "proc", tmp_path / "cg") == (2 * 2**30, 2**30)


def test_turn_queue_is_first_come_first_served():
    queue = TurnQueue()
    order = []
    first = queue.take()
    assert queue.wait(first)
    tickets = [queue.take() for _ in range(3)]
    assert [queue.position(t) for t in tickets] == [1, 2, 3]
    abandon = threading.Event()
    abandon.set()
    assert not queue.wait(tickets[1], abandon)  # a client that left gives its turn up

    def worker(ticket):
        queue.wait(ticket)
        order.append(ticket)
        queue.release(ticket)

    threads = [threading.Thread(target=worker, args=(t,)) for t in (tickets[2], tickets[0])]
    for t in threads:
        t.start()
    time.sleep(0.1)
    queue.release(first)
    for t in threads:
        t.join(5)
    assert order == [tickets[0], tickets[2]]
    assert queue.waiting == 0


def test_resident_pages_are_counted_alike_by_page_runs_and_by_each_pages_entry(monkeypatch):
    """pagemap_resident_bytes counts the present pages of a range: by PAGEMAP_SCAN's runs where
    the kernel has it, else from each page's entry; both give the pages touched, holes left out."""
    import ctypes
    import errno
    import fcntl
    import mmap
    import re

    from kimitui.engine import memory

    page = os.sysconf("SC_PAGE_SIZE")
    area = mmap.mmap(-1, 20000 * page, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    area.madvise(mmap.MADV_NOHUGEPAGE)  # one byte would make a huge page's 512 present
    try:
        # Runs of 1,000 pages, 1 page and 9,000 single pages: more than one scan's vector (1,024).
        for at in [*range(0, 1000 * page, page), *range(2000 * page, 20000 * page, 2 * page), 19999 * page]:
            area[at] = 1
        start = ctypes.addressof(ctypes.c_char.from_buffer(area))
        # Ends inside a page count that page, as the pages a tensor's bytes touch.
        ranges = [(start, start + 20000 * page), (start + 10, start + 5 * page + 1), (start + 3000 * page, start + 4000 * page)]
        expected = (1000 + 9000 + 1) * page + 6 * page + 500 * page
        scans = []
        real_ioctl = fcntl.ioctl
        monkeypatch.setattr(fcntl, "ioctl", lambda *args: scans.append(real_ioctl(*args)) or scans[-1])
        assert memory.pagemap_resident_bytes(ranges) == expected
        release = tuple(int(part) for part in re.findall(r"\d+", os.uname().release)[:2])
        assert scans or release < (6, 7), "Linux 6.7 and later answer PAGEMAP_SCAN"

        def no_scan(*_args):
            raise OSError(errno.ENOTTY, "no PAGEMAP_SCAN")

        monkeypatch.setattr(fcntl, "ioctl", no_scan)
        assert memory.pagemap_resident_bytes(ranges) == expected
    finally:
        area.close()
