"""Human sizes and durations: parse what users type, format what panels show."""

from __future__ import annotations

import re
from fractions import Fraction

from kimitui.errors import UserError

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kb": 1000,
    "kib": 1024,
    "m": 1024**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1024**4,
    "tb": 1000**4,
    "tib": 1024**4,
}
MAX_SIZE = 2**63 - 1  # what a file offset can be (off_t)
MAX_SIZE_TEXT = "8 EiB"
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Bytes from `512MiB`, `8GiB`, `1.5GB` or a plain integer; ValueError says why."""
    if isinstance(text, bool):
        raise ValueError("expected a size such as 512MiB, 8GiB or 1.5GB")
    if isinstance(text, int):
        if text < 0:
            raise ValueError("a size cannot be negative")
        if text > MAX_SIZE:
            raise ValueError(f"{text} is too large for a size (at most {MAX_SIZE_TEXT})")
        return text
    match = _SIZE_RE.match(text)
    if not match:
        raise ValueError(f"cannot read {text!r} as a size (use e.g. 512MiB, 8GiB, 1.5GB)")
    number, unit = match.groups()
    factor = _SIZE_UNITS.get(unit.lower())
    if factor is None:
        raise ValueError(f"unknown size unit {unit!r} in {text!r} (use B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)")
    if len(number.partition(".")[0].lstrip("0")) > 21:  # past any size a machine has, and past a float's range further on
        raise ValueError(f"{text[:24]}... is too large for a size (at most {MAX_SIZE_TEXT})")
    size = int(Fraction(number) * factor)
    if size > MAX_SIZE:
        raise ValueError(f"{text.strip()} is too large for a size (at most {MAX_SIZE_TEXT})")
    return size


def size_option(text: str, flag: str) -> int:
    """A command-line size: bytes, or UserError naming ``flag`` and why it cannot be read."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise UserError(f"{flag}: {exc}") from None


def format_bytes(n: float | None, precision: int = 1) -> str:
    """Binary units, as memory is counted; None becomes the em dash panels use."""
    if n is None:
        return "—"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.{precision}f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_rate(bytes_per_s: float | None) -> str:
    """Storage throughput in decimal MB/s, the unit disks are sold in."""
    if bytes_per_s is None:
        return "—"
    return f"{bytes_per_s / 1e6:.1f} MB/s"


def format_ms(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    ms = seconds * 1000
    return f"{ms:.0f} ms" if ms >= 100 else f"{ms:.1f} ms"
