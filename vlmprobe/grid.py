"""Sweep axes -> points. Pure: no torch, no Hydra composition.

Axes are nested like the config ({"data": {"batch_size": [1, 8]}}) so that `sweep.axes.data.batch_size=[1,2]`
overrides one from the command line; a top-level group name (`model`) takes group options. A point is the
list of overrides that turns the base config into it, and its id is those overrides joined, so the same
point always has the same id (resume matches on it).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass

from vlmprobe.errors import ConfigError


@dataclass(frozen=True)
class Point:
    index: int
    values: dict  # dotted config key -> value of this point, for the swept keys

    @property
    def overrides(self) -> list[str]:
        return [f"{key}={format_value(value)}" for key, value in self.values.items()]

    @property
    def id(self) -> str:
        return ",".join(self.overrides) or "default"


def format_value(value) -> str:
    """A value as Hydra's override grammar reads it back."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def flatten_axes(axes: Mapping, prefix: str = "") -> dict[str, list]:
    """{"data": {"batch_size": [1, 8]}} -> {"data.batch_size": [1, 8]}; every leaf must be a non-empty list."""
    flat: dict[str, list] = {}
    for key, value in axes.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten_axes(value, dotted + "."))
        elif isinstance(value, (list, tuple)) and value:
            flat[dotted] = list(value)
        else:
            raise ConfigError(
                f"sweep.axes.{dotted}={value!r} is not allowed: an axis is a non-empty list of values, "
                f"e.g. sweep.axes.{dotted}=[1,2]"
            )
    return flat


def expand(axes: Mapping) -> list[Point]:
    """The cartesian product of the axes, the first axis varying slowest (the order they are written)."""
    flat = flatten_axes(axes)
    keys = list(flat)
    return [Point(i, dict(zip(keys, combo))) for i, combo in enumerate(itertools.product(*flat.values()))]
