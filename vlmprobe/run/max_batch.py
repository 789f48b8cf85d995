"""Largest batch that fits a memory budget: bisect data.batch_size for each configuration of the grid.

A probe fits when its point finishes (`ok`) within the budget (memory_budget, or the total memory of the
`device=` card when memory_budget is null) less find.margin: what the card would show (predicted_device_bytes on
estimate and cpu with a card: reserved + CUDA context; NVML's on cuda), else its peak reserved, else allocated. Every backend gets the budget as its device capacity
(unless measure.device_memory is set): the allocator model of the estimate and cpu backends, and the caching
allocator of a larger CUDA card (set_per_process_memory_fraction), run out of memory where a card of that
size would, retries and cache flushes included; the row's imposed_capacity_bytes says so. Bisection over [low, high] assumes a batch that does not fit means no larger one
fits; it probes `low` first, then halves the interval: ceil(log2(high - low + 1)) + 1 probes at most.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pandas as pd
from tqdm.auto import tqdm

from vlmprobe.config.grid import Point
from vlmprobe.config.plan import Composer, grid_points, plan_point
from vlmprobe.errors import ConfigError
from vlmprobe.gpu import device_profile
from vlmprobe.results.answer import shown
from vlmprobe.sizes import GiB, MiB, margin_bytes, parse_bytes
from vlmprobe.states import Status

__all__ = ["MaxBatchSearch", "fits", "largest_fitting", "most_probes"]


def fits(row: dict, budget: int) -> bool:
    """Whether a probe ended `ok` with what the card would show (answer.shown: predicted_device_bytes, NVML's
    figure, the peak reserved), else its peak allocated, within `budget`."""
    if row["status"] != Status.OK:
        return False
    peak = shown(row)
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


def most_probes(low: int, high: int) -> int:
    """The probes largest_fitting takes at most over [low, high]: `low`, then ceil(log2(high - low + 1)) halvings."""
    return 1 + (high - low).bit_length()


class MaxBatchSearch:
    """+find=max_batch: the largest batch size that fits memory_budget, for every grid point."""

    def __init__(self, compose, overrides: list[str], base: dict):
        self.budget = parse_bytes(base["memory_budget"], "memory_budget")
        card = device_profile.from_config(base["device"])
        if self.budget is None and card:  # a target card's whole memory is the budget for it
            self.budget = card.total_memory
        elif card and self.budget > card.total_memory:
            raise ConfigError(f"memory_budget={base['memory_budget']} is not allowed with device={card.key}: the "
                              f"{card.name} has {card.total_memory:,} B; give at most that, or null for all of it")
        if self.budget is None:
            raise ConfigError("memory_budget=null is not allowed with +find=max_batch: give bytes or a size like 24GiB, "
                              "or a card (device=rtx3090, ...) whose total memory is the budget")
        self.margin = margin_bytes(base["find"].get("margin", 0), self.budget, "find.margin")
        self.low, self.high = base["find"]["low"], base["find"]["high"]
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (self.low, self.high)) or not 1 <= self.low <= self.high:
            raise ConfigError(f"find.low={self.low!r}, find.high={self.high!r} are not allowed: give integers with 1 <= low <= high")
        self.points = grid_points(overrides, base)
        if any("data.batch_size" in p.values for p in self.points):
            raise ConfigError("data.batch_size is both swept and searched by +find=max_batch: drop the axis")
        self.overrides = [o for o in overrides if o.split("=", 1)[0] != "data.batch_size"]
        if base["measure"]["device_memory"] is None:
            # every backend runs out of memory where a card of the budget's size would: the allocator model
            # gets it as its capacity, a larger CUDA card as the caching allocator's limit
            self.overrides.append(f"measure.device_memory={self.budget}")
        self.composer = Composer(compose, self.overrides)
        self.planned = [self.probe_point(p, self.low) for p in self.points]  # validates every configuration
        self.found: list[dict] = []

    def probe_point(self, point, batch_size: int):
        values = {**point.values, "data.batch_size": batch_size}
        return plan_point(self.composer, Point(point.index, values, point.case))

    def run(self, runner) -> None:
        """Bisect every configuration through `runner` (sweep.Runner: probes resumed from its rows are reused). The
        bar counts probes: its total starts at the most they can take and drops by what a configuration leaves
        unused."""
        bar = tqdm(total=len(self.points) * most_probes(self.low, self.high), desc="probes", unit="probe", dynamic_ncols=True,
                   disable=not sys.stderr.isatty())
        for point in self.points:
            probes = []

            def probe(batch_size: int) -> dict:
                probes.append(batch_size)
                row = runner.run(self.probe_point(point, batch_size))
                bar.update()
                return row

            best = largest_fitting(probe, self.low, self.high, self.budget - self.margin)
            bar.total -= most_probes(self.low, self.high) - len(probes)
            bar.refresh()
            self.found.append({"configuration": point.id, "largest_batch_size": best, "memory_budget_bytes": self.budget,
                               "probes": len(probes), "probed": " ".join(map(str, probes))})
        bar.close()

    def report(self, out_dir: Path) -> list[str]:
        """max_batch.csv, a section appended to summary.md, and the same section's lines for stdout."""
        table = pd.DataFrame(self.found, columns=["configuration", "largest_batch_size", "memory_budget_bytes",
                                                  "probes", "probed"])
        table.to_csv(out_dir / "max_batch.csv", index=False)
        shown = table.drop(columns="memory_budget_bytes").fillna({"largest_batch_size": "none fits"})
        budget = f"{self.budget / GiB:.2f} GiB" if self.budget >= GiB else f"{self.budget / MiB:.1f} MiB"
        section = (f"\n## Largest batch size that fits {budget} (1 GiB = 1024^3 bytes, 1 MiB = 1024^2 bytes)\n\n"
                   f"Bisected over [{self.low}, {self.high}]; every probe is a row above. A probe fits when it ends `ok`\n"
                   f"with what the card would show (predicted_device_bytes: reserved + CUDA context; else reserved,\n"
                   f"else allocated) within the budget less find.margin ({self.margin / MiB:,.1f} MiB kept free).\n\n"
                   f"{shown.to_markdown(index=False)}\n")
        with (out_dir / "summary.md").open("a") as f:
            f.write(section)
        return section.strip("\n").splitlines()
