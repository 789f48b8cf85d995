"""One rank of a distributed point, measured in this process: on a fake process group (a simulated rank:
collectives move no data), or as one process of a torchrun job (cpu: gloo, cuda: nccl).

A simulated rank runs on the point's device: fake CPU tensors for the estimate, real ones for cpu, the one GPU for
cuda (dist.ranks=simulate). There every simulated rank is a rank of a one-GPU node: LOCAL_RANK 0, the device the
process has, since DeepSpeed puts a rank's tensors on cuda:LOCAL_RANK (deepspeed 0.19.8 runtime/zero/
partition_parameters.py Init.local_device, runtime/engine.py _configure_with_arguments); torch 2.13's DeviceMesh
sets no device on a fake group (distributed/device_mesh.py _setup_world_group_and_device), so it is set here.

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
    """Rank `rank`'s row, simulated in this process on a fake group on the point's device (module docstring); a
    failure is an `error` row."""
    dist = config["dist"]
    backend = backends.get(config["measure"]["backend"])
    per_node = 1 if backend.device_type == "cuda" else dist["ranks_per_node"]  # cuda: the one GPU is LOCAL_RANK 0
    try:
        backend.select_device(0)
        with fake_group(rank, dist["world_size"], backend.device_type, per_node):  # estimate: fake CPU tensors
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
