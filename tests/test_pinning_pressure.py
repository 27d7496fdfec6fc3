"""The pinned set stays resident under memory-cgroup pressure while the rest streams.

Checked, not assumed: a child process moves itself into a memory cgroup barely larger than its
budget, streams a model several times that size, and then asks the kernel (mincore) which
pages of the pinned ranges are still in memory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kimitui.benchmarks.common import drop_from_page_cache
from kimitui.model import synth

MIB = 2**20
JUNK = 512 * MIB  # read through the page cache after the reply: more than the cgroup holds
CGROUP_V1 = Path("/sys/fs/cgroup/memory")

CHILD = r"""
import ctypes, json, os, sys
from pathlib import Path
with open(sys.argv[3], "w") as fh:
    fh.write(str(os.getpid()))  # into the cgroup before anything is allocated
from kimitui.engine.generation import Sampling
from kimitui.engine.session import Engine
engine = Engine(Path(sys.argv[1]), n_ctx=256, budget=int(sys.argv[2]))
engine.load(); engine.pin()
gen = engine.complete("Once upon a time", Sampling(temperature=0.0, max_tokens=10))
list(gen)
# More pressure: read a file larger than the cgroup through the page cache, so the kernel must
# reclaim while the pinned set sits there.
from kimitui.benchmarks.common import cached_bytes
with open(sys.argv[4], "rb", buffering=0) as junk:
    while junk.read(1 << 20):
        pass
junk_cached = cached_bytes(sys.argv[4])
libc = ctypes.CDLL("libc.so.6", use_errno=True)
page = os.sysconf("SC_PAGE_SIZE")
resident = total = 0
for r in engine.pinned.ranges:
    start = (engine.mapping.address + r.offset) & ~(page - 1)
    length = engine.mapping.address + r.offset + r.length - start
    pages = (length + page - 1) // page
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) == 0
    resident += sum(b & 1 for b in vec); total += pages
print(json.dumps({"resident": resident, "total": total, "note": engine.pinned.note, "junk_cached": junk_cached,
                  "streamed": engine.streamer.bytes_read, "tokens": gen.result.completion_tokens}))
"""


@pytest.mark.skipif(os.geteuid() != 0 or not (CGROUP_V1 / "memory.limit_in_bytes").exists(), reason="needs root and the cgroup v1 memory controller")
def test_pinned_set_survives_cgroup_pressure(tmp_path):
    model = synth.write_model(synth.plan_dense(240 * MIB, "q4_1", synth.default_tokenizer()), tmp_path / "m.gguf", seed=2, progress=False).paths[0]
    budget = 160 * MIB  # non-layer tensors (~41 MiB) plus working memory and the window must fit
    group = CGROUP_V1 / f"kimitui-test-{os.getpid()}"
    group.mkdir()
    try:
        # Budget plus the interpreter's own memory: the file pages that stream must be reclaimed.
        (group / "memory.limit_in_bytes").write_text(str(budget + 200 * MIB))
        junk = tmp_path / "junk.bin"
        with junk.open("wb") as fh:
            for _ in range(JUNK // MIB):
                fh.write(os.urandom(MIB))
        drop_from_page_cache(junk)
        out = subprocess.run(
            [sys.executable, "-c", CHILD, str(model), str(budget), str(group / "cgroup.procs"), str(junk)],
            capture_output=True, text=True, timeout=300,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        result = json.loads(out.stdout.strip().splitlines()[-1])
        assert result["tokens"] == 10 and result["streamed"] > 0
        assert result["note"] is None, result["note"]  # the pinned set was locked
        assert result["total"] > 0 and result["resident"] == result["total"]
        peak = int((group / "memory.max_usage_in_bytes").read_text())
        assert peak <= budget + 200 * MIB
        # The pressure was real: the cgroup hit its limit and the kernel reclaimed page cache
        # (much of the junk file is gone again: it never fit) while every pinned page stayed.
        assert int((group / "memory.failcnt").read_text()) > 0
        assert result["junk_cached"] < 0.75 * JUNK
    finally:
        group.rmdir()
