#!/usr/bin/env python3
"""llama-server's command line, translated to `kimitui serve`: the launcher for running
llama.cpp's own server test suite (tools/server/tests) against kimitui (README, "llama.cpp's
server tests"). Point the suite at it with LLAMA_SERVER_BIN_PATH=tests/llama_server_shim.py.
Flags kimitui has are passed on; the others (model downloads, slots, GPU layers...) are
dropped, so the default model answers."""

import os
import shutil
import sys

VALUE_FLAGS = {
    "--host": "--host", "--port": "--port", "--ctx-size": "--n-ctx", "-c": "--n-ctx", "--threads": "--threads",
    "-t": "--threads", "--api-key": "--api-key", "--n-predict": "--max-n-predict", "-n": "--max-n-predict",
    "--alias": "--alias", "--cors-origins": "--cors-origins", "--chat-template-file": "--chat-template-file",
    "--seed": "--seed", "-s": "--seed", "--chat-template": "--chat-template", "--batch-size": "--batch-size",
    "-b": "--batch-size", "--tags": "--tags", "--parallel": "--parallel", "-np": "--parallel",
    "--slot-save-path": "--slot-save-path",
}
SWITCHES = {"--verbose", "--no-slots", "--context-shift", "--no-context-shift"}


def translate(args: list[str]) -> list[str]:
    out, i = ["serve"], 0
    while i < len(args):
        flag = args[i]
        has_value = i + 1 < len(args) and not args[i + 1].startswith("-")
        if flag in ("--n-predict", "-n") and i + 1 < len(args) and args[i + 1] == "-1":
            i += 2  # llama-server's "no limit": kimitui's configured cap
        elif flag in SWITCHES:
            out.append(flag)
            i += 1
        elif flag in VALUE_FLAGS and i + 1 < len(args):
            out += [VALUE_FLAGS[flag], args[i + 1]]
            i += 2
        else:
            i += 2 if flag.startswith("-") and has_value else 1
    return out


if __name__ == "__main__":
    kimitui = shutil.which("kimitui") or os.path.join(os.path.dirname(sys.executable), "kimitui")
    os.execv(kimitui, ["kimitui", *translate(sys.argv[1:])])
