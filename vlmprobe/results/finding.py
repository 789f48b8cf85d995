"""`python -m vlmprobe.results.finding DIR`: does a seq_len results dir reproduce nanoVLM issue #103's finding?

The finding: the batch-1 peak is the same at both lengths (the optimizer step sets it), and each extra sample
costs several times more at length 512 than at 128. It holds for DIR when all four criteria pass:
  - the batch-1 peaks at 128 and 512 are within 2% of each other;
  - the slope ratio, MiB per sample between batch 8 and 16 at 512 over the same at 128, is within [2.5, 5];
  - every point the paper has a figure for is within 10% of it (points it lacks are skipped);
  - batch 32 at 512 is above 24 GiB, more than the RTX 3090 the paper ran on holds (an `oom` row counts).
Exit codes: 0 the finding holds; 1 it does not; 2 bad input (one line on stderr).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from vlmprobe.results import published
from vlmprobe.results.table import read_results_dir
from vlmprobe.sizes import GiB, MiB
from vlmprobe.states import Status

__all__ = ["Finding", "finding", "main", "peak_mib", "per_sample", "point", "slope_ratio", "status", "table_text"]

SHORT, LONG = 128, 512
SLOPE_FROM, SLOPE_TO = 8, 16  # the slope is taken where both lengths have published figures
BATCH1_TOLERANCE = 0.02
SLOPE_RATIO_RANGE = (2.5, 5.0)
POINT_TOLERANCE = 0.10
OOM_POINT = (32, LONG)
OOM_ABOVE = 24 * GiB  # the line: "batch 32 at 512 above 24 GiB" (the card itself holds 23.69 GiB)
STATE_WORDS = {"oom": "OOM", "absent": "not reported", "error": "ERROR", "timeout": "TIMEOUT", "crash": "CRASH"}


@dataclass
class Finding:
    """The finding as numbers for one side ("ours" or "published") of published.side_by_side; None = no figure."""
    batch1: dict[int, float | None]  # length -> MiB
    slope: dict[int, float | None]  # length -> MiB per sample between batch SLOPE_FROM and SLOPE_TO
    slope_ratio: float | None  # slope at LONG / slope at SHORT
    fits: dict[int, list[int]]  # length -> batch sizes whose peak fits the reference device
    no_figure: dict[int, list[int]]  # length -> batch sizes with neither a figure nor an OOM


def point(side: pd.DataFrame, batch: int, length: int) -> pd.DataFrame:
    return side[(side["batch_size"] == batch) & (side["lm_max_length"] == length)]


def status(side: pd.DataFrame, who: str, batch: int, length: int) -> str | None:
    """ok / oom / ... of one side at a point; None where that side has no row for it."""
    states = point(side, batch, length)[f"{who}_status"].dropna()
    return states.iloc[0] if len(states) else None


def peak_mib(side: pd.DataFrame, who: str, batch: int, length: int) -> float | None:
    if status(side, who, batch, length) != Status.OK:
        return None
    return float(point(side, batch, length)[f"{who}_bytes"].iloc[0]) / MiB


def per_sample(figures: dict, length: int) -> float | None:
    """What a sample adds at `length`: the change of a figure ((batch, length) -> value, any unit) per sample
    between batch SLOPE_FROM and SLOPE_TO; None where either has no figure."""
    low, high = figures.get((SLOPE_FROM, length)), figures.get((SLOPE_TO, length))
    return None if low is None or high is None else (high - low) / (SLOPE_TO - SLOPE_FROM)


def finding(side: pd.DataFrame, who: str) -> Finding:
    slope = {length: per_sample({(b, length): peak_mib(side, who, b, length) for b in (SLOPE_FROM, SLOPE_TO)}, length)
             for length in (SHORT, LONG)}
    ratio = slope[LONG] / slope[SHORT] if slope[LONG] is not None and slope[SHORT] else None
    fits, no_figure = {}, {}
    for length in (SHORT, LONG):
        batches = sorted(side.loc[side["lm_max_length"] == length, "batch_size"])
        fits[length] = [b for b in batches
                        if (p := peak_mib(side, who, b, length)) is not None and p * MiB <= published.DEVICE_BYTES]
        no_figure[length] = [b for b in batches if status(side, who, b, length) not in (Status.OK, Status.OOM)]
    return Finding({n: peak_mib(side, who, 1, n) for n in (SHORT, LONG)}, slope, ratio, fits, no_figure)


@dataclass
class Criterion:
    name: str
    passed: bool
    detail: str


def criteria(side: pd.DataFrame) -> list[Criterion]:
    ours, published = finding(side, "ours"), finding(side, "published")
    return [batch1_equal(ours), slope_ratio(ours, published), points_close(side), oom_point(side)]


def batch1_equal(ours: Finding) -> Criterion:
    name = f"batch-1 peaks at {SHORT} and {LONG} within {BATCH1_TOLERANCE:.0%} of each other"
    short, long = ours.batch1[SHORT], ours.batch1[LONG]
    if short is None or long is None:
        return Criterion(name, False, "no figure for batch 1 at both lengths")
    apart = abs(long - short) / min(long, short)
    return Criterion(name, apart <= BATCH1_TOLERANCE, f"{short:,.1f} vs {long:,.1f} MiB: {apart:.2%} apart")


def slope_ratio(ours: Finding, published: Finding) -> Criterion:
    low, high = SLOPE_RATIO_RANGE
    name = f"slope ratio {LONG}/{SHORT} (MiB per sample, batch {SLOPE_FROM} -> {SLOPE_TO}) within [{low}, {high}]"
    if ours.slope_ratio is None:
        return Criterion(name, False, f"no figures for batch {SLOPE_FROM} and {SLOPE_TO} at both lengths")
    detail = (f"{ours.slope[LONG]:,.1f} / {ours.slope[SHORT]:,.1f} = {ours.slope_ratio:.2f} "
              f"(published {published.slope[LONG]:,.1f} / {published.slope[SHORT]:,.1f} = {published.slope_ratio:.2f})")
    return Criterion(name, low <= ours.slope_ratio <= high, detail)


def points_close(side: pd.DataFrame) -> Criterion:
    name = f"every published figure matched within {POINT_TOLERANCE:.0%}"
    published = side[side["published_status"] == Status.OK]
    off = []
    for r in published.itertuples():
        where = f"batch {r.batch_size} at {r.lm_max_length}"
        if pd.isna(r.ratio):  # ours has no figure here: a point that OOMs or failed is not a match
            off.append(f"{where}: ours {r.ours_status if pd.notna(r.ours_status) else 'missing'}")
        elif abs(r.ratio - 1) > POINT_TOLERANCE:
            off.append(f"{where}: {r.ratio - 1:+.1%}")
    if off:
        return Criterion(name, False, "; ".join(off))
    worst = published.loc[(published["ratio"] - 1).abs().idxmax()]
    return Criterion(name, True, f"{len(published)} points, worst {worst['ratio'] - 1:+.1%} "
                                 f"(batch {worst['batch_size']} at {worst['lm_max_length']})")


def oom_point(side: pd.DataFrame) -> Criterion:
    batch, length = OOM_POINT
    cap = OOM_ABOVE
    name = f"batch {batch} at {length} above {cap / GiB:.0f} GiB (the {published.DEVICE} holds {published.DEVICE_BYTES / GiB:.2f} GiB)"
    state = status(side, "ours", batch, length)
    if state == Status.OOM:
        return Criterion(name, True, "OOM")
    peak = peak_mib(side, "ours", batch, length)
    if peak is None:
        return Criterion(name, False, f"no figure ({state or 'missing'})")
    return Criterion(name, peak * MiB > cap, f"{peak:,.1f} MiB = {peak * MiB / GiB:.2f} GiB")


def table_text(side: pd.DataFrame, backends: str) -> str:
    """Ours beside the published figures, MiB; a point without a figure shows its status."""
    def cell(who, r):
        state = getattr(r, f"{who}_status")
        if pd.isna(state):
            return "-"
        return f"{getattr(r, f'{who}_bytes') / MiB:,.1f}" if state == Status.OK else STATE_WORDS.get(state, state)

    rows = [{"batch_size": r.batch_size, "lm_max_length": r.lm_max_length,
             f"ours MiB ({backends})": cell("ours", r), f"published MiB ({published.DEVICE})": cell("published", r),
             "ours / published": f"{r.ratio:.3f} ({r.ratio - 1:+.1%})" if pd.notna(r.ratio) else ""}
            for r in side.itertuples()]
    return pd.DataFrame(rows).to_markdown(index=False, colalign=["right"] * 5, disable_numparse=True)


def load_side(out_dir: Path) -> tuple[pd.DataFrame, str]:
    """published.side_by_side of DIR's rows and the backends they came from; ValueError (one line) if DIR
    holds nothing the published table speaks to."""
    table = read_results_dir(out_dir)
    comparable = published.same_setup(table)
    if not comparable.any():
        raise ValueError(f"{out_dir} has no rows with the published setup ({published.setup_text()}); "
                         "run `python -m vlmprobe +sweep=seq_len`")
    backends = ", ".join(sorted(table.loc[comparable, "backend"].dropna().unique()))
    return published.side_by_side(table), backends


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vlmprobe.results.finding", description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path, help="a results dir of the seq_len sweep")
    args = parser.parse_args(argv)
    try:
        side, backends = load_side(args.dir)
    except ValueError as exc:
        print(f"vlmprobe.results.finding: {exc}", file=sys.stderr)
        return 2
    results = criteria(side)
    print(f"{args.dir}: backend {backends} vs nanoVLM issue #103 ({published.DEVICE}, measured); "
          f"MiB = 1024^2 bytes\n")
    print(table_text(side, backends) + "\n")
    for c in results:
        print(f"{'PASS' if c.passed else 'FAIL'}  {c.name}: {c.detail}")
    failed = [c for c in results if not c.passed]
    print(f"\nfinding {'holds' if not failed else f'does NOT hold ({len(failed)} of {len(results)} criteria failed)'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
