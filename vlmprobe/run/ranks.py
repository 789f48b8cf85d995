"""The ranks of a distributed point, from the sweep's side: which ranks differ, running them (one simulation per
group of identical ranks, or a torchrun job), and their rows as the point's row and ranks.csv.

The estimate always simulates; cpu and cuda simulate on their one device where dist.ranks says so
(vlmprobe.distributed.options.ranks_mode), each rank in a child process of its own (a fresh interpreter on cuda:
its own CUDA context and allocator). Such a rank's row says it was simulated as the estimate's does
(`simulated_as` in ranks.csv) and, in its notes, what a real job has that it has not (SIMULATED_NOTE).

Ranks that hold the same tensor shapes allocate the same bytes, so the estimate simulates one rank of each
group of such ranks and gives its figures to every rank of the group. Under FSDP2 a rank's shapes are its
shards: dim 0 of every parameter split with torch.chunk (FSDP2's Shard(0)); the all-gather and reduce-
scatter buffers are padded to the largest chunk on every rank, while the optimizer state follows the
unpadded local shard, so uneven shards make ranks differ. DDP ranks all hold the whole model. The data
is the same synthetic batch on every rank. DeepSpeed ZeRO-3 cuts every parameter into equal padded pieces
(one group); ZeRO-1/2 cut one flat buffer, so each rank holds other parameters' pieces (a group each).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from vlmprobe import child
from vlmprobe.backends import cuda
from vlmprobe.distributed.options import ranks_mode
from vlmprobe.point.build import parameter_shapes
from vlmprobe.point.dataset_steps import gather_ranks
from vlmprobe.point.measure import TAIL
from vlmprobe.point.rank import simulate_rank
from vlmprobe.point.worker import last_row, print_row
from vlmprobe.results.table import RANK_COLUMNS, RANK_VALUE_COLUMNS, RowWriter
from vlmprobe.run.torchrun import launch
from vlmprobe.states import Status

RANK_KEY = ("point_id", "rank")  # what names a row of ranks.csv

__all__ = ["SIMULATED_NOTE", "RankWriter", "point_row", "rank_groups", "run_ranks", "shard_signature", "simulate",
           "simulate_elsewhere"]

# the notes of a rank simulated on a real device (cpu, cuda): not an estimate's figures, not a real job's either.
# NCCL's own buffers are not estimated: their size depends on the channels and peers NCCL picks for the topology
SIMULATED_NOTE = ("simulated on one device on a fake process group: collectives moved no data, NCCL's buffers are "
                  "not counted, step_time_s has no communication")


def shard_signature(shapes: list[tuple[int, ...]], rank: int, world_size: int) -> tuple:
    """The dim-0 length of this rank's shard of each parameter, as torch.chunk splits it (a rank past the
    last chunk holds an empty shard)."""

    def length(rows: int) -> int:
        chunk = math.ceil(rows / world_size)  # torch.chunk's chunk size
        return max(0, min(chunk, rows - rank * chunk))

    return tuple(length(shape[0]) if shape else 0 for shape in shapes)


def rank_groups(config: dict) -> list[list[int]]:
    """Ranks grouped by identical shapes, each group in rank order; the first rank of a group stands for it."""
    dist = config["dist"]
    world = dist["world_size"]
    if config["data"].get("source") is not None:  # each rank runs its own samples (vlmprobe.point.dataset_steps)
        return [[rank] for rank in range(world)]
    if dist["name"] in ("zero1", "zero2"):
        # one flat buffer cut into equal partitions: which parameters (and so which gradient temporaries of the
        # step) fall in a rank's partition differs from rank to rank, so each rank gets its own simulation
        return [[rank] for rank in range(world)]
    if dist["name"] != "fsdp2":  # ddp: whole model; zero3: every parameter cut into equal, padded pieces
        return [list(range(world))]
    shapes = parameter_shapes(config)
    groups: dict[tuple, list[int]] = {}
    for rank in range(world):
        groups.setdefault(shard_signature(shapes, rank, world), []).append(rank)
    return list(groups.values())


def simulate(config: dict, env: dict | None = None) -> dict[int, dict]:
    """Rank rows from one simulation per group of identical ranks on a fake process group. DeepSpeed keeps the
    process groups of its first initialize in module globals (deepspeed.utils.groups, deepspeed.comm's
    backend), which a later fake group cannot replace: each DeepSpeed rank is simulated in a child process
    (simulate_elsewhere); the estimate's torch engines run in this one. On cpu and cuda every rank runs in a
    child (forked on cpu; on cuda a fresh interpreter with `env`, whose CUDA context and allocator are its own),
    its notes saying what it leaves out (SIMULATED_NOTE)."""
    rows = {}
    backend = config["measure"]["backend"]
    measured = backend != "estimate"
    in_child = measured or config["dist"]["name"].startswith("zero")
    fork = child.FORKS and backend != "cuda"
    for group in rank_groups(config):
        row = simulate_elsewhere(config, group[0], fork, env) if in_child else simulate_rank(config, group[0])
        if measured:
            row["notes"] = "; ".join(n for n in (row.get("notes"), SIMULATED_NOTE) if n)
        for rank in group:
            rows[rank] = {**row, "simulated_as": group[0]}
    return rows


def simulate_elsewhere(config: dict, rank: int, fork: bool = child.FORKS, env: dict | None = None) -> dict:
    """simulate_rank in a child process, whose DeepSpeed has not run yet. On Linux it is forked from this one,
    outside any estimate session (the session's patches and modes are on only inside measure()), so torch,
    transformers and the model code need not be imported again. Elsewhere (macOS's system libraries are not safe
    to use in a forked child) it is a fresh `python -m vlmprobe.point.worker --simulate-rank RANK`, the point's
    config on stdin, in `env` (None: this process's environment)."""
    timeout = config["measure"]["timeout_s"]
    if fork:
        code, stdout, stderr = child.run_forked(lambda: print_row(simulate_rank(config, rank)), timeout)
    else:
        command = [sys.executable, "-m", "vlmprobe.point.worker", "--simulate-rank", str(rank)]
        code, stdout, stderr = child.run(command, json.dumps(config), env, timeout)
    if code is None:
        return {"status": Status.TIMEOUT, "error": f"rank {rank}'s simulation gave no result after {timeout} s"}
    row = last_row(stdout)
    if row is not None:
        return row
    return {"status": Status.CRASH,
            "error": f"rank {rank}'s simulation exited {code}; stderr tail: {stderr.strip()[-TAIL:]}"}


def point_row(rows: dict[int, dict], world_size: int, backend: str,
              failure: dict | None = None) -> tuple[dict, list[dict]]:
    """The point's outputs (every memory figure the max over ranks, and where the peak sits) and its rank
    rows, each labelled with `backend` (the one that ran the point: a rank that failed before its backend said
    so is labelled too). A rank that ran out of memory makes the point `oom`, named in its error; `failure`
    (the launcher's status and error, for ranks that left no row) applies when no rank says what went wrong."""
    rank_rows = [{"rank": r, "backend": backend, **{k: v for k, v in rows[r].items() if k in RANK_COLUMNS}}
                 for r in sorted(rows)]
    out: dict = {"backend": backend}
    bad = [r for r in rank_rows if r["status"] != Status.OK]
    oom = [r for r in bad if r["status"] == Status.OOM]
    first_bad = (oom or bad or [None])[0]
    if first_bad is not None:
        out.update(status=first_bad["status"], error=f"rank {first_bad['rank']}: {first_bad.get('error') or ''}")
    elif len(rows) < world_size:
        missing = sorted(set(range(world_size)) - set(rows))
        failure = failure or {"status": Status.CRASH, "error": "no result"}
        out.update(status=failure["status"], error=f"ranks {missing} left no row: {failure['error']}")
    else:
        out["status"] = Status.OK
    peaks = {r["rank"]: r["peak_allocated_bytes"] for r in rank_rows if r.get("peak_allocated_bytes") is not None}
    if peaks:
        top = max(peaks, key=lambda r: (peaks[r], -r))  # the lowest rank among equal peaks
        out.update({k: rows[top].get(k) for k in RANK_VALUE_COLUMNS})
        for column in RANK_VALUE_COLUMNS:
            values = [r[column] for r in rank_rows if isinstance(r.get(column), (int, float)) and not isinstance(r.get(column), bool)]
            if column.endswith("_bytes") or column in ("num_alloc_retries", "num_ooms", "step_time_s"):
                out[column] = max(values) if values else None
        low = min(peaks.values())
        out.update(max_rank=top, min_rank_peak_allocated_bytes=low,
                   rank_imbalance=round(peaks[top] / low, 4) if low else None)
    return out, rank_rows


def run_ranks(config: dict, env: dict) -> dict:
    """Outputs of a point with world_size ranks, with its rank rows under "ranks": simulated per group of
    identical ranks (estimate; cpu and cuda where dist.ranks says so, in `env`), or N real processes through
    torchrun (cpu: gloo, cuda: nccl)."""
    world = config["dist"]["world_size"]
    backend = config["measure"]["backend"]
    if backend == "estimate":
        rows, failure = simulate(config), None
    elif ranks_mode(config["dist"], backend, cuda.device_count) == "simulate":
        rows, failure = simulate(config, env), None
    else:
        rows, failure = launch(config, env, config["measure"]["timeout_s"])
        for row in rows.values():
            row["simulated_as"] = None  # measured, not simulated
    out, rank_rows = point_row(rows, world, config["measure"]["backend"], failure)
    return {**out, **gather_ranks(rows), "ranks": rank_rows}


class RankWriter:
    """ranks.csv beside results.csv: one row per point and rank, created with the first distributed point."""

    def __init__(self, out_dir: Path):
        self.path = out_dir / "ranks.csv"
        self.writer = RowWriter(self.path, RANK_COLUMNS, RANK_KEY) if self.path.exists() else None
        self.problems = self.writer.problems if self.writer else []  # rows a resume set aside (RowWriter)

    def append(self, point_id: str, rank_rows: list[dict]) -> None:
        if self.writer is None:
            self.writer = RowWriter(self.path, RANK_COLUMNS, RANK_KEY)
        for row in rank_rows:
            self.writer.append({"point_id": point_id, **row})
