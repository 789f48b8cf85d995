"""Launchers (`launcher=`): how the points of a sweep are run. Whatever the launcher, the one sweep process
appends each row as its point finishes (vlmprobe.sweep.Runner), so resume, failed points and Ctrl-C mean
the same thing under every one; only the order of the rows differs.

- auto (the default): pool where it runs points at once, local where it cannot (see `resolve`). Points that
  local measures in the sweep process (estimate, cpu) are measured there still, and the pool's workers help,
  each taking points only once it has started and leaving the last waiting point to the sweep process: a
  sweep over before a worker has imported torch runs as under local, a long one on every core.
- local: one point after another, in this process or in a worker as measure.isolate says (vlmprobe.sweep).
- pool: up to launcher.jobs points at once, in worker processes. A point that needs a fresh process
  (vlmprobe.sweep.isolated: cuda, or measure.isolate=true) gets one of its own (vlmprobe.sweep.call_worker);
  the others (estimate, cpu) are measured one after another by one long-lived worker per pool thread
  (vlmprobe.sweep.ServingWorker), as local measures them one after another in the sweep process: the
  start-up (importing torch and the model code, several seconds) is paid once per worker, not per point.
  Timeouts and failed rows are the same either way. The threads here only wait on their worker; rows are
  written by the main thread alone, which is also the only one a Ctrl-C reaches: it then kills every
  worker's process group and writes no row after it. On cuda each pool thread holds a GPU of its own and
  pins its workers to it (CUDA_VISIBLE_DEVICES): two workers on one GPU would read each other's
  allocations into their peaks.
  Under pool (and auto, for 3 points or more), the workers a sweep of estimate or cpu points will use are
  started before its points are planned (`prestart`): planning (composing and validating every point, each model built on the meta
  device; ~5 s for seq_len on a 2-core machine, most of it importing torch) runs in this process while they
  import torch and the model code on the other cores, so they are ready when the first point is.
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
# launcher=auto: the work left (seconds of this process alone) above which starting a worker pays. A worker
# costs S ~ 5 s before it helps on this 2-core machine (~2.5 s to import torch and say READY, ~2.5 s more for
# its first point than for the next: the first build's imports and dispatches), and two busy processes here
# each run at ~0.75 of one alone; W seconds of work then take ~0.5 S + W / 1.5 instead of W: a gain only
# past W = 1.5 S.
WORKER_PAYS_S = 7.5
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


def worker_modules(configs: list[dict]) -> tuple[str, ...]:
    """What a serving worker imports before it says READY: the model families of the points (a transformers
    family brings transformers' modeling code, ~5 s here; nanoVLM's own modules need none of it) and, for the
    estimate, torch._dynamo, which FakeTensorMode's first op imports (~2 s here)."""
    families = {config["model"]["_target_"].rpartition(".")[0] for config in configs}
    fake = any(config["measure"]["backend"] == "estimate" for config in configs)
    return tuple(sorted(families | ({"torch._dynamo"} if fake else set())))


class Prestarted:
    """Serving workers started before the points are planned (`prestart`); _run_pool takes them as its workers,
    and close() ends those it did not take (planning refused a value, a dry run, nothing left to run, Ctrl-C)."""

    def __init__(self, env: dict, modules: tuple[str, ...], count: int):
        from vlmprobe import child
        from vlmprobe.sweep import ServingWorker

        self.children = child.Children()
        self._lock = threading.Lock()
        self._workers = [ServingWorker(env, self.children, modules) for _ in range(count)]

    def take(self, env: dict):
        """A started worker of this environment (its allocator settings), while one is left; else None."""
        from vlmprobe.sweep import allocator_settings

        with self._lock:
            for worker in self._workers:
                if allocator_settings(worker.env) == allocator_settings(env):
                    self._workers.remove(worker)
                    return worker
        return None

    def close(self) -> None:
        with self._lock:
            workers, self._workers = self._workers, []
        for worker in workers:
            worker.close(kill=True)


