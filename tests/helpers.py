"""Helpers the test modules share (pytest puts tests/ on sys.path for its conftest)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path


def count_decodes(engine) -> list[int]:
    """The tokens of each llama_decode ``engine`` makes from now on (its prompt's evaluation
    first): what a reply evaluated rather than took from the cache."""
    evaluated: list[int] = []
    real_decode = engine.llm._ctx.decode

    def decode(batch):
        evaluated.append(batch.batch.n_tokens)
        return real_decode(batch)

    engine.llm._ctx.decode = decode
    return evaluated


def wait_for(condition, what: str, timeout: float = 180.0) -> None:
    """Poll ``condition`` from a test thread until it holds, or fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


async def until(pilot, condition, timeout: float = 60.0) -> None:
    """Let a Pilot-driven app run until ``condition()`` holds; AssertionError past ``timeout``."""
    waited = 0.0
    while not condition():
        await pilot.pause(0.02)
        waited += 0.02
        if waited > timeout:
            raise AssertionError("condition not reached in time")


def peak_while(source, work):
    """The highest value ``source()`` gives, sampled every 2 ms on a thread of its own while
    ``work()`` runs; and what ``work`` returned."""
    import threading

    peak, stop = [0], threading.Event()

    def sample():
        while not stop.wait(0.002):
            peak[0] = max(peak[0], source())

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        result = work()
    finally:
        stop.set()
        sampler.join()
    return peak[0], result


def places_reads() -> bool:
    """Whether streamed and pinned bytes must be placed in anonymous memory here: Linux with
    MREMAP_DONTUNMAP (5.7 and later), on any file system. Probed apart from the placer, so that
    a broken placer fails the tests instead of skipping them."""
    import os
    import re
    import sys

    version = re.match(r"(\d+)\.(\d+)", os.uname().release)
    return sys.platform.startswith("linux") and version is not None and tuple(map(int, version.groups())) >= (5, 7)


def takes_direct_reads(path: Path) -> bool:
    """Whether placement must read ``path`` with O_DIRECT: ``places_reads`` and a file system
    that serves O_DIRECT reads (CI's may not)."""
    import mmap
    import os

    if not places_reads():
        return False
    made = not path.exists()
    if made:
        path.write_bytes(b"\0" * mmap.PAGESIZE)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            os.preadv(fd, [mmap.mmap(-1, mmap.PAGESIZE)], 0)
        finally:
            os.close(fd)
        return True
    except OSError:
        return False
    finally:
        if made:
            path.unlink()


def stock_llama(path: Path, **kwargs):
    """Plain llama-cpp-python, with llama.cpp's weight repacking off as the engine has it (and as
    a fair baseline must): a natively built llama.cpp on a VM whose CPU reports AMX but cannot
    run it dies of SIGILL on the repack path (this CI host), and repacked weights do not stream."""
    import llama_cpp

    from kimitui.engine.llama_glue import llama_params

    with llama_params(None, repack=False):
        return llama_cpp.Llama(model_path=str(path), verbose=False, **kwargs)


# Run in a child under `ulimit -v`: the engine as the app makes it, a greedy reply, and what
# the address space looked like (the peak the kernel saw, from /proc/self/status).
UNDER_LIMIT = r"""
import json, resource, sys
from kimitui.engine.generation import Sampling
from kimitui.engine.session import Engine
path, budget, prompt, n = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
engine = Engine(path, n_ctx=128, budget=budget)
engine.load()
engine.pin()
tokens = [e.token_id for e in engine.complete(prompt, Sampling(temperature=0.0, max_tokens=n)) if e.token_id >= 0]
peak = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmPeak:"))
space = engine.space
print(json.dumps({
    "tokens": tokens, "bounded": space.bounded, "slots": space.n_slots, "claims": space.claims,
    "peak": peak, "limit": resource.getrlimit(resource.RLIMIT_AS)[0], "error": engine.streamer.error,
}))
engine.close()
"""


def under_limit(path: Path, limit: int, budget: int, prompt: str, n: int) -> dict:
    proc = subprocess.run(
        ["bash", "-c", f'ulimit -v {limit // 1024} && exec "$0" -c "$1" "$2" "$3" "$4" "$5"',
         sys.executable, UNDER_LIMIT, str(path), str(budget), prompt, str(n)],
        capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def with_added_tokens(tok, n: int):
    """The default tokenizer with `n` tokens added at the end, as fine-tunes add them: the same
    text tokenizes the same, the vocabulary is larger."""
    from dataclasses import replace

    added = [f"<added_{i}>" for i in range(n)]
    fields = []
    for key, value, vtype, sub in tok.fields:
        if key == "tokenizer.ggml.tokens":
            value = list(value) + added
        elif key == "tokenizer.ggml.token_type":
            value = list(value) + [4] * n  # user-defined
        fields.append((key, value, vtype, sub))
    grown = sum(8 + len(a.encode()) + 4 for a in added)  # each string's length and bytes, each type
    return replace(tok, fields=tuple(fields), n_vocab=tok.n_vocab + n, encoded_bytes=tok.encoded_bytes + grown)
