"""Faults a phone user meets, injected into the real engine, API and app: each ends in one clear
line, keeps what the user had, and the next request works once the cause is gone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kimitui.model import synth

MIB = 2**20


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("faults") / "dense.gguf"
    spec = synth.plan_dense(160 * MIB, "q4_1", synth.default_tokenizer())
    return synth.write_model(spec, out, seed=5, progress=False).paths[0]


@pytest.fixture(scope="module")
def k3(tmp_path_factory) -> Path:
    """A Kimi K3 cut (4 layers, all 896 experts) of 210 MiB: trunk shards and expert slices stream."""
    spec = synth.plan_like("kimi-k3", None, 0.06, "q4_1", synth.default_tokenizer(), synth.Cut(layers=4))
    out = tmp_path_factory.mktemp("faults-k3") / "k3.gguf"
    return synth.write_model(spec, out, seed=5, progress=False).paths[0]


# The drive goes away at a moment that has nothing to do with the engine's layers (a thread cuts
# the file while tokens compute), and comes back: the same inode, whole again, as after the
# cable is plugged back in. Twice. A SIGBUS would kill this child: it runs on its own.
CUT_SCRIPT = r"""
import json, os, sys, threading, time
from pathlib import Path
from kimitui.engine.session import Engine, EngineError, Sampling
from kimitui.engine.streaming import StreamSettings
path, budget = Path(sys.argv[1]), int(sys.argv[2])
full = path.stat().st_size
with open(path, "rb") as f:
    f.seek(full // 2)
    tail = f.read()

def greedy(n=8):
    gen = engine.complete("Once upon a time", Sampling(temperature=0.0, max_tokens=n))
    list(gen)
    return gen.result.text

engine = Engine(path, n_ctx=256, budget=budget, stream_settings=StreamSettings(prefetch_depth=1))
engine.load(); engine.pin()
assert engine.streamer is not None
reference = greedy()
rounds = []
for round_ in range(2):
    started = threading.Event()
    def cut():
        started.wait()
        time.sleep(0.003 * (round_ + 1))  # somewhere inside a token, not at a layer boundary
        os.truncate(path, full // 2)
    cutter = threading.Thread(target=cut)
    cutter.start()
    gen = engine.chat([{"role": "user", "content": "Tell me a long story"}], Sampling(temperature=0.0, max_tokens=400))
    error, events = None, 0
    try:
        for event in gen:
            events += 1
            if events == 2:
                started.set()
    except EngineError as exc:
        error = str(exc)
    started.set()
    cutter.join()
    try:
        greedy(2)
        while_cut = None
    except EngineError as exc:
        while_cut = str(exc)
    with open(path, "r+b") as f:  # the drive is back: same file, whole again
        f.seek(full // 2)
        f.write(tail)
    rounds.append({"events": events, "error": error, "finish": gen.result.finish_reason, "while_cut": while_cut,
                   "after": greedy()})
print(json.dumps({"reference": reference, "rounds": rounds}))
"""


@pytest.mark.parametrize("which,budget", [("dense", 150 * MIB), ("k3", 120 * MIB)])
def test_a_drive_cut_and_restored_mid_reply_ends_that_reply_and_the_next_works(which, budget, request, tmp_path):
    source = request.getfixturevalue(which)
    victim = tmp_path / "live.gguf"
    victim.write_bytes(source.read_bytes())
    out = subprocess.run([sys.executable, "-c", CUT_SCRIPT, str(victim), str(budget)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]  # no SIGBUS (-7), no traceback
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for r in result["rounds"]:
        assert r["finish"] == "error" and r["events"] >= 2
        assert "live.gguf" in r["error"] and ("truncated" in r["error"] or "ended at byte" in r["error"]), r["error"]
        assert r["while_cut"] and "live.gguf" in r["while_cut"]
        assert r["after"] == result["reference"]  # not poisoned: the same greedy tokens as before the cut