def prestart(base: dict, backend: str, points: int) -> Prestarted | None:
    """Start now the workers that launcher=pool (or auto, beside this process) will run the `points` points of
    this command line with, where they are long-lived workers (estimate, cpu; one device each; not
    measure.isolate) and the points are a sweep, not a search; else None. The base config stands for the
    points: their environment and model family are its own unless an axis changes them, and a point whose
    differ gets a worker of its own as before."""
    from vlmprobe.sweep import isolated, worker_env

    launcher = base["launcher"]
    config = {**base, "measure": {**base["measure"], "backend": backend}}
    if (backend == "cuda" or base["dist"]["name"] != "none" or base.get("find") or isolated(config)
            or resolve(launcher, backend, points)["name"] != "pool"):
        return None
    if launcher["name"] == "auto" and points < 3:
        return None  # auto's workers leave the last waiting point to this process: with 2, a worker takes none
    count = min(jobs(launcher, backend), points) - (launcher["name"] == "auto")  # auto: this process is one
    return Prestarted(worker_env(config), worker_modules([config]), count) if count >= 1 else None


def run_points(todo: list, runner, launcher: dict, bar, started: Prestarted | None = None) -> None:
    """Run the planned points `todo` (none of them with a row yet) through `runner`, updating `bar` as each
    finishes; `started`: workers started for them before planning (prestart)."""
    from tqdm import tqdm

    from vlmprobe.sweep import isolated

    poolable = [item for item in todo if not item.skip and item.config["dist"]["name"] == "none"]
    backend = poolable[0].config["measure"]["backend"] if poolable else "estimate"
    inline = False  # whether this process measures points too, beside the pool's workers (launcher=auto)
    if launcher["name"] == "auto":
        launcher = resolve(launcher, backend, len(poolable))
        # Points that local would measure in this process (estimate, cpu) are measured here as under local,
        # and the pool's workers only help: each takes points once it has started (imported torch, several
        # seconds), so a sweep that ends sooner than that never waits for one and auto is never slower than
        # local. On cuda every point needs a GPU of its own pinned to a worker: pool as it is.
        inline = launcher["name"] == "pool" and backend != "cuda" and not isolated(poolable[0].config)
        slots = min(jobs(launcher, backend), len(poolable))
        how = ("local" if launcher["name"] == "local" else
               f"pool: this process and {slots - 1} worker process{'es' * (slots > 2)} taking points once started"
               if inline else f"pool of {slots} workers")
        tqdm.write(f"vlmprobe: launcher=auto runs the points with launcher={how} (backend {backend}, "
                   f"{usable_cores()} usable cores)", file=sys.stderr)
    if launcher["name"] == "submitit":
        _run_submitit([item for item in todo if not item.skip], runner, launcher, bar)
    elif launcher["name"] == "pool":
        gpus = visible_gpus() if backend == "cuda" else None
        _run_pool(poolable, runner, jobs(launcher, backend), bar, gpus, inline, started)
    todo = [item for item in todo if item.point.id not in runner.done]  # skipped (and, under pool, distributed)
    for item in todo:
        bar.set_postfix_str(item.point.id)
        runner.run(item)
        bar.update(1)


