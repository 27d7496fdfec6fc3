"""The placer for this OS: reads that bypass the page cache into anonymous memory at the model's
mapping, O_DIRECT and mremap on Linux (direct.py), F_NOCACHE and mach_vm_remap on Darwin
(darwin_placer.py)."""

from __future__ import annotations

import sys

from kimitui.engine.platform import is_darwin


def make_placer(paths, space, fds: dict[int, int], capacity: int, platform: str = sys.platform):
    """None elsewhere, or where this system cannot (the engine then reads through the cache).
    ``capacity`` (buffers for the trunk's pieces) may be 0: expert slices need none."""
    # Imported in its branch: the other OS's placer is never loaded.
    if platform.startswith("linux"):
        from kimitui.engine.direct import DirectPlacer

        return DirectPlacer.create([str(p) for p in paths], space, fds, capacity)
    if is_darwin(platform):
        from kimitui.engine.darwin_placer import DarwinPlacer

        return DarwinPlacer.create([str(p) for p in paths], space, fds, capacity)
    return None
