"""Helpers the test modules share (pytest puts tests/ on sys.path for its conftest)."""

from __future__ import annotations

import time
from pathlib import Path


def wait_for(condition, what: str, timeout: float = 180.0) -> None:
    """Poll ``condition`` from a test thread until it holds, or fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def takes_direct_reads(path: Path) -> bool:
    """Whether direct placement must work for ``path``: a kernel with MREMAP_DONTUNMAP and a
    file system that serves O_DIRECT reads (CI's may not). Probed apart from the placer, so
    that a broken placer fails the tests instead of skipping them."""
    import mmap
    import os
    import re

    # MREMAP_DONTUNMAP came with Linux 5.7: before it the engine reads through the page cache.
    version = re.match(r"(\d+)\.(\d+)", os.uname().release)
    if version is None or tuple(map(int, version.groups())) < (5, 7):
        return False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return False
    try:
        os.preadv(fd, [mmap.mmap(-1, mmap.PAGESIZE)], 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def stock_llama(path: Path, **kwargs):
    """Plain llama-cpp-python, with llama.cpp's weight repacking off as the engine has it (and as
    a fair baseline must): a natively built llama.cpp on a VM whose CPU reports AMX but cannot
    run it dies of SIGILL on the repack path (this CI host), and repacked weights do not stream."""
    import llama_cpp

    from kimitui.engine.session import _llama_params

    with _llama_params(None, repack=False):
        return llama_cpp.Llama(model_path=str(path), verbose=False, **kwargs)
