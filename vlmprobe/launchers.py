"""Launchers (`launcher=`): how the points of a sweep are run. Whatever the launcher, the one sweep process
appends each row as its point finishes (vlmprobe.sweep.Runner), so resume, failed points and Ctrl-C mean
the same thing under every one; only the order of the rows differs.

- auto (the default): pool where it runs points at once, local where it cannot (see `resolve`).
- local: one point after another, in this process or in a worker as measure.isolate says (vlmprobe.sweep).
- pool: up to launcher.jobs points at once, in worker processes. A point that needs a fresh process
  (vlmprobe.sweep.isolated: cuda, or measure.isolate=true) gets one of its own (vlmprobe.sweep.call_worker);
  the others (estimate, cpu) are measured one after another by one long-lived worker per pool thread
  (vlmprobe.sweep.ServingWorker), as local measures them one after another in the sweep process. Those
  workers are forked from the sweep process once its points are planned: planning has imported torch and
  the model code (built on the meta device), so a worker starts in milliseconds instead of importing them
  again (~4 s on a 2-core machine). A fork copies the process as it stands, so no worker is forked while
  anything in the sweep process is inside a point (its tracker's and fake tensors' patches of torch would be
  copied half applied) or holds a lock: the sweep process measures none while the pool runs, and its main
  thread forks every worker, the first ones before the pool threads start, a replacement (its worker died or
  timed out) between two rows. Timeouts and failed rows are the same either way. The threads here only wait
  on their worker; rows are written by the main thread alone, which is also the only one a Ctrl-C reaches: it
  then kills every worker's process group and writes no row after it. On cuda each pool thread holds a GPU of
  its own and pins its workers to it (CUDA_VISIBLE_DEVICES): two workers on one GPU would read each other's
  allocations into their peaks.
  A distributed point (dist != none) runs its ranks' simulations (or, on cuda, torchrun over the visible
  GPUs) itself, so under pool it runs as under local: in this process, one at a time, once the pool's
  points are done.
- submitit: points run as jobs of a SLURM array through submitit (what Hydra's submitit launcher runs on);
  each job runs launcher.points_per_job points one after another exactly as local runs them (vlmprobe.sweep
  .run_point: a fresh worker per point on cuda). The job notes each point's outputs in a file as it
  finishes, so a job killed half way (time limit, node lost, scancel) loses no finished point: the sweep
  takes them from there, and the job's unfinished points become `crash` rows saying what happened.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import tempfile
import threading
import time
from pathlib import Path

from vlmprobe.errors import ConfigError

NAMES = ("auto", "local", "pool", "submitit")
POLL_S = 0.5  # how often the main thread wakes while waiting on the pool (a Ctrl-C is handled at once anyway)


def usable_cores() -> int:
    """Cores this process may run on (its affinity, as taskset or a container's cpuset limit it)."""
    return len(os.sched_getaffinity(0))


def visible_gpus() -> list[str]:
    """The GPUs a pool worker can be pinned to, as CUDA_VISIBLE_DEVICES names them: the entries of this
    process's own CUDA_VISIBLE_DEVICES (indices or UUIDs) where it is set, else the driver's indices."""
    from vlmprobe.backends import cuda

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
    (vlmprobe.sweep.ServingWorker), so their start-up is paid once per core, not per point."""
    if launcher["name"] != "auto":
        return launcher
    slots = jobs(launcher, backend)
    if backend == "cuda":
        slots = min(slots, len(visible_gpus()))
    return {**launcher, "name": "pool"} if min(slots, points) >= 2 else {**launcher, "name": "local"}


def run_points(todo: list, runner, launcher: dict, bar) -> None:
    """Run the planned points `todo` (none of them with a row yet) through `runner`, updating `bar` as each
    finishes."""
    from tqdm import tqdm

    poolable = [item for item in todo if not item.skip and item.config["dist"]["name"] == "none"]
    backend = poolable[0].config["measure"]["backend"] if poolable else "estimate"
    if launcher["name"] == "auto":
        launcher = resolve(launcher, backend, len(poolable))
        how = "local" if launcher["name"] == "local" else f"pool of {min(jobs(launcher, backend), len(poolable))} workers"
        tqdm.write(f"vlmprobe: launcher=auto runs the points with launcher={how} (backend {backend}, "
                   f"{usable_cores()} usable cores)", file=sys.stderr)
    if launcher["name"] == "submitit":
        _run_submitit([item for item in todo if not item.skip], runner, launcher, bar)
    elif launcher["name"] == "pool":
        gpus = visible_gpus() if backend == "cuda" else None
        _run_pool(poolable, runner, jobs(launcher, backend), bar, gpus)
    todo = [item for item in todo if item.point.id not in runner.done]  # skipped (and, under pool, distributed)
    if todo:  # a point whose ranks are simulated in forked children leaves this process waiting meanwhile
        from vlmprobe import child, report

        child.while_waiting(report.pyplot)
    for item in todo:
        bar.set_postfix_str(item.point.id)
        runner.run(item)
        bar.update(1)


def _run_pool(todo: list, runner, workers: int, bar, gpus: list[str] | None) -> None:
    """Run `todo` `workers` at a time. Pool threads each take the next point from one queue and wait on a worker
    for it; this (main) thread records their rows and forks the long-lived workers (module doc): the first ones
    before any pool thread starts, a replacement when a pool thread asks for one (its worker died or timed out),
    between two rows. So no other thread of this process is inside anything but a wait when one is forked."""
    from vlmprobe import child, interrupt, report
    from vlmprobe.sweep import ServingWorker, allocator_settings, call_worker, isolated, worker_env
    from vlmprobe.worker import error_row

    if not todo:
        return
    children = child.Children()
    free_gpus: queue.Queue | None = None
    if gpus is not None:
        free_gpus = queue.Queue()
        for gpu in gpus[:workers]:
            free_gpus.put(gpu)
    waiting: queue.Queue = queue.Queue()  # points no one has taken yet
    for item in todo:
        waiting.put(item)
    # for this thread, from the pool threads: ("row", point, outputs), or ("fork", env, where to put the worker)
    asks: queue.Queue = queue.Queue()
    stop = threading.Event()  # set on Ctrl-C (or a failure here): pool threads take no more points
    mine = threading.local()  # each pool thread's GPU (it keeps it: there are no more threads than GPUs) and worker
    count = min(workers, len(todo))
    serving: list = []  # every ServingWorker started, to end at the close
    if gpus is None and not isolated(todo[0].config):
        serving.extend(ServingWorker(worker_env(todo[0].config), children) for _ in range(count))
    first = list(serving)  # one for each pool thread to take
    taking = threading.Lock()  # one thread at a time takes a point or a first worker

    def env_of(config: dict) -> dict:
        env = worker_env(config)
        if free_gpus is None:
            return env
        if not hasattr(mine, "gpu"):
            mine.gpu = free_gpus.get_nowait()
        return {**env, "CUDA_VISIBLE_DEVICES": mine.gpu}

    def serving_worker(env: dict):
        """This thread's worker, started anew when it has ended or the point needs another environment (its
        allocator settings)."""
        current = getattr(mine, "worker", None)
        if current is None or allocator_settings(current.env) != allocator_settings(env) or not current.alive():
            if current is not None:
                current.close()
            with taking:
                current = next((w for w in first if allocator_settings(w.env) == allocator_settings(env)), None)
                if current is not None:
                    first.remove(current)
            if current is None:
                made: queue.Queue = queue.Queue()
                asks.put(("fork", env, made))
                while current is None:
                    try:
                        current = made.get(timeout=POLL_S)
                    except queue.Empty:
                        if stop.is_set():
                            raise RuntimeError("the pool stopped before a worker was made for this point") from None
            mine.worker = current
        return current

    def run_one(item) -> dict:
        config = runner.with_snapshot_file(item)
        env, timeout = env_of(config), config["measure"]["timeout_s"]
        if isolated(config):  # cuda, or measure.isolate=true: a fresh process for this point alone
            return call_worker(config, env, timeout, children)
        return serving_worker(env).call(config, timeout)

    def take():
        with taking:
            return waiting.get_nowait() if waiting.qsize() else None

    def pool_thread() -> None:
        while not stop.is_set() and (item := take()) is not None:
            try:
                outputs = run_one(item)
            except Exception as exc:  # a fault of the pool's own, not of the point: still that point's row
                outputs = error_row(exc)
            asks.put(("row", item, outputs))

    threads = [threading.Thread(target=pool_thread, name=f"vlmprobe-pool-{i}", daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    # This thread only records rows from here on: the report's plotting library is imported meanwhile, not
    # after the last row. A fork waits for that import to end: a child copies a half-made module otherwise
    importing = threading.Thread(target=report.pyplot, name="vlmprobe-import-pyplot", daemon=True)
    importing.start()
    left = len(todo)
    try:
        while left:
            bar.set_postfix_str(f"{sum(t.is_alive() for t in threads)} running")
            try:
                ask = asks.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if ask[0] == "fork":
                _, env, made = ask
                importing.join()
                worker = ServingWorker(env, children)
                serving.append(worker)
                made.put(worker)
                continue
            if interrupt.received():
                raise KeyboardInterrupt  # a worker killed by the interruption is no result
            _, item, outputs = ask
            runner.record(item, outputs)
            bar.update(1)
            left -= 1
    except BaseException:
        # Ctrl-C (or a failure here): the workers are in sessions of their own, out of the terminal's reach,
        # and would run on; end them, then wait for the threads (a call returns once its worker is killed; a
        # thread waiting for a worker to be made gives up)
        stop.set()
        children.kill()
        for thread in threads:
            thread.join()
        raise
    stop.set()
    for thread in threads:
        thread.join()
    importing.join()  # the distributed points run next may fork (ranks.simulate_elsewhere): not mid-import
    for worker in serving:
        # every row is in: no worker has anything left to finish, and killing spares the sweep each one's
        # interpreter teardown
        worker.close()


def executor(launcher: dict, folder: Path):
    """submitit's AutoExecutor for launcher=submitit, with its parameters set; submitit checks each one."""
    try:
        import submitit
    except ImportError:
        raise ConfigError("launcher=submitit is not allowed here: the submitit package is not installed; install it "
                          "with `pip install submitit` (or `pip install -e \".[slurm]\"`)") from None
    cluster = launcher.get("cluster")
    if cluster not in ("slurm", "local"):
        raise ConfigError(f"launcher.cluster={cluster!r} is not allowed: use slurm (sbatch on this cluster) or local "
                          f"(jobs as processes on this machine)")
    try:
        made = submitit.AutoExecutor(folder=folder, cluster=cluster)
    except RuntimeError as exc:  # no srun / sbatch: not on a SLURM cluster
        raise ConfigError(f"launcher.cluster=slurm is not allowed here: submitit says: {exc}; use "
                          f"launcher.cluster=local to run the jobs on this machine") from None
    set_parameters(made, launcher.get("parameters") or {})
    return made


