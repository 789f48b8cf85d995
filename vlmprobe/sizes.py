"""Byte sizes as a config gives them: an int of bytes, or text like '24GiB' (1024-based units)."""

from __future__ import annotations

import re

from vlmprobe.errors import ConfigError

BYTE_UNITS = {"B": 1, "bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}  # 1024-based, as CUDA prints

_SIZE = re.compile(r"^\s*([\d.]+)\s*(B|KiB|MiB|GiB|TiB)?\s*$")


def parse_bytes(value, key: str) -> int | None:
    """An int of bytes, or a string like '24GiB' (1024-based units); None stays None."""
    if value is None:
        return None
    match = _SIZE.match(str(value))
    if isinstance(value, bool) or not match or float(match.group(1)) <= 0:
        raise ConfigError(f"{key}={value!r} is not allowed: give bytes or a size like 24GiB (units B, KiB, MiB, GiB, TiB)")
    return int(float(match.group(1)) * BYTE_UNITS[match.group(2) or "B"])
