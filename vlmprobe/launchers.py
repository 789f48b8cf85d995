"""Launchers (`launcher=`): how the points of a sweep are run. Whatever the launcher, the one sweep process
appends each row as its point finishes (vlmprobe.sweep.Runner), so resume, failed points and Ctrl-C mean
the same thing under every one; only the order of the rows differs.

- local: one point after another, in this process or in a worker as measure.isolate says (vlmprobe.sweep).
- pool: up to launcher.jobs points at once, each in a fresh `python -m vlmprobe.worker` (the protocol, the
  timeout and the failed rows of vlmprobe.sweep.call_worker). The threads here only wait on their worker;
  rows are written by the main thread alone, which is also the only one a Ctrl-C reaches: it then kills
  every running worker's process group and writes no row after it.
  A distributed point (dist != none) runs its ranks' simulations itself (some in processes of their own),
  so under pool it runs as under local: in this process, one at a time, once the pool's points are done.
"""

from __future__ import annotations

import concurrent.futures
import os

from vlmprobe.errors import ConfigError

NAMES = ("local", "pool")
POLL_S = 0.5  # how often the main thread wakes while waiting on the pool (a Ctrl-C is handled at once anyway)


def usable_cores() -> int:
    """Cores this process may run on (its affinity, as taskset or a container's cpuset limit it)."""
    return len(os.sched_getaffinity(0))


def jobs(launcher: dict) -> int:
    """How many points pool runs at once."""
    return launcher["jobs"] if launcher.get("jobs") is not None else usable_cores()


def check(launcher: dict, backend: str) -> None:
    """Refuse, in one line, a launcher that cannot run with this backend (the resolved one)."""
    name = launcher.get("name")
    if name not in NAMES:
        raise ConfigError(f"launcher.name={name!r} is not allowed: use one of {', '.join(NAMES)}")
    if name == "local":
        return
    count = launcher.get("jobs")
    if count is not None and (not isinstance(count, int) or isinstance(count, bool) or count < 1):
        raise ConfigError(f"launcher.jobs={count!r} is not allowed: give an integer >= 1 (points run at once), or "
                          f"null for the number of usable cores ({usable_cores()} here)")
    if backend == "cuda":
        # Two workers on one GPU would share its memory and each read the other's allocations into its
        # peaks: pool on CUDA needs one GPU per worker (CUDA_VISIBLE_DEVICES), not built yet
        raise ConfigError("launcher=pool is not allowed with backend cuda yet: pinning each worker to its own GPU "
                          "is not built; use launcher=local (or measure.backend=estimate)")


def check_points(launcher: dict, configs: list[dict]) -> None:
    """Refuse a launcher that cannot run these planned points (their composed configs)."""
    if launcher["name"] == "pool" and any(c["measure"]["isolate"] is False for c in configs):
        raise ConfigError("launcher=pool is not allowed with measure.isolate=false: pool runs every point in a "
                          "worker process of its own; use launcher=local")


def run_points(todo: list, runner, launcher: dict, bar) -> None:
    """Run the planned points `todo` (none of them with a row yet) through `runner`, updating `bar` as each
    finishes."""
    if launcher["name"] == "pool":
        in_pool = [item for item in todo if not item.skip and item.config["dist"]["name"] == "none"]
        _run_pool(in_pool, runner, jobs(launcher), bar)
        todo = [item for item in todo if item.point.id not in runner.done]  # skipped and distributed points
    for item in todo:
        bar.set_postfix_str(item.point.id)
        runner.run(item)
        bar.update(1)


def _run_pool(todo: list, runner, workers: int, bar) -> None:
    from vlmprobe import child, interrupt
    from vlmprobe.sweep import call_worker, worker_env

    if not todo:
        return
    children = child.Children()

    def run_one(item) -> dict:
        config = runner.with_snapshot_file(item)
        return call_worker(config, worker_env(config), config["measure"]["timeout_s"], children)

    pool = concurrent.futures.ThreadPoolExecutor(max_workers=min(workers, len(todo)),
                                                 thread_name_prefix="vlmprobe-pool")
    try:
        running = {pool.submit(run_one, item): item for item in todo}
        while running:
            bar.set_postfix_str(f"{min(workers, len(running))} running")
            finished, _ = concurrent.futures.wait(running, timeout=POLL_S,
                                                  return_when=concurrent.futures.FIRST_COMPLETED)
            for future in finished:
                item = running.pop(future)
                if interrupt.received():
                    raise KeyboardInterrupt  # a worker killed by the interruption is no result
                runner.record(item, future.result())
                bar.update(1)
    except BaseException:
        # Ctrl-C (or a failure here): the workers are in sessions of their own, out of the terminal's reach,
        # and would run on; end them, then wait for the threads (their communicate() returns once killed)
        children.kill()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