def set_parameters(made, parameters: dict) -> None:
    try:
        made.update_parameters(**parameters)
    except (NameError, AssertionError, ValueError, TypeError) as exc:
        said = " ".join(str(exc).split())
        raise ConfigError(f"launcher.parameters={parameters} is not allowed: submitit says: {said}") from None


def check_submitit(launcher: dict) -> None:
    """Every submitit option, checked before anything runs: the package, the cluster, the parameters (by
    submitit itself: any of its executors knows every cluster's parameter names)."""
    per_job = launcher.get("points_per_job")
    if not isinstance(per_job, int) or isinstance(per_job, bool) or per_job < 1:
        raise ConfigError(f"launcher.points_per_job={per_job!r} is not allowed: give an integer >= 1")
    with tempfile.TemporaryDirectory() as tmp:
        executor(launcher, Path(tmp))  # refuses an unknown cluster, slurm off a SLURM cluster, a bad parameter


def run_job(configs: list[dict], progress: str) -> list[dict]:
    """What a submitit job runs: its points one after another as launcher=local runs them, each one's outputs
    appended to `progress` (a JSON line) as soon as it finishes."""
    from vlmprobe.sweep import run_point

    outputs = []
    for config in configs:
        outputs.append(run_point(config))
        with open(progress, "a") as f:
            f.write(json.dumps(outputs[-1]) + "\n")
    return outputs


