"""Sweep axes (and cases) -> points. Pure: no torch, no Hydra composition.

Axes are nested like the config ({"data": {"batch_size": [1, 8]}}) so that `sweep.axes.data.batch_size=[1,2]`
overrides one from the command line; a top-level group name (`model`) takes group options. A point is the
list of overrides that turns the base config into it, and its id is those overrides joined, so the same
point always has the same id (resume matches on it). Cases (`sweep.cases`) are sets of values that go
together, for one-knob-at-a-time comparisons; each case is crossed with the axes.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass

from vlmprobe.errors import ConfigError

__all__ = ["expand", "flatten_axes", "format_value", "flatten_cases", "Point"]


@dataclass(frozen=True)
class Point:
    index: int
    values: dict  # dotted config key -> value of this point, for the swept keys
    case: str = ""  # the overrides of its sweep case ("baseline" for an empty case; "" without cases)

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
    if not isinstance(axes, Mapping):
        raise ConfigError(f"sweep.axes={axes!r} is not allowed: give a mapping of config keys to lists of values, "
                          f"e.g. +sweep.axes.data.batch_size=[1,2]")
    flat: dict[str, list] = {}
    for key, value in axes.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten_axes(value, dotted + "."))
        elif isinstance(value, (list, tuple)) and value:
            flat[dotted] = distinct(f"sweep.axes.{dotted}", list(value))
        else:
            raise ConfigError(
                f"sweep.axes.{dotted}={value!r} is not allowed: an axis is a non-empty list of values, "
                f"e.g. sweep.axes.{dotted}=[1,2]"
            )
    return flat


def distinct(key: str, values: list) -> list:
    """`values` (an axis, or the cases), refused in one line where one is given twice: each would be a point of
    the same id, measured twice."""
    seen = []
    for value in values:
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if any(format_value(value) == format_value(other) or (number and type(other) in (int, float) and value == other)
               for other in seen):
            raise ConfigError(f"{key}={values!r} is not allowed: {format_value(value)} is given twice; give each value "
                              f"once")
        seen.append(value)
    return values


def flatten_cases(cases) -> list[dict]:
    """Cases are whole sets of values that go together, nested like the config ({train: {grad_ckpt: {lm:
    true}}}); each becomes a dotted-key dict. An empty case ({}) is the config as it is: a baseline."""
    if cases is None:
        return [{}]
    if not isinstance(cases, (list, tuple)) or not cases or not all(isinstance(c, Mapping) for c in cases):
        raise ConfigError(f"sweep.cases={cases!r} is not allowed: give a non-empty list of mappings of config keys to values")
    return distinct("sweep.cases", [flatten_mapping(case) for case in cases])


def flatten_mapping(mapping: Mapping, prefix: str = "") -> dict:
    flat = {}
    for key, value in mapping.items():
        if isinstance(value, Mapping) and value:
            flat.update(flatten_mapping(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def expand(axes: Mapping, cases=None) -> list[Point]:
    """Every case crossed with the cartesian product of the axes; cases vary slowest, then the axes in the
    order they are written."""
    flat = flatten_axes(axes)
    keys = list(flat)
    points = []
    for case in flatten_cases(cases):
        label = (",".join(Point(0, case).overrides) or "baseline") if cases else ""
        for combo in itertools.product(*flat.values()):
            points.append(Point(len(points), {**case, **dict(zip(keys, combo))}, label))
    return points
