#!/usr/bin/env python
"""FSDP2 (also with its parameters offloaded to the CPU) and DDP per rank: the estimate (one simulation per group of identical ranks, fake process group)
against the cpu backend (N real processes on gloo, real CPU tensors), for every rank; the two must be equal to
the byte in every memory column (each differing column is printed with both values). Prints one row per
(dist, model, world size, rank). Real gloo ranks can hold a finished collective's buffer past their next
allocation (gloo's worker thread drops its reference after waking the waiting thread; README, "Several GPUs"):
under FSDP2 a rank's forward peak was then one all-gather output above the estimate, under DDP the load columns
(the flat copy DDP broadcasts the parameters through). So the real ranks of a configuration are run again, up
to --real-runs times, until every rank agrees; "real run that agreed" says which did (or none), and the columns
that differ are the last run's.

    python scripts/check_distributed.py [--dists fsdp2,fsdp2_offload,ddp] [--worlds 2,4] [--models nanovlm_tiny,qwen2_vl_tiny] [--real-runs 6]

fsdp2_offload is FSDP2 with CPUOffloadPolicy (dist.offload_param=cpu): host memory is compared too.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import pandas as pd

from vlmprobe.config.plan import plan_overrides
from vlmprobe.results.table import RANK_VALUE_COLUMNS
from vlmprobe.run.ranks import run_ranks
from vlmprobe.sizes import MiB

BYTES = [c for c in RANK_VALUE_COLUMNS if c.endswith("_bytes")]
DISTS = {"fsdp2": ["dist=fsdp2"], "fsdp2_offload": ["dist=fsdp2", "dist.offload_param=cpu"], "ddp": ["dist=ddp"]}


def run(overrides: list[str]) -> dict:
    (planned,) = plan_overrides(overrides)
    return run_ranks(planned.config, dict(os.environ))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dists", default=",".join(DISTS), help=f"of {', '.join(DISTS)}")
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--models", default="nanovlm_tiny,qwen2_vl_tiny")
    parser.add_argument("--real-runs", type=int, default=6, help="real runs of a configuration at most, until one agrees")
    args = parser.parse_args()
    if args.real_runs < 1:
        parser.error(f"--real-runs {args.real_runs} is not allowed: it must be at least 1")
    if unknown := set(args.dists.split(",")) - DISTS.keys():
        parser.error(f"--dists {','.join(sorted(unknown))} is not allowed: choose from {', '.join(DISTS)}")
    rows = []
    for dist, model, world in itertools.product(args.dists.split(","), args.models.split(","),
                                                map(int, args.worlds.split(","))):
        base = [f"model={model}", "data.batch_size=2", "data.lm_max_length=64", *DISTS[dist],
                f"dist.world_size={world}"]
        estimate = run(base + ["measure.backend=estimate"])
        for real_run in range(1, args.real_runs + 1):
            cpu = run(base + ["measure.backend=cpu"])
            if all(e.get(k) == c.get(k) for e, c in zip(estimate["ranks"], cpu["ranks"]) for k in BYTES):
                agreed = f"run {real_run}"
                break
        else:
            agreed = f"none of {args.real_runs}"
        for e, c in zip(estimate["ranks"], cpu["ranks"]):
            differing = [k for k in BYTES if e.get(k) != c.get(k)]
            rows.append({"dist": dist, "model": model, "world_size": world, "rank": e["rank"],
                         "simulated_as": e["simulated_as"], "real run that agreed": agreed,
                         "estimate peak B": e["peak_allocated_bytes"], "cpu peak B": c["peak_allocated_bytes"],
                         "estimate peak MiB": round(e["peak_allocated_bytes"] / MiB, 3),
                         "estimate host peak B": e["peak_host_bytes"], "cpu host peak B": c["peak_host_bytes"],
                         "columns that differ": ", ".join(f"{k} {e.get(k)}/{c.get(k)}" for k in differing) or "none",
                         "status": f"{e['status']}/{c['status']}"})
    table = pd.DataFrame(rows)
    print(table.to_markdown(index=False))
    print(f"\nCompared per rank: {', '.join(BYTES)} (bytes; MiB = 1024^2 B). estimate: fake process group, one "
          f"simulation per group of identical ranks (simulated_as); cpu: torchrun, gloo, real tensors.")
    return 0 if (table["columns that differ"] == "none").all() else 1


if __name__ == "__main__":
    sys.exit(main())
