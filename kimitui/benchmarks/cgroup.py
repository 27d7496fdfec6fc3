"""Memory cgroups for benchmark runs: one fresh cgroup per measured child process.

A fresh cgroup per run makes its peak usage that run's alone (page cache included, which
is what a memory limit really squeezes) and lets every run start under the same limit.
cgroup v1 cgroups are made under this process's own memory cgroup, so any limit above it
(a container's) still applies. cgroup v2 forbids processes in a cgroup whose children get
the memory controller, so there the run cgroup goes under our own cgroup only when that
works and under the hierarchy's root otherwise. Linux only; elsewhere the caller says why.
"""

from __future__ import annotations

import errno
import os
import time
from dataclasses import dataclass
from pathlib import Path

from kimitui.errors import UserError
from kimitui.units import format_bytes, size_option


@dataclass(frozen=True)
class Hierarchy:
    version: str  # "v1" or "v2"
    mount: Path  # where the hierarchy holding the memory controller is mounted
    own: Path  # this process's cgroup in it


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as octal
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def find_hierarchy(proc_root: Path = Path("/proc")) -> Hierarchy | str:
    """The hierarchy that holds the memory controller, or why there is none."""
    try:
        mountinfo = (proc_root / "self" / "mountinfo").read_text().splitlines()
        own_lines = (proc_root / "self" / "cgroup").read_text().splitlines()
    except OSError as exc:
        return f"cannot read {exc.filename} ({exc.strerror}); memory cgroups need Linux"
    own_v1 = own_v2 = None
    for line in own_lines:
        parts = line.split(":", 2)
        if len(parts) == 3 and parts[1] == "":
            own_v2 = parts[2]
        elif len(parts) == 3 and "memory" in parts[1].split(","):
            own_v1 = parts[2]
    v2_candidate = None
    for line in mountinfo:
        head, _, tail = line.partition(" - ")
        fields, fs = head.split(), tail.split()
        if len(fields) < 5 or len(fs) < 3:
            continue
        root, mount = _unescape(fields[3]), Path(_unescape(fields[4]))
        if fs[0] == "cgroup" and "memory" in fs[2].split(",") and own_v1 is not None:
            return Hierarchy("v1", mount, mount / os.path.relpath(own_v1, root))
        if fs[0] == "cgroup2" and own_v2 is not None:
            try:
                controllers = (mount / "cgroup.controllers").read_text().split()
            except OSError:
                continue
            if "memory" in controllers:
                v2_candidate = Hierarchy("v2", mount, mount / os.path.relpath(own_v2, root))
    if v2_candidate is not None:
        return v2_candidate
    return "no memory cgroup controller is mounted (neither cgroup v1 memory nor cgroup v2 with memory)"


class RunCgroup:
    """A cgroup made for one child process; ``remove()`` when the child has exited."""

    def __init__(self, path: Path, version: str, limit: int | None) -> None:
        self.path = path
        self.version = version
        self.limit = limit

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` started inside this cgroup: a shell moves itself in, then execs it, so
        the process is in before the interpreter starts or touches the model (and, unlike
        ``preexec_fn``, this is safe in a parent that has threads)."""
        script = 'echo $$ > "$1" || exit 125; shift; exec "$@"'
        return ["/bin/sh", "-c", script, "sh", str(self.path / "cgroup.procs"), *argv]

    def _read(self, name: str) -> str | None:
        try:
            return (self.path / name).read_text()
        except OSError:
            return None

    def peak_bytes(self) -> int | None:
        """Peak memory charged to the cgroup (anonymous memory plus page cache); None where
        the kernel has no such file (cgroup v2 before Linux 5.19)."""
        text = self._read("memory.max_usage_in_bytes" if self.version == "v1" else "memory.peak")
        return int(text) if text and text.strip().isdigit() else None

    def oom_kills(self) -> int:
        text = self._read("memory.oom_control" if self.version == "v1" else "memory.events") or ""
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def remove(self) -> None:
        # The child has been reaped, but the kernel may take a moment to let its last
        # threads go: EBUSY until then.
        for attempt in range(50):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError as exc:
                if exc.errno != errno.EBUSY or attempt == 49:
                    raise UserError(f"cannot remove the benchmark cgroup {self.path} ({exc.strerror}); rmdir it by hand") from None
                time.sleep(0.1)


class MemoryCgroups:
    """Makes a RunCgroup per run in one hierarchy."""

    def __init__(self, hierarchy: Hierarchy) -> None:
        self.hierarchy = hierarchy
        self._count = 0

    @classmethod
    def require(cls, flag: str = "--cgroup-limit") -> MemoryCgroups:
        found = find_hierarchy()
        if isinstance(found, str):
            raise UserError(f"{flag}: {found}")
        return cls(found)

    @classmethod
    def from_flag(cls, value: str | None, flag: str = "--cgroup-limit") -> tuple[int | None, MemoryCgroups | None]:
        """A bench's ``--cgroup-limit``: (its bytes, the cgroups each measured child runs in),
        or (None, None) without it. UserError names the flag for a bad size or no cgroups."""
        if not value:
            return None, None
        return size_option(value, flag), cls.require(flag)

    def _parent_v2(self) -> Path:
        """A v2 cgroup whose children may have the memory controller."""
        own, mount = self.hierarchy.own, self.hierarchy.mount
        for parent in ([own] if own == mount else [own, mount]):
            control = parent / "cgroup.subtree_control"
            try:
                if "memory" not in control.read_text().split():
                    control.write_text("+memory")
                return parent
            except OSError as exc:
                # EBUSY: our own cgroup holds processes, which v2 forbids next to children
                # with controllers; the root is exempt, so try it next.
                if exc.errno not in (errno.EBUSY, errno.EACCES, errno.EPERM, errno.EOPNOTSUPP):
                    raise
                last = exc
        raise UserError(f"--cgroup-limit: cannot enable the memory controller for a child cgroup ({last.strerror})")

    def create(self, limit: int | None) -> RunCgroup:
        parent = self.hierarchy.own if self.hierarchy.version == "v1" else self._parent_v2()
        self._count += 1
        path = parent / f"kimitui-bench-{os.getpid()}-{self._count}"
        try:
            path.mkdir()
        except OSError as exc:
            why = "needs root or a delegated cgroup" if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS) else exc.strerror
            raise UserError(f"--cgroup-limit: cannot create a memory cgroup in {parent} ({why})") from None
        run = RunCgroup(path, self.hierarchy.version, limit)
        try:
            if limit is not None:
                # The limit is on memory, not memory plus swap: without the swap limit the
                # kernel could swap the run's anonymous memory out instead of reclaiming.
                if self.hierarchy.version == "v1":
                    (path / "memory.limit_in_bytes").write_text(str(limit))
                    if (path / "memory.memsw.limit_in_bytes").exists():
                        (path / "memory.memsw.limit_in_bytes").write_text(str(limit))
                else:
                    (path / "memory.max").write_text(str(limit))
                    if (path / "memory.swap.max").exists():
                        (path / "memory.swap.max").write_text("0")
        except OSError as exc:
            run.remove()
            raise UserError(f"--cgroup-limit: cannot set a {format_bytes(limit)} limit on {path} ({exc.strerror})") from None
        return run
