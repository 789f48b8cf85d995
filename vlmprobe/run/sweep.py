"""Run planned points, one row each, whatever happens to a point: `run_point` runs one where it must run (a worker
process, this process, or its ranks), `Runner` appends its row to results.csv the moment it ends, so a sweep
killed at any moment keeps every finished row, and a resumed one skips the points that have theirs.
"""

from __future__ import annotations

import hashlib
import math
import sys
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from vlmprobe import interrupt
from vlmprobe.errors import ConfigError
from vlmprobe.point.dataset_steps import append_steps_csv
from vlmprobe.point.measure import error_row, measure
from vlmprobe.results.table import RowWriter, append_timeline, mib, read_table
from vlmprobe.run.ranks import RankWriter, run_ranks
from vlmprobe.run.workers import call_worker, isolated, worker_env
from vlmprobe.states import Status

__all__ = ["Runner", "run_point", "same"]


def run_point(config: dict) -> dict:
    """Outputs of one point; never raises for a failure of the point itself. A point of several ranks
    also carries its rank rows under "ranks" (vlmprobe.run.ranks)."""
    distributed = config["dist"]["name"] != "none"
    if isolated(config) and not distributed:
        return call_worker(config, worker_env(config), config["measure"]["timeout_s"])
    try:
        return run_ranks(config, worker_env(config)) if distributed else measure(config)
    except Exception as exc:
        return error_row(exc)


class Runner:
    """Runs planned points into out_dir/results.csv, one row each, written as soon as its point ends. A point
    whose id already has a row there (resume) is not run again: its row is returned."""

    def __init__(self, out_dir: Path, columns: list[str]):
        self.out_dir = out_dir
        csv_path = out_dir / "results.csv"
        self.writer = RowWriter(csv_path, columns)
        self.ranks = RankWriter(out_dir)
        for problem in self.writer.problems + self.ranks.problems:
            tqdm.write(f"vlmprobe: resume: {problem}", file=sys.stderr)
        table = read_table(csv_path)
        self.done = {row["point_id"]: row for row in table.astype(object).where(table.notna(), None).to_dict("records")}
        self.statuses: list[str] = []  # of the points run here, not of the resumed ones

    def check_kept(self, planned: list) -> None:
        """Refuse, in one line, a folder whose rows are not these points': a kept row must have the input columns
        of the planned point of its id (another model, another batch under the same id would mix two sweeps)."""
        for item in planned:
            kept = self.done.get(item.point.id)
            differs = [(k, kept[k], v) for k, v in item.inputs.items() if kept and k in kept and not same(kept[k], v)]
            if differs:
                column, was, now = differs[0]
                raise ConfigError(f"resume={self.out_dir} is not allowed: its row for point {item.point.id} has "
                                  f"{column}={was!r} where this sweep plans {now!r}; its rows are another sweep's "
                                  f"(resume it with the command that made it, or start a new one)")

    def run(self, item) -> dict:
        if item.point.id in self.done:
            self.check_kept([item])
            return self.done[item.point.id]
        outputs = {"status": Status.SKIPPED, "error": item.skip} if item.skip else run_point(self.with_snapshot_file(item))
        if interrupt.received():  # Ctrl-C struck inside the point and a library turned it into a failure
            raise KeyboardInterrupt
        return self.record(item, outputs)

    def record(self, item, outputs: dict) -> dict:
        """Append the row of a point that has run (here, or in a worker of launcher=pool) and say so."""
        outputs.setdefault("backend", item.config["measure"]["backend"])
        if "ranks" in outputs:
            self.ranks.append(item.point.id, outputs.pop("ranks"))
        timeline = outputs.pop("timeline", None)  # not a column: timeline.jsonl (vlmprobe.results.table)
        steps = outputs.pop("steps", None)  # data.source's records, not columns: steps.csv (vlmprobe.point.dataset_steps)
        row = {**item.inputs, **outputs}
        if steps is not None:  # before the row: a point with a row has its steps
            append_steps_csv(self.out_dir, item.point.id, steps)
        self.writer.append(row)
        if timeline is not None:
            append_timeline(self.out_dir, item.point.id, timeline)
        self.done[item.point.id] = row
        self.statuses.append(row["status"])
        peak = mib(row.get("peak_allocated_bytes"))
        tqdm.write(f"  {item.point.id}: {row['status']}" + (f", peak {peak} MiB ({row['backend']})" if peak else "")
                   + (f" - {first_line(row, 160 if row['status'] != Status.OOM else None)}"
                      if row["status"] != Status.OK else ""),
                   file=sys.stderr)
        return row

    def with_snapshot_file(self, item) -> dict:
        """The point's config with the file its allocator snapshot goes to, should it write one."""
        name = hashlib.sha1(item.point.id.encode()).hexdigest()[:12]
        measure = {**item.config["measure"], "snapshot_file": str(self.out_dir / "snapshots" / f"{name}.pickle")}
        return {**item.config, "measure": measure}


def same(kept, planned) -> bool:
    """Whether a value read back from results.csv (pandas' types: NaN for nothing, floats in a column with an
    empty cell, numpy scalars) is the value a planned point has in that column."""
    if kept is None or (isinstance(kept, float) and math.isnan(kept)):
        return planned is None
    if planned is None:
        return False
    if isinstance(planned, bool) or isinstance(kept, (bool, np.bool_)):
        return str(kept).lower() == str(planned).lower()
    if isinstance(planned, (int, float)):
        try:
            return float(kept) == float(planned)
        except (TypeError, ValueError):
            return False
    return str(kept) == str(planned)


def first_line(row: dict, limit: int | None) -> str:
    """The first line of a row's error, cut to `limit` characters (None: whole; an out-of-memory message is never
    cut, its figures are the answer)."""
    line = (str(row.get("error") or "").splitlines() or [""])[0]
    return line if limit is None else line[:limit]
