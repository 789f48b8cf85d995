"""Largest batch that fits a memory budget: bisect data.batch_size for each configuration of the grid.

A probe fits when its point finishes (`ok`) within the budget: its peak reserved bytes where the backend
measures them (cuda), else its peak allocated bytes. The estimate and cpu backends get the budget as their
device capacity (unless measure.device_memory is set), so their allocator model runs out of memory where a
card of that size would. Bisection over [low, high] assumes a batch that does not fit means no larger one
fits; it probes `low` first, then halves the interval: ceil(log2(high - low + 1)) + 1 probes at most.
"""

from __future__ import annotations

from collections.abc import Callable


def fits(row: dict, budget: int) -> bool:
    if row["status"] != "ok":
        return False
    peak = row.get("peak_reserved_bytes")
    peak = peak if peak is not None else row["peak_allocated_bytes"]
    return peak is not None and peak <= budget


def largest_fitting(probe: Callable[[int], dict], low: int, high: int, budget: int) -> int | None:
    """The largest batch size in [low, high] whose probe fits `budget`; None when `low` does not fit.
    `probe(batch_size)` returns the row of that point."""
    if not fits(probe(low), budget):
        return None
    fitting, failing = low, high + 1  # invariant: `fitting` fits, `failing` does not (high + 1 is assumed)
    while failing - fitting > 1:
        middle = (fitting + failing) // 2
        if fits(probe(middle), budget):
            fitting = middle
        else:
            failing = middle
    return fitting
