"""`python -m vlmprobe.results.compare BASELINE_DIR RESULTS_DIR [--tolerance 0.02]`: the memory regression gate.

Rows of the two results dirs are matched by their inputs (results.INPUT_COLUMNS both tables have, less the
parameter counts: those follow from the model, and a model change must show as a changed peak of the same
point, not as two unmatched ones). A regression is a matched point whose peak_allocated_bytes grew by more
than the tolerance, a point that was `ok` and now is not (oom, error, ...), or a baseline point missing from
the results. Rows of different backends are never compared: an estimate is not a measurement.

A baseline is a results dir copied to results/baseline/<device>/<sweep>/, where <device> is env.json's
device_name slugified (`device_slug`): "NVIDIA H100 80GB HBM3" -> nvidia-h100-80gb-hbm3.

Exit codes: 0 no regression; 1 a regression; 2 bad input (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import pandas as pd

from vlmprobe.results.table import INPUT_COLUMNS, read_results_dir, read_table, value_text
from vlmprobe.sizes import MiB
from vlmprobe.states import Status

__all__ = ["baseline_path", "device_slug"]

NOT_KEYS = {"params", "trainable_params"}


def device_slug(device_name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")


def baseline_path(root: Path, results_dir: Path) -> Path:
    """Where the baseline for a results dir lives: ROOT/<device slug>/<sweep>."""
    env = json.loads((Path(results_dir) / "env.json").read_text())
    sweep = read_table(Path(results_dir) / "results.csv")["sweep"].iloc[0]
    return Path(root) / device_slug(env["device_name"]) / sweep


def load(out_dir: Path) -> tuple[pd.DataFrame, dict]:
    """The rows and env.json of a results dir; ValueError (one line) if it is not one."""
    table, env = read_results_dir(out_dir), out_dir / "env.json"
    if table.empty:
        raise ValueError(f"{out_dir / 'results.csv'} has no rows")
    return table, json.loads(env.read_text()) if env.is_file() else {}


def key_text(value) -> str:
    """A key cell as text both tables agree on: a column with an empty cell is read as float (224 -> 224.0)."""
    return value_text(value, "")


def keyed(table: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    return table.assign(**{k: table[k].map(key_text) for k in keys})


def diff(baseline: pd.DataFrame, results: pd.DataFrame, tolerance: float) -> pd.DataFrame:
    """One row per point either side has: both statuses and peaks, the change, a verdict and `regression`."""
    keys = [c for c in INPUT_COLUMNS if c in baseline.columns and c in results.columns and c not in NOT_KEYS]
    cols = ["status", "peak_allocated_bytes", "row"]  # row: to list points in the order the sweeps ran them
    before, after = (keyed(t, keys).assign(row=range(len(t)))[keys + cols] for t in (baseline, results))
    both = before.merge(after, on=keys, how="outer", suffixes=("_base", "_new"), indicator="side")
    both = both.sort_values(["row_base", "row_new"], ignore_index=True).drop(columns=["row_base", "row_new"])
    both["change"] = (both["peak_allocated_bytes_new"].astype(float) / both["peak_allocated_bytes_base"].astype(float)
                      - 1)
    verdicts = [verdict(r, tolerance) for r in both.itertuples()]
    both["verdict"] = [v for v, _ in verdicts]
    both["regression"] = [r for _, r in verdicts]
    return both


def verdict(row, tolerance: float) -> tuple[str, bool]:
    if row.side == "left_only":
        return "missing from results", True
    if row.side == "right_only":
        return "new point", False
    if row.status_base == Status.OK and row.status_new != Status.OK:
        return f"was ok, now {row.status_new}", True
    if pd.isna(row.change):
        return f"{row.status_base} -> {row.status_new}", False
    if row.change > tolerance:
        return f"GREW {row.change:+.1%}", True
    return ("smaller" if row.change < -tolerance else "same") + f" ({row.change:+.1%})", False


def diff_text(table: pd.DataFrame) -> str:
    def mib(value) -> str:
        return "" if pd.isna(value) else f"{value / MiB:,.1f}"

    shown = pd.DataFrame({
        "point_id": table["point_id"], "model": table["model"],
        "status": table["status_base"].fillna("-") + " -> " + table["status_new"].fillna("-"),
        "baseline MiB": table["peak_allocated_bytes_base"].map(mib),
        "results MiB": table["peak_allocated_bytes_new"].map(mib),
        "verdict": table["verdict"],
    })
    return shown.to_markdown(index=False, disable_numparse=True,
                             colalign=("left", "left", "left", "right", "right", "left"))


def describe(out_dir: Path, table: pd.DataFrame, env: dict) -> str:
    return (f"{out_dir}: backend {', '.join(sorted(table['backend'].dropna().unique()))}, "
            f"device {env.get('device_name', '?')}, commit {env.get('git_commit', '?')}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vlmprobe.results.compare", description=__doc__.splitlines()[0])
    parser.add_argument("baseline", type=Path, help="the baseline results dir")
    parser.add_argument("results", type=Path, help="the results dir to gate")
    parser.add_argument("--tolerance", type=float, default=0.02,
                        help="largest allowed growth of a peak, as a fraction (default 0.02 = 2%%)")
    args = parser.parse_args(argv)
    try:
        (baseline, base_env), (results, new_env) = load(args.baseline), load(args.results)
    except ValueError as exc:
        print(f"vlmprobe.results.compare: {exc}", file=sys.stderr)
        return 2
    base_backends, new_backends = set(baseline["backend"].dropna()), set(results["backend"].dropna())
    if base_backends != new_backends:
        print(f"vlmprobe.results.compare: refusing to compare backend {', '.join(sorted(base_backends))} (baseline) with "
              f"{', '.join(sorted(new_backends))} (results): figures of different backends are not comparable",
              file=sys.stderr)
        return 2
    table = diff(baseline, results, args.tolerance)
    if not (table["side"] == "both").any():
        print(f"vlmprobe.results.compare: {args.baseline} and {args.results} have no point in common (different sweeps "
              "or settings?)", file=sys.stderr)
        return 2
    print(f"baseline {describe(args.baseline, baseline, base_env)}\n"
          f"results  {describe(args.results, results, new_env)}\n"
          f"peak allocated, MiB = 1024^2 bytes; tolerance {args.tolerance:.1%} growth\n")
    print(diff_text(table) + "\n")
    regressions = int(table["regression"].sum())
    print(f"{regressions or 'no'} regression(s) among {len(table)} point(s)")
    return 1 if regressions else 0


if __name__ == "__main__":
    sys.exit(main())
