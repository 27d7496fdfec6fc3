"""Conversation states on disk: llama.cpp's state of a conversation's sequence (KV cells and,
for Kimi K3, the KDA recurrent state), kept beside the history so that reopening the
conversation, after a restart too, restores it instead of evaluating its tokens again.

A file is written whole under a temporary name and renamed, so a reader sees the old file or
the new one, never half of one. It says what it belongs to (the model's identity, the context's
size and how it caches keys and values) and carries a checksum of its body; a file that is
damaged, cut short, or made for another model or context is refused with a line that says which
and why, and the tokens are evaluated as if there were none. Beyond the quota, the least
recently used files go first.

File layout: MAGIC, one line of JSON (the header), then the tokens (int32, little-endian) and
llama.cpp's sequence state, the two covered by the header's CRC-32.
"""

from __future__ import annotations

import array
import hashlib
import json
import os
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

from kimitui.engine.kv_cache import PLAIN

MAGIC = b"kimitui-state 1\n"
HEADER_LIMIT = 1 << 16  # a header line longer than this is not one of ours
STALE_TEMP_S = 3600.0  # a temporary file this old is a write that was killed (jetsam, SIGKILL)
IDENTITY_READ = 1 << 20  # bytes of each model file hashed into its identity (the GGUF header and tensor index)
CHUNK = 8 << 20


class StateRefused(Exception):
    """A saved state that cannot be used; the message is the one line the user sees.
    ``damaged``: the file is no good to anyone (not one made for another model or context)."""

    def __init__(self, message: str, damaged: bool = True) -> None:
        super().__init__(message)
        self.damaged = damaged


@dataclass(frozen=True)
class SavedState:
    tokens: list[int]
    state: bytearray  # llama.cpp's sequence state for ``tokens``
    saved_at: float


def model_identity(files: list[Path]) -> str:
    """What a state belongs to: each file's name, size and the hash of its first MiB (where the
    GGUF header, its keys and tensor index live). Another model, or the same one rewritten
    with other types or shapes, gives another identity; reading it costs a MiB per file."""
    digest = hashlib.sha256()
    for path in files:
        digest.update(f"{path.name}\0{path.stat().st_size}\0".encode())
        with open(path, "rb") as f:
            digest.update(f.read(IDENTITY_READ))
    return digest.hexdigest()[:32]


def _crc(*parts: bytes | bytearray | memoryview) -> int:
    crc = 0
    for part in parts:
        view = memoryview(part)
        for start in range(0, len(view), CHUNK):
            crc = zlib.crc32(view[start : start + CHUNK], crc)
    return crc


