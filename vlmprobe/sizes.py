"""Byte sizes as configs and out-of-memory messages give them: an int of bytes, or text like '24GiB' (1024-based
units, as CUDA prints them)."""

from __future__ import annotations

import re

from vlmprobe.errors import ConfigError

__all__ = ["BYTE_UNITS", "GiB", "MiB", "parse_bytes", "segment_bytes_in_message"]

BYTE_UNITS = {"B": 1, "bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}  # 1024-based, as CUDA prints
MiB, GiB = BYTE_UNITS["MiB"], BYTE_UNITS["GiB"]

_SIZE = re.compile(r"^\s*([\d.]+)\s*(B|KiB|MiB|GiB|TiB)?\s*$")


def parse_bytes(value, key: str) -> int | None:
    """An int of bytes, or a string like '24GiB' (1024-based units); None stays None."""
    if value is None:
        return None
    match = _SIZE.match(str(value))
    if isinstance(value, bool) or not match or float(match.group(1)) <= 0:
        raise ConfigError(f"{key}={value!r} is not allowed: give bytes or a size like 24GiB (units B, KiB, MiB, GiB, TiB)")
    return int(float(match.group(1)) * BYTE_UNITS[match.group(2) or "B"])


_REQUEST = re.compile(r"Tried to allocate ([\d.]+) (bytes|KiB|MiB|GiB|TiB)")


def segment_bytes_in_message(message: str) -> int | None:
    """The allocation an out-of-memory message says failed (CUDA's and the tracker's wording), in bytes: the
    segment the allocator tried to reserve, which CUDA prints formatted to 2 decimals."""
    match = _REQUEST.search(message)
    return round(float(match.group(1)) * BYTE_UNITS[match.group(2)]) if match else None
