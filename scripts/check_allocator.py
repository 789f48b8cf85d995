#!/usr/bin/env python
"""The allocator model against a real CUDA run: replay the run's recorded allocations (a
torch.cuda.memory._snapshot() pickle) through vlmprobe's model of the caching allocator, with the run's allocator
settings, and print allocated / reserved bytes, model vs recorded, at the peaks and at the end.

    python scripts/check_allocator.py SNAPSHOT.pickle [SNAPSHOT.pickle ...] [--alloc-conf TEXT]
    python scripts/check_allocator.py RESULTS_DIR      # every snapshot a cuda sweep wrote (measure.snapshot=true)
    python scripts/check_allocator.py RESULTS_DIR --requests-csv requests.csv

--requests-csv also writes what each run asked the allocator for (snapshot, point_id where the sweep's results.csv
names the snapshot, size_bytes, count: one row per size), the figures an estimate's own allocations are held to
(tests/test_estimate_vs_cuda.py) without committing the snapshots.

A cuda sweep with measure.snapshot=true writes one snapshot per point to <results>/snapshots/ (the row's
snapshot_file); any other run can write one with torch.cuda.memory._record_memory_history() and
torch.cuda.memory._dump_snapshot(). The settings are the ones the snapshot records (allocator_settings), unless
--alloc-conf gives others. Requested bytes and reserved bytes are in the trace and compared after every event;
allocated bytes (block sizes) only at the end, from the snapshot's segments. Exit 2 on a file that is not a
snapshot (one line). MiB = 1024^2 bytes.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import pandas as pd

from vlmprobe.errors import ConfigError
from vlmprobe.estimate.replay.snapshot import NotASnapshot, load, replay, requests, settings_text
from vlmprobe.gpu import alloc_conf

MiB = 2**20


def snapshot_paths(paths: list[str]) -> list[Path]:
    found = []
    for name in paths:
        path = Path(name)
        found.extend(sorted((path / "snapshots").glob("*.pickle")) if path.is_dir() else [path])
    return found


def point_ids(paths: list[Path]) -> dict[str, str]:
    """snapshot file name -> point_id, from the results.csv of each sweep the snapshots came from."""
    found = {}
    for results in {path.parent.parent / "results.csv" for path in paths}:
        if results.exists():
            rows = pd.read_csv(results, usecols=["point_id", "snapshot_file"]).dropna()
            found.update({Path(name).name: point for point, name in zip(rows["point_id"], rows["snapshot_file"])})
    return found


def table(path: Path, conf: str | None, result) -> str:
    lines = [f"{path.name} (alloc_conf: {conf or 'default'}; {result.events} allocs and frees replayed)",
             "| figure | model B | recorded B | model - recorded | MiB |", "|---|---:|---:|---:|---:|"]
    for when, figures in (("peak", result.peak), ("end", result.end)):
        for name, (model, recorded) in figures.items():
            lines.append(f"| {when} {name} | {model} | {recorded} | {model - recorded} | {(model - recorded) / MiB:+.2f} |")
    lines.append(f"reserved differs after {result.reserved_differs} of {result.events} events"
                 + (f" (first at trace entry {result.first_difference}, at most {result.max_reserved_difference / MiB:.2f}"
                    f" MiB)" if result.reserved_differs else ""))
    if result.recorded_ooms:
        lines.append(f"out of memory: {result.recorded_ooms} recorded, {result.model_ooms_agreeing} also in the model "
                     f"(the model's capacity is --capacity; without it the model never runs out)")
    if result.unknown_frees:
        lines.append(f"{result.unknown_frees} frees of allocations made before the history starts were skipped: the "
                     f"trace does not cover the whole run, so the comparison is partial")
    if len(result.streams) > 1:
        lines.append(f"{len(result.streams)} streams in the trace: the model has one")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("snapshots", nargs="+", help="snapshot pickles, or results dirs with a snapshots/ folder")
    parser.add_argument("--alloc-conf", default=None, help="allocator settings to replay with (default: the snapshot's)")
    parser.add_argument("--capacity", type=int, default=None, help="device bytes for the model's out-of-memory path")
    parser.add_argument("--requests-csv", default=None, help="also write each run's allocation requests by size here")
    args = parser.parse_args(argv)
    if args.requests_csv and not Path(args.requests_csv).resolve().parent.is_dir():
        print(f"check_allocator: --requests-csv {args.requests_csv} is not allowed: its folder does not exist",
              file=sys.stderr)
        return 2
    paths = snapshot_paths(args.snapshots)
    if not paths:
        print(f"check_allocator: no snapshot in {', '.join(args.snapshots)}", file=sys.stderr)
        return 2
    rows = []
    points = point_ids(paths)
    for path in paths:
        try:
            snapshot = load(path)
            conf = args.alloc_conf if args.alloc_conf is not None else settings_text(snapshot)
            settings = alloc_conf.parse(conf)
        except (NotASnapshot, ConfigError) as exc:
            print(f"check_allocator: {exc}", file=sys.stderr)
            return 2
        result = replay(snapshot, settings, args.capacity, alloc_conf.allowed_maximum(settings, args.capacity, False))
        print(table(path, conf, result) + "\n")
        rows += [(path.name, points.get(path.name, ""), size, count) for size, count in sorted(requests(snapshot).items())]
    if args.requests_csv:
        with open(args.requests_csv, "w", newline="") as out:
            writer = csv.writer(out)
            writer.writerow(["snapshot", "point_id", "size_bytes", "count"])
            writer.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
