"""Per rank: which ranks must be simulated, and how rank rows become the point's row and ranks.csv.

Ranks that hold the same tensor shapes allocate the same bytes, so the estimate simulates one rank of each
group of such ranks and gives its figures to every rank of the group. Under FSDP2 a rank's shapes are its
shards: dim 0 of every parameter split with torch.chunk (FSDP2's Shard(0)); the all-gather and reduce-
scatter buffers are padded to the largest chunk on every rank, while the optimizer state follows the
unpadded local shard, so uneven shards make ranks differ. DDP ranks all hold the whole model. The data
is the same synthetic batch on every rank. DeepSpeed ZeRO-3 cuts every parameter into equal padded pieces
(one group); ZeRO-1/2 cut one flat buffer, so each rank holds other parameters' pieces (a group each).
"""

from __future__ import annotations

import sys
from pathlib import Path

from vlmprobe import child
from vlmprobe.results import OUTPUT_COLUMNS, RowWriter

RANK_VALUE_COLUMNS = [c for c in OUTPUT_COLUMNS if c not in ("backend", "status", "error", "snapshot_file", "max_rank",
                                                             "min_rank_peak_allocated_bytes", "rank_imbalance")]
RANK_COLUMNS = ["point_id", "rank", "simulated_as", "backend", "status", *RANK_VALUE_COLUMNS, "error"]


def shard_signature(shapes: list[tuple[int, ...]], rank: int, world_size: int) -> tuple:
    """The dim-0 length of this rank's shard of each parameter, as torch.chunk splits it (a rank past the
    last chunk holds an empty shard)."""
    import math

    def length(rows: int) -> int:
        chunk = math.ceil(rows / world_size)  # torch.chunk's chunk size
        return max(0, min(chunk, rows - rank * chunk))

    return tuple(length(shape[0]) if shape else 0 for shape in shapes)


def parameter_shapes(config: dict) -> list[tuple[int, ...]]:
    """Shapes of the model's parameters (knobs applied), from the model built on the meta device."""
    import torch

    from vlmprobe.knobs import apply_knobs
    from vlmprobe.worker import DTYPES, build_spec

    spec = build_spec(config["model"])
    model = spec.build(torch.device("meta"), DTYPES[config["train"]["param_dtype"]], init=False)
    apply_knobs(spec, model, config["train"])
    return [tuple(p.shape) for p in model.parameters()]


def rank_groups(config: dict) -> list[list[int]]:
    """Ranks grouped by identical shapes, each group in rank order; the first rank of a group stands for it."""
    dist = config["dist"]
    world = dist["world_size"]
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


def simulate(config: dict, measure) -> dict[int, dict]:
    """Rank rows from one simulation per group of identical ranks on a fake process group; `measure(config)`
    is the worker's single-rank measurement. DeepSpeed keeps the process groups of its first initialize in
    module globals (deepspeed.utils.groups, deepspeed.comm's backend), which a later fake group cannot
    replace: each DeepSpeed rank is simulated in a child process (simulate_elsewhere); the torch engines run in
    this one."""
    rows = {}
    in_child = config["dist"]["name"].startswith("zero")
    for group in rank_groups(config):
        row = simulate_elsewhere(config, group[0]) if in_child else simulate_rank(config, group[0], measure)
        for rank in group:
            rows[rank] = {**row, "simulated_as": group[0]}
    return rows


def simulate_rank(config: dict, rank: int, measure) -> dict:
    """Rank `rank`'s row, simulated in this process on a fake group; a failure is an `error` row."""
    from vlmprobe.distributed.process_group import fake_group
    from vlmprobe.worker import error_row

    try:
        with fake_group(rank, config["dist"]["world_size"], "cpu", config["dist"]["ranks_per_node"]):  # fake tensors are CPU
            return measure(config)
    except Exception as exc:
        return error_row(exc)


