"""One rank of a distributed point, measured in this process: on a fake process group (the estimate simulates a
rank; collectives move no data), or as one process of a torchrun job (cpu: gloo, cuda: nccl).

A rank of a torchrun job writes its row to `rank<r>.json` beside the request. A rank that runs out of memory, or
whose measurement raises, writes its `oom` or `error` row and exits at once with FAILED_EXIT: torchrun then stops
the other ranks (which would otherwise wait in a collective), and the point names that rank and its exception.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from vlmprobe import backends, child
from vlmprobe.distributed.process_group import fake_group, real_group
from vlmprobe.point.measure import error_row, measure
from vlmprobe.states import Status

__all__ = ["FAILED_EXIT", "run_rank", "simulate_rank"]

FAILED_EXIT = 75  # a rank's exit code after it wrote an `oom` or `error` row


def simulate_rank(config: dict, rank: int) -> dict:
    """Rank `rank`'s row, simulated in this process on a fake group; a failure is an `error` row."""
    dist = config["dist"]
    try:
        with fake_group(rank, dist["world_size"], "cpu", dist["ranks_per_node"]):  # fake tensors are CPU tensors
            return measure(config)
    except Exception as exc:
        return error_row(exc)


def run_rank(request: Path) -> int:
    """One rank of a torchrun job (in the process torchrun started): join the group, measure, write the row.
    Returns the exit code."""
    child.die_with_parent()  # torchrun's: a job whose sweep was killed leaves no rank holding a GPU
    point = json.loads(request.read_text())
    backend = backends.get(point["measure"]["backend"])
    backend.select_device(int(os.environ["LOCAL_RANK"]))  # before the group: nccl binds to the current device
    with real_group(backend.device_type) as rank:
        if point["measure"].get("snapshot_file"):  # one file per rank
            point["measure"]["snapshot_file"] = point["measure"]["snapshot_file"].replace(".pickle", f".rank{rank}.pickle")
        try:
            row = measure(point)
        except Exception as exc:
            row = error_row(exc)
        (request.parent / f"rank{rank}.json").write_text(json.dumps(row))
        if row["status"] != Status.OK:  # the others wait for it in a collective: leave now, torchrun stops them
            sys.stdout.flush()
            os._exit(FAILED_EXIT)
    return 0