def finished_in(progress: Path) -> list[dict]:
    """The outputs a job noted before it ended (a line cut short by the kill is not one)."""
    if not progress.exists():
        return []
    noted = []
    for line in progress.read_text().splitlines():
        try:
            noted.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return noted


def _run_submitit(todo: list, runner, launcher: dict, bar) -> None:
    from vlmprobe import interrupt

    if not todo:
        return
    folder = Path(launcher.get("folder") or runner.out_dir / "submitit")
    made = executor(launcher, folder)
    per_job = launcher["points_per_job"]
    groups = [todo[i:i + per_job] for i in range(0, len(todo), per_job)]
    (folder / "progress").mkdir(parents=True, exist_ok=True)
    stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"  # a resumed sweep's jobs write files of their own
    progress = [folder / "progress" / f"{stamp}-{i}.jsonl" for i in range(len(groups))]
    with made.batch():  # one SLURM array for the whole sweep
        submitted = [made.submit(run_job, [runner.with_snapshot_file(item) for item in group], str(path))
                     for group, path in zip(groups, progress)]
    pending = dict(zip(submitted, zip(groups, progress)))
    bar.set_postfix_str(f"{len(submitted)} jobs submitted to {folder}")
    try:
        while pending:
            for job in [j for j in pending if j.done()]:
                group, path = pending.pop(job)
                try:
                    outputs = job.result()
                except Exception as exc:  # killed, timed out, node lost, or the job itself failed
                    outputs = finished_in(path)
                    lost = f"submitit job {job.job_id} ended before this point finished: {' '.join(str(exc).split())[:1500]}"
                    outputs += [{"status": "crash", "error": lost}] * (len(group) - len(outputs))
                for item, out in zip(group, outputs):
                    runner.record(item, out)
                    bar.update(1)
            if interrupt.received():
                raise KeyboardInterrupt
            if pending:
                time.sleep(launcher.get("poll_s") or POLL_S)
    except BaseException:
        for job in pending:  # Ctrl-C: the jobs would run on in the queue, with no sweep to take their rows
            job.cancel(check=False)
        raise