def simulate_elsewhere(config: dict, rank: int, fork: bool = child.FORKS) -> dict:
    """simulate_rank in a child process, whose DeepSpeed has not run yet. On Linux it is forked from this one,
    outside any estimate session (the session's patches and modes are on only inside measure()): torch,
    transformers and the model code are imported already, where a fresh interpreter paid ~7 s of a Qwen2-VL-7B
    ZeRO-3 point importing them again. Elsewhere (macOS's system libraries are not safe to use in a forked
    child) it is a fresh `python -m vlmprobe.distributed.ranks RANK`, the point's config on stdin."""
    import json

    from vlmprobe.worker import TAIL, measure

    timeout = config["measure"]["timeout_s"]
    if fork:
        code, stdout, stderr = child.run_forked(lambda: print_row(simulate_rank(config, rank, measure)), timeout)
    else:
        command = [sys.executable, "-m", "vlmprobe.distributed.ranks", str(rank)]
        code, stdout, stderr = child.run(command, json.dumps(config), None, timeout)
    if code is None:
        return {"status": "timeout", "error": f"rank {rank}'s simulation gave no result after {timeout} s"}
    lines = [line for line in stdout.splitlines() if line.startswith(SIMULATED)]
    if lines:
        return json.loads(lines[-1][len(SIMULATED):])
    return {"status": "crash", "error": f"rank {rank}'s simulation exited {code}; stderr tail: {stderr.strip()[-TAIL:]}"}


def print_row(row: dict) -> None:
    """The simulated rank's row as the last line of stdout, where simulate_elsewhere finds it."""
    import json

    sys.stdout.write("\n" + SIMULATED + json.dumps(row) + "\n")
    sys.stdout.flush()


SIMULATED = "VLMPROBE_SIMULATED_RANK "  # prefix of the row line a simulation's child prints


def point_row(rows: dict[int, dict], world_size: int, backend: str,
              failure: dict | None = None) -> tuple[dict, list[dict]]:
    """The point's outputs (every memory figure the max over ranks, and where the peak sits) and its rank
    rows, each labelled with `backend` (the one that ran the point: a rank that failed before its backend said
    so is labelled too). A rank that ran out of memory makes the point `oom`, named in its error; `failure`
    (the launcher's status and error, for ranks that left no row) applies when no rank says what went wrong."""
    rank_rows = [{"rank": r, "backend": backend, **{k: v for k, v in rows[r].items() if k in RANK_COLUMNS}}
                 for r in sorted(rows)]
    out: dict = {"backend": backend}
    bad = [r for r in rank_rows if r["status"] != "ok"]
    oom = [r for r in bad if r["status"] == "oom"]
    first_bad = (oom or bad or [None])[0]
    if first_bad is not None:
        out.update(status=first_bad["status"], error=f"rank {first_bad['rank']}: {first_bad.get('error') or ''}")
    elif len(rows) < world_size:
        missing = sorted(set(range(world_size)) - set(rows))
        failure = failure or {"status": "crash", "error": "no result"}
        out.update(status=failure["status"], error=f"ranks {missing} left no row: {failure['error']}")
    else:
        out["status"] = "ok"
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


def measure_point(config: dict, measure, env: dict) -> dict:
    """Outputs of a point with world_size ranks, with its rank rows under "ranks": simulated per group of
    identical ranks (estimate), or N real processes through the launcher (cpu: gloo, cuda: nccl)."""
    world = config["dist"]["world_size"]
    if config["measure"]["backend"] == "estimate":
        rows, failure = simulate(config, measure), None
    else:
        from vlmprobe.distributed.launcher import launch

        rows, failure = launch(config, env, config["measure"]["timeout_s"])
        for row in rows.values():
            row["simulated_as"] = None  # measured, not simulated
    out, rank_rows = point_row(rows, world, config["measure"]["backend"], failure)
    return {**out, "ranks": rank_rows}


class RankWriter:
    """ranks.csv beside results.csv: one row per point and rank, created with the first distributed point."""

    def __init__(self, out_dir: Path):
        self.path = out_dir / "ranks.csv"
        self.writer = None

    def append(self, point_id: str, rank_rows: list[dict]) -> None:
        if self.writer is None:
            self.writer = RowWriter(self.path, RANK_COLUMNS)
        for row in rank_rows:
            self.writer.append({"point_id": point_id, **row})


def read_ranks(out_dir: Path):
    """ranks.csv of a results dir as a typed table, or None when the sweep had no distributed point."""
    from vlmprobe.results import read_table

    path = out_dir / "ranks.csv"
    return read_table(path) if path.is_file() else None


if __name__ == "__main__":  # simulate_elsewhere's fresh interpreter
    import json

    from vlmprobe.worker import measure

    print_row(simulate_rank(json.loads(sys.stdin.read()), int(sys.argv[1]), measure))
