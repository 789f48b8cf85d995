"""Launchers (`launcher=`): how the points of a sweep are run. Whatever the launcher, the one sweep process
appends each row as its point finishes (vlmprobe.run.sweep.Runner), so resume, failed points and Ctrl-C mean
the same thing under every one; only the order of the rows differs.

- auto (the default): pool where it runs points at once, local where it cannot (see `resolve`).
- local: one point after another, in this process or in a worker as measure.isolate says (vlmprobe.run.sweep).
- pool: up to launcher.jobs points at once, in worker processes (vlmprobe.run.pool). Its long-lived workers are
  forked from the sweep process once its points are planned: planning has imported torch and the model code, so a
  worker starts in milliseconds instead of importing them again. A distributed point (dist != none) runs its
  ranks' simulations (or, on cuda, torchrun over the visible GPUs) itself, so under pool it runs as under local:
  in this process, one at a time, once the pool's points are done.
- submitit: points as jobs of a SLURM array (vlmprobe.run.slurm).
"""

from __future__ import annotations

import os
import sys

from tqdm.auto import tqdm

from vlmprobe import child
from vlmprobe.backends import cuda
from vlmprobe.errors import ConfigError
from vlmprobe.results import report
from vlmprobe.run.pool import Pool
from vlmprobe.run.slurm import check_submitit, run_submitit
from vlmprobe.run.sweep import Runner

__all__ = ["NAMES", "check", "jobs", "resolve", "run_sweep", "usable_cores", "visible_gpus"]

NAMES = ("auto", "local", "pool", "submitit")


def usable_cores() -> int:
    """Cores this process may run on (its affinity, as taskset or a container's cpuset limit it)."""
    return len(os.sched_getaffinity(0))


def visible_gpus() -> list[str]:
    """The GPUs a pool worker can be pinned to, as CUDA_VISIBLE_DEVICES names them: the entries of this
    process's own CUDA_VISIBLE_DEVICES (indices or UUIDs) where it is set, else the driver's indices."""
    count = cuda.device_count()
    given = [g.strip() for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    return given[:count] if given else [str(i) for i in range(count)]


def jobs(launcher: dict, backend: str = "estimate") -> int:
    """How many points pool runs at once: launcher.jobs, or one per core (estimate, cpu) or GPU (cuda)."""
    if launcher.get("jobs") is not None:
        return launcher["jobs"]
    return len(visible_gpus()) if backend == "cuda" else usable_cores()


def check(launcher: dict, backend: str) -> None:
    """Refuse, in one line, a launcher that cannot run with this backend (the resolved one)."""
    name = launcher.get("name")
    if name not in NAMES:
        raise ConfigError(f"launcher.name={name!r} is not allowed: use one of {', '.join(NAMES)}")
    if name == "pool":
        check_pool(launcher, backend)
    elif name == "auto":
        check_jobs(launcher)
    elif name == "submitit":
        check_submitit(launcher)


def check_jobs(launcher: dict) -> None:
    count = launcher.get("jobs")
    if count is not None and (not isinstance(count, int) or isinstance(count, bool) or count < 1):
        raise ConfigError(f"launcher.jobs={count!r} is not allowed: give an integer >= 1 (points run at once), or "
                          f"null for the number of usable cores ({usable_cores()} here) or, on cuda, of GPUs")


def check_pool(launcher: dict, backend: str) -> None:
    check_jobs(launcher)
    count = launcher.get("jobs")
    if backend == "cuda":
        gpus = visible_gpus()
        if not gpus:
            raise ConfigError("launcher=pool is not allowed with backend cuda here: no CUDA GPU is visible")
        if count is not None and count > len(gpus):
            raise ConfigError(f"launcher.jobs={count} is not allowed with backend cuda: each worker needs a GPU of "
                              f"its own and {len(gpus)} are visible ({','.join(gpus)}); give at most {len(gpus)} "
                              f"or null")


def resolve(launcher: dict, backend: str, points: int) -> dict:
    """What launcher=auto runs `points` points of `backend` with (any other launcher: itself): pool where
    more than one can run at once (estimate, cpu: at least 2 usable cores; cuda: at least 2 visible GPUs) and
    there are at least 2 to run, else local. Pool's workers are long-lived for estimate and cpu
    (vlmprobe.run.workers.ServingWorker), so their start-up is paid once per core, not per point."""
    if launcher["name"] != "auto":
        return launcher
    slots = jobs(launcher, backend)
    if backend == "cuda":
        slots = min(slots, len(visible_gpus()))
    return {**launcher, "name": "pool"} if min(slots, points) >= 2 else {**launcher, "name": "local"}


def run_sweep(planned: list, runner: Runner, launcher: dict | None = None) -> None:
    """Run every planned point that has no row yet, with a progress bar, through the launcher (None:
    launcher=local)."""
    todo = [p for p in planned if p.point.id not in runner.done]
    if len(todo) < len(planned):
        tqdm.write(f"resume: {len(planned) - len(todo)} of {len(planned)} points already have rows", file=sys.stderr)
    # on a terminal a bar; elsewhere (CI, a log file) only the line each finished point writes
    bar = tqdm(total=len(todo), desc="points", unit="point", dynamic_ncols=True, disable=not sys.stderr.isatty())
    try:
        run_points(todo, runner, launcher or {"name": "local"}, bar)
    finally:
        bar.close()


def run_points(todo: list, runner: Runner, launcher: dict, bar) -> None:
    """Run the planned points `todo` (none of them with a row yet) through `runner`, updating `bar` as each
    finishes."""
    poolable = [item for item in todo if not item.skip and item.config["dist"]["name"] == "none"]
    backend = poolable[0].config["measure"]["backend"] if poolable else "estimate"
    if launcher["name"] == "auto":
        launcher = resolve(launcher, backend, len(poolable))
        how = "local" if launcher["name"] == "local" else f"pool of {min(jobs(launcher, backend), len(poolable))} workers"
        tqdm.write(f"vlmprobe: launcher=auto runs the points with launcher={how} (backend {backend}, "
                   f"{usable_cores()} usable cores)", file=sys.stderr)
    if launcher["name"] == "submitit":
        run_submitit([item for item in todo if not item.skip], runner, launcher, bar)
    elif launcher["name"] == "pool":
        gpus = visible_gpus() if backend == "cuda" else None
        Pool(poolable, runner, jobs(launcher, backend), bar, gpus).run()
    todo = [item for item in todo if item.point.id not in runner.done]  # skipped (and, under pool, distributed)
    if todo:  # a point whose ranks are simulated in forked children leaves this process waiting meanwhile
        child.while_waiting(report.pyplot)
    for item in todo:
        bar.set_postfix_str(item.point.id)
        runner.run(item)
        bar.update(1)
