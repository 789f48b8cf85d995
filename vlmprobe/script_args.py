"""Value types for the argparse options of scripts/: a bad value is argparse's one error line and exit 2,
before any point runs."""

from __future__ import annotations

import argparse

from vlmprobe.paths import CONF

__all__ = ["options", "positive_ints"]


def positive_ints(text: str) -> list[int]:
    """A comma-separated list of positive integers."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed: give positive integers, comma-separated")
    return values


def options(group: str) -> list[str]:
    """The configs of a conf/ group (conf/<group>/*.yaml), by name: the choices of an option naming one."""
    return sorted(path.stem for path in (CONF / group).glob("*.yaml"))
