#!/usr/bin/env python
"""FSDP2 (also with its parameters offloaded to the CPU) and DDP per rank: the estimate (one simulation per group of identical ranks, fake process group)
against the cpu backend (N real processes on gloo, real CPU tensors), for every rank; the two must be equal to
the byte in every memory column (each differing column is printed with both values). Prints one row per
(dist, model, world size, rank). Under DDP the real side's load columns can be higher on a rank now and then:
the flat copy DDP broadcasts the parameters through can still be held by gloo's worker thread when the load
is read (README, "Several GPUs").

    python scripts/check_distributed.py [--dists fsdp2,fsdp2_offload,ddp] [--worlds 2,4] [--models nanovlm_tiny,qwen2_vl_tiny]

fsdp2_offload is FSDP2 with CPUOffloadPolicy (dist.offload_param=cpu): host memory is compared too.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import pandas as pd

from vlmprobe.distributed.ranks import RANK_VALUE_COLUMNS, measure_point
from vlmprobe.plan import plan_overrides
from vlmprobe.results import MiB
from vlmprobe.worker import measure

BYTES = [c for c in RANK_VALUE_COLUMNS if c.endswith("_bytes")]
DISTS = {"fsdp2": ["dist=fsdp2"], "fsdp2_offload": ["dist=fsdp2", "dist.offload_param=cpu"], "ddp": ["dist=ddp"]}


def run(overrides: list[str]) -> dict:
    (planned,) = plan_overrides(overrides)
    return measure_point(planned.config, measure, dict(os.environ))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dists", default=",".join(DISTS), help=f"of {', '.join(DISTS)}")
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--models", default="nanovlm_tiny,qwen2_vl_tiny")
    args = parser.parse_args()
    if unknown := set(args.dists.split(",")) - DISTS.keys():
        parser.error(f"--dists {','.join(sorted(unknown))} is not allowed: choose from {', '.join(DISTS)}")
    rows = []
    for dist, model, world in itertools.product(args.dists.split(","), args.models.split(","),
                                                map(int, args.worlds.split(","))):
        base = [f"model={model}", "data.batch_size=2", "data.lm_max_length=64", *DISTS[dist],
                f"dist.world_size={world}"]
        estimate, cpu = (run(base + [f"measure.backend={b}"]) for b in ("estimate", "cpu"))
        for e, c in zip(estimate["ranks"], cpu["ranks"]):
            differing = [k for k in BYTES if e.get(k) != c.get(k)]
            rows.append({"dist": dist, "model": model, "world_size": world, "rank": e["rank"],
                         "simulated_as": e["simulated_as"],
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
