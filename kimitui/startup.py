"""Start-up runs without Python's cyclic garbage collector.

Importing Textual, llama-cpp-python and numpy creates hundreds of thousands of objects, and
the collector walked them over and over on the way: with it off, those imports took 0.32 s
instead of 0.38-0.47 s on this machine. Nothing made during start-up is garbage in cycles
worth reclaiming early, so the app turns the collector back on when it is mounted: by then the
imports are done and llama.cpp's load runs in C."""

from __future__ import annotations

import gc


def start_up_begins() -> None:
    gc.disable()


def start_up_finished() -> None:
    gc.enable()