def _run_pool(todo: list, runner, workers: int, bar, gpus: list[str] | None, inline: bool = False,
              started: Prestarted | None = None) -> None:
    """Run `todo` `workers` at a time. Pool threads each take the next point from one queue and wait on a worker
    for it; this (main) thread records their rows. With `inline` (launcher=auto), this thread is one of the
    `workers` and measures points itself between recording rows; the pool threads start once its first point
    has run for WORKER_PAYS_S, or once one of its points says the points still waiting would take it longer
    than that, and each takes points only once its long-lived worker has started."""
    from tqdm import tqdm

    from vlmprobe import child, interrupt
    from vlmprobe.sweep import ServingWorker, allocator_settings, call_worker, isolated, worker_env
    from vlmprobe.worker import error_row

    if not todo:
        return
    children = started.children if started is not None else child.Children()
    free_gpus: queue.Queue | None = None
    if gpus is not None:
        free_gpus = queue.Queue()
        for gpu in gpus[:workers]:
            free_gpus.put(gpu)
    waiting: queue.Queue = queue.Queue()  # points no one has taken yet
    for item in todo:
        waiting.put(item)
    taking = threading.Lock()  # one taker at a time: what waits and what is taken agree
    finished: queue.Queue = queue.Queue()  # (point, outputs) from the pool threads, for this thread to record
    stop = threading.Event()  # set on Ctrl-C (or a failure here): pool threads take no more points
    mine = threading.local()  # each pool thread's GPU (it keeps it: there are no more threads than GPUs) and worker
    serving: list = []  # every ServingWorker started, to end at the close

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
            current = started.take(env) if started is not None else None
            if current is None:
                current = ServingWorker(env, children, worker_modules([item.config for item in todo]))
            mine.worker = current
            serving.append(current)
        return current

    def run_one(item) -> dict:
        config = runner.with_snapshot_file(item)
        env, timeout = env_of(config), config["measure"]["timeout_s"]
        if isolated(config):  # cuda, or measure.isolate=true: a fresh process for this point alone
            return call_worker(config, env, timeout, children)
        return serving_worker(env).call(config, timeout)

    def take(leave: int = 0):
        """The next point no one has taken, if more than `leave` wait; else None."""
        with taking:
            return waiting.get_nowait() if waiting.qsize() > leave else None

    def pool_thread() -> None:
        if inline:
            started = serving_worker(env_of(todo[0].config))
            if not started.wait_ready(stop):
                if not stop.is_set():  # died starting: this process and the other workers take its share
                    tqdm.write(f"vlmprobe: a pool worker could not start; stderr tail: {started.stderr_tail()}",
                               file=sys.stderr)
                return
        # inline, a worker leaves the last waiting point to this process, which has run points already: a
        # worker's first point also pays its first build (imports, first dispatches, ~3 s more than the next)
        while not stop.is_set() and (item := take(leave=1 if inline else 0)) is not None:
            try:
                outputs = run_one(item)
            except Exception as exc:  # a fault of the pool's own, not of the point: still that point's row
                outputs = error_row(exc)
            finished.put((item, outputs))

    threads = [threading.Thread(target=pool_thread, name=f"vlmprobe-pool-{i}", daemon=True)
               for i in range(min(workers, len(todo)) - inline)]
    helping = threading.Event()  # set once the pool threads run: under inline, once the points left are worth it
    starting = threading.Lock()

    def start_helpers() -> None:
        with starting:
            if not helping.is_set() and not stop.is_set() and waiting.qsize():
                helping.set()
                for thread in threads:
                    thread.start()

    def end_threads() -> None:
        """Wait for the pool threads, if they started (`stop` is set by now: none starts after this)."""
        slow_first.cancel()
        with starting:
            started = helping.is_set()
        for thread in threads if started else ():
            thread.join()

    # inline: this process's first point takes the longest (the first build); one still running after
    # WORKER_PAYS_S says the points are worth a worker's start. Workers started before planning have paid it.
    slow_first = threading.Timer(WORKER_PAYS_S, start_helpers)
    if inline and started is None:
        slow_first.start()
    else:
        start_helpers()
    left = len(todo)
    try:
        while left:
            bar.set_postfix_str(f"{sum(t.is_alive() for t in threads) + inline} running")
            try:  # the rows waiting to be written first; then (inline) a point of this thread's own
                item, outputs = finished.get_nowait()
            except queue.Empty:
                own = take() if inline else None
                if own is not None:
                    began = time.perf_counter()
                    runner.run(own)
                    bar.update(1)
                    left -= 1
                    slow_first.cancel()
                    # workers only where the points left would keep this process longer than one takes to help
                    if waiting.qsize() * (time.perf_counter() - began) > WORKER_PAYS_S:
                        start_helpers()
                    continue
                try:
                    item, outputs = finished.get(timeout=POLL_S)
                except queue.Empty:
                    continue
            if interrupt.received():
                raise KeyboardInterrupt  # a worker killed by the interruption is no result
            runner.record(item, outputs)
            bar.update(1)
            left -= 1
    except BaseException:
        # Ctrl-C (or a failure here): the workers are in sessions of their own, out of the terminal's reach,
        # and would run on; end them, then wait for the threads (a call returns once its worker is killed)
        stop.set()
        children.kill()
        end_threads()
        raise
    stop.set()  # a pool thread still waiting for its worker to start takes nothing now
    end_threads()
    for worker in serving:
        # every row is in: no worker has anything left to finish (one still importing never had), and killing
        # spares the sweep each one's interpreter teardown, one after another (~1 s each here)
        worker.close(kill=worker.alive())


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
