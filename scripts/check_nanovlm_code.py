#!/usr/bin/env python
"""nanoVLM's own model code beside vlmprobe's implementation of it, on the points of `+sweep=seq_len`: the same
measurement (the estimate, or CUDA on a GPU), the model swapped (`model.source=DIR`, vlmprobe.models.nanovlm_source).

vlmprobe's nanoVLM is written independently to keep for backward what nanoVLM's code keeps; this runs both and
prints each point's peak allocated and reserved bytes, their difference, and the cost of a sample between batch
8 and 16 beside the published RTX 3090 figures (nanoVLM issue #103). A difference is the code's: everything else
(step, optimizer, autocast, allocator, card) is the same program.

    python scripts/check_nanovlm_code.py --nanovlm-dir DIR [--backend estimate|cpu|cuda] [--device PROFILE]
        [--lengths 128,512] [--batch-sizes 1,8,16,32] [--model nanovlm_222m]

DIR is a checkout of huggingface/nanoVLM at the commit of issue #103 (git clone https://github.com/huggingface/nanoVLM
&& git -C nanoVLM checkout 731d8c6); only its models/ is read. --device: the card profile the estimate applies
(default rtx3090, the published card); on CUDA the card is the one it runs on (device=none unless given, when it is
checked against the card's name). On CUDA each point runs in a fresh worker process, as in a sweep.

What was found (2026-11-25, backend estimate, device=rtx3090, no GPU; nanoVLM at 731d8c6): see the README
("The estimate against the finding").
"""

from __future__ import annotations

import argparse

import pandas as pd

from vlmprobe.config.plan import plan_overrides
from vlmprobe.errors import ConfigError
from vlmprobe.results import finding as check, published as reference
from vlmprobe.run.sweep import run_point
from vlmprobe.script_args import options, positive_ints
from vlmprobe.sizes import MiB

CODES = ("vlmprobe", "nanoVLM")  # whose model code a run ran: ours, or the checkout's


def overrides(args, source: str | None) -> list[str]:
    axes = [f"sweep.axes.data.batch_size=[{','.join(map(str, args.batch_sizes))}]",
            f"sweep.axes.data.lm_max_length=[{','.join(map(str, args.lengths))}]"]
    device = args.device or ("none" if args.backend == "cuda" else reference.CARD.key)
    return ["+sweep=seq_len", f"measure.backend={args.backend}", f"device={device}", *axes,
            *([f"model={args.model}"] if args.model else []), *([f"model.source={source}"] if source else [])]


def run(configs: list[dict]) -> dict[tuple[int, int], dict]:
    """(batch, length) -> the point's outputs (a fresh worker process per point on CUDA: vlmprobe.run.sweep)."""
    return {(c["data"]["batch_size"], c["data"]["lm_max_length"]): run_point(c) for c in configs}


def figure(row: dict, key: str) -> float | None:
    return row[key] / MiB if row.get("status") == "ok" and row.get(key) is not None else None


def apart(mine: dict, other: dict, key: str) -> str:
    """nanoVLM's figure minus ours, in bytes ("" where either point did not end ok)."""
    if not (mine.get("status") == other.get("status") == "ok"):
        return ""
    return f"{other[key] - mine[key]:,}"


def markdown(rows: list[dict], digits: int) -> str:
    frame = pd.DataFrame(rows)
    numbers = frame.select_dtypes("number").columns
    frame[numbers] = frame[numbers].round(digits) + 0.0  # + 0.0: no "-0"
    return frame.astype(object).where(frame.notna(), "").to_markdown(index=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nanovlm-dir", required=True, metavar="DIR", help="a checkout of huggingface/nanoVLM")
    parser.add_argument("--backend", default="estimate", choices=["estimate", "cpu", "cuda"],
                        help="cpu: real tensors on this machine's CPU (the same bookkeeping as the estimate; slow)")
    parser.add_argument("--device", default=None, choices=options("device"), metavar="PROFILE",
                        help="the card's profile (conf/device/); default rtx3090 for the estimate, none on cuda")
    parser.add_argument("--lengths", type=positive_ints, default="128,512", help="lm_max_length values")
    parser.add_argument("--batch-sizes", type=positive_ints, default="1,8,16,32", help="batch sizes")
    parser.add_argument("--model", default=None, choices=[m for m in options("model") if m.startswith("nanovlm")],
                        metavar="MODEL", help="another nanoVLM config (default: the sweep's nanoVLM-222M)")
    args = parser.parse_args()
    try:  # a source that is no nanoVLM checkout, no GPU for cuda, a value the planner refuses: its one line
        planned = {code: [p.config for p in plan_overrides(overrides(args, source))]
                   for code, source in zip(CODES, (None, args.nanovlm_dir))}
    except ConfigError as exc:
        parser.error(str(exc))
    rows = dict(zip(CODES, (run(planned[code]) for code in CODES)))
    published = {} if args.model else {(r.batch_size, r.lm_max_length): int(r.peak_bytes) / MiB
                                       for r in reference.load().itertuples() if r.status == "ok"}
    ours, theirs = rows[CODES[0]], rows[CODES[1]]
    table = []
    for key in sorted(ours):
        mine, other = ours[key], theirs[key]
        table.append({"batch_size": key[0], "lm_max_length": key[1],
                      "status (ours / nanoVLM's)": f"{mine['status']} / {other['status']}",
                      **{f"{name} {code} MiB": figure(row, column) for name, column in
                         (("allocated", "peak_allocated_bytes"), ("reserved", "peak_reserved_bytes"))
                         for code, row in zip(CODES, (mine, other))},
                      "allocated: nanoVLM's - ours B": apart(mine, other, "peak_allocated_bytes"),
                      "reserved: nanoVLM's - ours B": apart(mine, other, "peak_reserved_bytes"),
                      "published MiB (RTX 3090)": published.get(key)})
    config = planned[CODES[0]][0]
    print(f"## Peak per point, backend {config['measure']['backend']}, device={config['device']['name']} "
          f"(MiB = 1024^2 B; published: CUDA, RTX 3090, nanoVLM issue #103)\n")
    print(markdown(table, 1), "\n")
    allocated = {code: {key: figure(row, "peak_allocated_bytes") for key, row in found.items()}
                 for code, found in rows.items()}
    allocated["published (RTX 3090)"] = published
    if {check.SLOPE_FROM, check.SLOPE_TO} <= set(args.batch_sizes):
        print(f"## Per sample, batch {check.SLOPE_FROM} -> {check.SLOPE_TO} (peak allocated)\n")
        print(markdown([{"lm_max_length": length, **{f"{code} MiB": check.per_sample(mib, length)
                                                     for code, mib in allocated.items()}}
                        for length in args.lengths], 2))


if __name__ == "__main__":
    main()