class SavedStates:
    """The directory of conversation states, ``<key>.state`` each, within ``quota`` bytes
    (0: none kept; None: no limit, and ``key`` is the file's whole name, as a saved slot's is)."""

    def __init__(self, directory: Path, quota: int | None, identity: str, n_ctx: int, model_name: str,
                 cache: str = PLAIN.name) -> None:
        self.directory = Path(directory)
        self.cache = cache  # how the context caches keys and values (kv_cache.KVCache.name)
        self.quota = quota
        self.identity = identity
        self.n_ctx = n_ctx
        self.model_name = model_name

    def path(self, key: str) -> Path:
        return self.directory / (key if self.quota is None else f"{key}.state")

    # -- reading -----------------------------------------------------------------------

    def _header(self, f, path: Path) -> dict:
        if f.read(len(MAGIC)) != MAGIC:
            raise StateRefused(f"{path}: not a kimitui state file")
        line = f.readline(HEADER_LIMIT)
        try:
            header = json.loads(line)
            numbers = [header[k] for k in ("n_tokens", "state_bytes", "crc32", "n_ctx")]
            if not isinstance(header["model"], str) or not all(type(n) is int and n >= 0 for n in numbers):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            raise StateRefused(f"{path}: its header is damaged") from None
        size = os.fstat(f.fileno()).st_size
        if header["state_bytes"] + 4 * header["n_tokens"] > size:
            raise StateRefused(f"{path}: truncated ({size} bytes, its header says more)")
        if header["model"] != self.identity:
            raise StateRefused(f"{path}: saved with another model ({header.get('model_name', '?')}), not {self.model_name}", damaged=False)
        cache = header.get("cache", PLAIN.name)  # a file from before caches were told apart: a plain context's
        if cache != self.cache:
            raise StateRefused(f"{path}: its KV cache is {cache}, this context's {self.cache} (engine.speculate)", damaged=False)
        if header["n_tokens"] > self.n_ctx:
            raise StateRefused(
                f"{path}: holds {header['n_tokens']} tokens, more than this context's {self.n_ctx}", damaged=False,
            )
        return header

    def resumes(self, key: str) -> bool:
        """Whether ``key`` has a state this model can take (its header read, not its body)."""
        try:
            with open(self.path(key), "rb") as f:
                self._header(f, self.path(key))
            return True
        except (OSError, StateRefused):
            return False

    def tokens(self, key: str) -> list[int] | None:
        """The tokens ``key``'s state covers (None: no state); StateRefused for one not ours to use."""
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                header = self._header(f, path)
                raw = f.read(4 * header["n_tokens"])
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StateRefused(f"{path}: cannot be read: {exc.strerror or exc}") from None
        if len(raw) != 4 * header["n_tokens"]:
            raise StateRefused(f"{path}: truncated ({len(raw)} of its {4 * header['n_tokens']} token bytes)")
        return _tokens_from(raw)

    def load(self, key: str) -> SavedState | None:
        """``key``'s state, checked whole (None: no state); StateRefused says why it cannot be used."""
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                header = self._header(f, path)
                raw = f.read(4 * header["n_tokens"])
                state = bytearray(header["state_bytes"])
                got = f.readinto(state)
                extra = f.read(1)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StateRefused(f"{path}: cannot be read: {exc.strerror or exc}") from None
        want = 4 * header["n_tokens"] + header["state_bytes"]
        if len(raw) + got != want:
            raise StateRefused(f"{path}: truncated ({len(raw) + got} of its {want} bytes)")
        if extra:
            raise StateRefused(f"{path}: longer than its header says (damaged)")
        if _crc(raw, state) != header["crc32"]:
            raise StateRefused(f"{path}: checksum mismatch (the file is damaged)")
        try:
            os.utime(path)  # used now: the quota removes it last
        except OSError:
            pass
        return SavedState(_tokens_from(raw), state, float(header.get("saved", 0.0)))

    def discard(self, key: str) -> None:
        try:
            self.path(key).unlink()
        except OSError:
            pass

    # -- writing -----------------------------------------------------------------------

    def save(self, key: str, tokens: list[int], state: bytes | bytearray | memoryview) -> int:
        """Write ``key``'s state atomically, then keep the directory within the quota (this file
        last to go). Returns the bytes written; OSError (a full disk, say) leaves the old file."""
        if self.quota is not None and self.quota <= 0:
            return 0
        raw = array.array("i", tokens)
        if sys.byteorder != "little":
            raw.byteswap()
        body = raw.tobytes()
        header = {
            "model": self.identity, "model_name": self.model_name, "n_ctx": self.n_ctx, "cache": self.cache,
            "n_tokens": len(tokens), "state_bytes": len(state), "crc32": _crc(body, state), "saved": time.time(),
        }
        head = MAGIC + json.dumps(header).encode() + b"\n"
        size = len(head) + len(body) + len(state)
        if self.quota is not None and size > self.quota:
            raise OSError(f"the state ({size} bytes) is larger than the state quota ({self.quota} bytes)")
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.path(key)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(head)
                f.write(body)
                f.write(state)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                tmp.unlink()
            except OSError:
                pass
            raise
        if self.quota is not None:
            self._within_quota(keep=path)
        return size

    def _within_quota(self, keep: Path) -> None:
        for tmp in self.directory.glob(".*.tmp"):
            try:
                if time.time() - tmp.stat().st_mtime > STALE_TEMP_S:
                    tmp.unlink()
            except OSError:
                pass
        files = []
        for path in self.directory.glob("*.state"):
            try:
                st = path.stat()
            except OSError:
                continue
            files.append((st.st_mtime, st.st_size, path))
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files):  # least recently used first
            if total <= self.quota:
                break
            if path == keep:
                continue
            try:
                path.unlink()
                total -= size
            except OSError:
                pass


def _tokens_from(raw: bytes) -> list[int]:
    tokens = array.array("i")
    tokens.frombytes(raw)
    if sys.byteorder != "little":
        tokens.byteswap()
    return tokens.tolist()
