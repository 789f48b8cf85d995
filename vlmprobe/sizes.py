"""Byte sizes as configs and out-of-memory messages give them: an int of bytes, or text like '24GiB' (1024-based
units, as CUDA prints them)."""

from __future__ import annotations

import re
from decimal import Decimal

from vlmprobe.errors import ConfigError

__all__ = ["BYTE_UNITS", "GiB", "in_words", "margin_bytes", "MiB", "parse_bytes", "segment_bytes_in_message"]

BYTE_UNITS = {"B": 1, "bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}  # 1024-based, as CUDA prints
MiB, GiB = BYTE_UNITS["MiB"], BYTE_UNITS["GiB"]

def in_words(nbytes: int) -> str:
    """A size as a person reads it, 1024-based: GiB (2 decimals) from 1 GiB, MiB (1 decimal) from 1 MiB, KiB below;
    a tiny model's figures are not 0.00 GiB."""
    for unit, scale, digits in (("GiB", GiB, 2), ("MiB", MiB, 1)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.{digits}f} {unit}"
    return f"{nbytes / 2**10:.1f} KiB"


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|bytes|KiB|MiB|GiB|TiB)?\s*$")
ALLOWED = "give bytes or a size like 24GiB (a number, then B, KiB, MiB, GiB or TiB)"


def parse_bytes(value, key: str) -> int | None:
    """A whole number of bytes > 0 from an int, or from text: a number (digits, optionally a decimal part) and an
    optional 1024-based unit ('24GiB', '1.5 GiB', '4096'); None stays None. Anything else, and a size that is not
    a whole number of bytes (0.5, 0.1GiB), is refused in one line naming the value."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConfigError(f"{key}={value!r} is not allowed: {ALLOWED}")
    match = _SIZE.match(str(value))
    if not match:
        raise ConfigError(f"{key}={value!r} is not allowed: {ALLOWED}")
    size = Decimal(match.group(1)) * BYTE_UNITS[match.group(2) or "B"]
    if size != size.to_integral_value():
        whole = f"{int(size)} or {int(size) + 1}" if size > 1 else "1 or more"
        raise ConfigError(f"{key}={value!r} is not allowed: it is {size:f} bytes, not a whole number of bytes; give "
                          f"{whole}")
    if size <= 0:
        raise ConfigError(f"{key}={value!r} is not allowed: a size must be more than 0 bytes; {ALLOWED}")
    return int(size)


_REQUEST = re.compile(r"Tried to allocate ([\d.]+) (bytes|KiB|MiB|GiB|TiB)")


def segment_bytes_in_message(message: str) -> int | None:
    """The allocation an out-of-memory message says failed (CUDA's and the tracker's wording), in bytes: the
    segment the allocator tried to reserve, which CUDA prints formatted to 2 decimals."""
    match = _REQUEST.search(message)
    return round(float(match.group(1)) * BYTE_UNITS[match.group(2)]) if match else None


def margin_bytes(value, capacity: int, key: str) -> int:
    """Room kept free of `capacity`, as bytes: a fraction in [0, 0.5) of it (0.05: 5 %), or a size below it."""
    if isinstance(value, float) or (isinstance(value, int) and not isinstance(value, bool) and value == 0):
        if not 0 <= value < 0.5:
            raise ConfigError(f"{key}={value!r} is not allowed: give a fraction of the memory in [0, 0.5) (0.05 keeps "
                              f"5 % free) or a size like 1GiB")
        return int(value * capacity)
    size = parse_bytes(value, key)
    if size is None or size >= capacity:
        raise ConfigError(f"{key}={value!r} is not allowed: give a size below the {capacity:,} B it is kept from, or "
                          f"a fraction in [0, 0.5)")
    return size
