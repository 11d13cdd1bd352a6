"""Byte sizes written with units, as operators type them on command lines.

Binary units (KiB, MiB, GiB, TiB) are powers of 1024; decimal units (KB, MB, GB,
TB) are powers of 1000; "B" or no unit means bytes. Units are case-insensitive,
a space between number and unit is allowed, and the result must be a whole
number of bytes ("1.5GiB" is fine, "0.5B" is not).
"""

from __future__ import annotations

import re
from fractions import Fraction

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
}

_SIZE_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")

# format_size picks the largest binary unit that keeps the number >= 1.
_BINARY_UNITS: tuple[tuple[str, int], ...] = (
    ("TiB", 1024**4),
    ("GiB", 1024**3),
    ("MiB", 1024**2),
    ("KiB", 1024),
)


def parse_size(text: str | int) -> int:
    """Return the number of bytes that `text` names; raise ValueError if it names none.

    Exact arithmetic (Fraction), so "1.1GB" is 1_100_000_000, not a float rounding.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"size must not be negative, got {text}")
        return text
    if not isinstance(text, str):
        raise ValueError(f"size must be a string or an integer, got {type(text).__name__}")
    match = _SIZE_PATTERN.match(text)
    if match is None:
        raise ValueError(f"not a size: {text!r} (expected e.g. 4096, 512MiB, 4GiB, 10GB)")
    number, unit = match.groups()
    multiplier = _UNITS.get(unit.lower())
    if multiplier is None:
        known = "B, KiB, MiB, GiB, TiB, KB, MB, GB, TB"
        raise ValueError(f"unknown size unit {unit!r} in {text!r} (known: {known})")
    size = Fraction(number) * multiplier
    if size.denominator != 1:
        raise ValueError(f"size {text!r} is not a whole number of bytes")
    return int(size)


def format_size(size_bytes: int) -> str:
    """Return `size_bytes` in the largest binary unit that is >= 1, e.g. "1.50 GiB", "512 B"."""
    if size_bytes < 0:
        raise ValueError(f"size must not be negative, got {size_bytes}")
    for unit, multiplier in _BINARY_UNITS:
        if size_bytes >= multiplier:
            value = size_bytes / multiplier
            if size_bytes % multiplier == 0:
                return f"{size_bytes // multiplier} {unit}"
            return f"{value:.2f} {unit}"
    return f"{size_bytes} B"
