"""Launchers (`launcher=local|pool|submitit`): pool runs points at once in worker processes and gives the rows
local gives, one GPU per worker on cuda; submitit jobs give them too and a killed job loses no finished point;
a failed point is a row; a distributed point runs in the sweep process; Ctrl-C ends every worker,
keeps every finished row, says so in one line, and the printed command resumes the sweep to its end."""

import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import pytest

from conftest import REPO, run_cli
from vlmprobe import child
from vlmprobe.cli import main
from vlmprobe.errors import ConfigError
from vlmprobe.run import launchers
from vlmprobe.run import workers as worker_processes
from vlmprobe.run.pool import Pool

SMOKE = ["+sweep=smoke", "measure.backend=estimate", "measure.steps=1"]  # 4 points of the tiny nanoVLM
POOL = ["launcher=pool", "launcher.jobs=2"]
ENV = {"PYTHONPATH": str(REPO)}


def table(out_dir: Path) -> pd.DataFrame:
    rows = pd.read_parquet(out_dir / "results.parquet").drop(columns=["step_time_s"])  # a wall time
    return rows.sort_values("point_id").reset_index(drop=True)


def results_dir(root: Path) -> Path:
    (found,) = [p for p in root.glob("*/*") if p.is_dir()]
    return found


@pytest.mark.slow  # ~5 s here (~40 s before forked workers); CI keeps pool through the Ctrl-C test and launcher == local rows through submitit's
def test_pool_gives_the_rows_local_gives(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main([*SMOKE, "launcher=local", f"results_dir={tmp_path / 'local'}"]) == 0
    capsys.readouterr()
    proc = run_cli([*SMOKE, *POOL, f"results_dir={tmp_path / 'pool'}"], cwd=tmp_path, env_extra=ENV)
    assert proc.returncode == 0, proc.stderr
    pooled = table(results_dir(tmp_path / "pool"))
    assert len(pooled) == 4 and set(pooled["status"]) == {"ok"}
    pd.testing.assert_frame_equal(pooled, table(results_dir(tmp_path / "local")))


def test_under_pool_a_failed_point_is_a_row_and_a_distributed_point_runs_in_the_sweep(tmp_path):
    # 1 ms is too short for any point to be measured, even by a forked worker that imports nothing: it times out;
    # the other pool point is ok, and the FSDP2 points (in the sweep process, where no timeout applies) are ok too
    proc = run_cli([*SMOKE, *POOL, "sweep.axes.data.batch_size=[1]", "sweep.axes.data.lm_max_length=[32]",
                    "+sweep.axes.dist=[none,fsdp2]", "+sweep.axes.measure.timeout_s=[0.001,600]",
                    f"results_dir={tmp_path}"], cwd=tmp_path, env_extra=ENV)
    assert proc.returncode == 0, proc.stderr
    rows = pd.read_parquet(results_dir(tmp_path) / "results.parquet")
    status = {(r.dist, r.point_id.endswith("timeout_s=0.001")): r.status for r in rows.itertuples()}
    assert status == {("none", True): "timeout", ("none", False): "ok", ("fsdp2", True): "ok", ("fsdp2", False): "ok"}


def processes() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, session id) of every process on this machine, from /proc."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()  # after "pid (comm)", which may hold spaces
        except OSError:  # ended meanwhile
            continue
        if fields[0] != "Z":  # a zombie has ended; only its parent's wait is missing
            found[int(stat.parent.name)] = (int(fields[1]), int(fields[3]))
    return found


def pool_sweep_with_a_row_and_running_workers(tmp_path) -> tuple[subprocess.Popen, set[int]]:
    """A smoke sweep under launcher=pool, caught at a moment with a finished row and its workers still running."""
    proc = subprocess.Popen([sys.executable, "-m", "vlmprobe", *SMOKE, *POOL, f"results_dir={tmp_path}"],
                            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **ENV})
    deadline, workers = time.time() + 240, set()
    while time.time() < deadline and proc.poll() is None:  # wait for a finished row while workers still run
        csv = list(tmp_path.glob("smoke/*/results.csv"))
        workers = {pid for pid, (parent, _) in processes().items() if parent == proc.pid}
        if csv and len(csv[0].read_text().splitlines()) >= 2 and workers:
            break
        time.sleep(0.1)
    assert workers and proc.poll() is None, "no moment with a finished row and a running worker"
    return proc, workers


@pytest.mark.parametrize("signum,code,said", [pytest.param(signal.SIGINT, 130, "interrupted", marks=pytest.mark.slow),
                                              (signal.SIGTERM, 143, "interrupted by SIGTERM")])
def test_ctrl_c_or_sigterm_during_a_pool_sweep_ends_every_worker_keeps_the_rows_and_resumes(tmp_path, signum, code,
                                                                                          said):
    # SIGTERM is what SLURM (scancel, a time limit), Kubernetes and `kill` send first: the same as Ctrl-C
    proc, workers = pool_sweep_with_a_row_and_running_workers(tmp_path)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code and "Traceback" not in err, err

    out_dir = results_dir(tmp_path)
    kept = len(pd.read_csv(out_dir / "results.csv"))
    assert (out_dir / "summary.md").is_file()  # the tables are made from the rows kept
    line = err.strip().splitlines()[-1]
    assert 1 <= kept < 4 and line.startswith(f"vlmprobe: {said}: {kept} rows kept in {out_dir / 'results.csv'}; "
                                             f"resume with: python -m vlmprobe "), err
    # every worker and whatever it started (its session) has ended, not merely lost its parent
    left = [pid for pid, (_, session) in processes().items() if pid in workers or session in workers]
    assert not left, left

    resume = shlex.split(line.partition("; resume with: ")[2])
    done = run_cli(resume[3:], cwd=tmp_path, env_extra=ENV)
    assert done.returncode == 0, done.stderr
    assert f"resume: {kept} of 4 points already have rows" in done.stderr
    rows = pd.read_parquet(out_dir / "results.parquet")
    assert len(rows) == 4 and rows["point_id"].is_unique and set(rows["status"]) == {"ok"}


def test_no_worker_outlives_a_sweep_killed_with_sigkill_by_more_than_2_s(tmp_path):
    # a sweep killed outright runs no handler: each worker asked the kernel to die with it (Linux)
    proc, workers = pool_sweep_with_a_row_and_running_workers(tmp_path)
    proc.kill()
    proc.communicate(timeout=60)
    deadline = time.time() + 2
    while time.time() < deadline and workers & set(processes()):
        time.sleep(0.05)
    assert not workers & set(processes()), "workers outlived the killed sweep"


def test_killing_the_children_ends_those_running_and_any_started_after():
    children = child.Children()
    codes = []
    thread = threading.Thread(target=lambda: codes.append(child.run(["sleep", "60"], None, None, None, children)[0]))
    started = time.time()
    thread.start()
    while not children._running and time.time() - started < 10:
        time.sleep(0.01)
    children.kill()
    thread.join(10)
    assert codes == [-signal.SIGKILL] and time.time() - started < 10
    assert child.run(["sleep", "60"], None, None, None, children)[0] == -signal.SIGKILL  # started after kill()


def test_pool_jobs_default_to_the_usable_cores_or_one_per_visible_gpu(monkeypatch):
    from vlmprobe.backends import cuda

    assert launchers.jobs({"name": "pool", "jobs": None}) == len(os.sched_getaffinity(0))
    assert launchers.jobs({"name": "pool", "jobs": 3}) == 3
    launchers.check({"name": "pool", "jobs": None}, "estimate")
    monkeypatch.setattr(cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aa,GPU-bb")  # a worker is pinned by the names the user gave
    assert launchers.visible_gpus() == ["GPU-aa", "GPU-bb"]
    assert launchers.jobs({"name": "pool", "jobs": None}, "cuda") == 2
    launchers.check({"name": "pool", "jobs": 2}, "cuda")
    with pytest.raises(ConfigError, match=r"^launcher.jobs=3 is not allowed with backend cuda: each worker needs a GPU "
                                          r"of its own and 2 are visible \(GPU-aa,GPU-bb\)"):
        launchers.check({"name": "pool", "jobs": 3}, "cuda")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert launchers.visible_gpus() == ["0", "1"]
    monkeypatch.setattr(cuda, "device_count", lambda: 0)
    with pytest.raises(ConfigError, match=r"^launcher=pool is not allowed with backend cuda here: no CUDA GPU"):
        launchers.check({"name": "pool", "jobs": None}, "cuda")


def test_auto_pools_points_where_more_than_one_can_run_at_once_else_runs_them_locally(monkeypatch):
    from vlmprobe.backends import cuda

    auto = {"name": "auto", "jobs": None}
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert launchers.resolve(auto, "estimate", 8)["name"] == "pool"
    assert launchers.resolve(auto, "cpu", 1)["name"] == "local"  # one point: no worker to start
    assert launchers.resolve({**auto, "jobs": 1}, "estimate", 8)["name"] == "local"
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert launchers.resolve(auto, "estimate", 8)["name"] == "local"
    assert launchers.resolve({**auto, "jobs": 2}, "estimate", 8) == {"name": "pool", "jobs": 2}  # as asked
    monkeypatch.setattr(cuda, "device_count", lambda: 1)
    assert launchers.resolve(auto, "cuda", 8)["name"] == "local"  # one GPU: one point at a time
    monkeypatch.setattr(cuda, "device_count", lambda: 4)
    assert launchers.resolve(auto, "cuda", 8) == {"name": "pool", "jobs": None}
    assert launchers.resolve({"name": "local"}, "estimate", 8) == {"name": "local"}
    with pytest.raises(ConfigError, match=r"^launcher.jobs=0 is not allowed: give an integer >= 1"):
        launchers.check({**auto, "jobs": 0}, "estimate")


def test_pool_on_cuda_pins_each_running_worker_to_a_gpu_no_other_worker_holds(monkeypatch):
    from types import SimpleNamespace

    lock, holding, seen = threading.Lock(), set(), []

    def call_worker(config, env, timeout, children):  # stands in for a worker process: holds its GPU a while
        gpu = env["CUDA_VISIBLE_DEVICES"]
        with lock:
            assert gpu not in holding, f"GPU {gpu} given to two workers at once"
            holding.add(gpu)
            seen.append(gpu)
        time.sleep(0.05)
        with lock:
            holding.discard(gpu)
        return {"status": "ok"}

    monkeypatch.setattr(worker_processes, "call_worker", call_worker)
    measure = {"timeout_s": 10, "alloc_conf": None, "backend": "cuda", "isolate": "auto"}  # a fresh worker per point
    items = [SimpleNamespace(config={"measure": measure}, point=SimpleNamespace(id=str(i)))
             for i in range(8)]
    recorded = []
    runner = SimpleNamespace(with_snapshot_file=lambda item: item.config,
                             record=lambda item, out: recorded.append(item.point.id))
    bar = SimpleNamespace(update=lambda n: None, set_postfix_str=lambda s: None)
    Pool(items, runner, 2, bar, ["3", "5"]).run()
    assert sorted(recorded) == [str(i) for i in range(8)] and set(seen) == {"3", "5"} and len(seen) == 8


class StandInWorker(worker_processes.ServingWorker):
    """A serving worker without a process: each point it measures takes `seconds`; with `dies_after`, it is dead
    once it has measured that many (its next call is a crash row, as a dead worker's)."""

    seconds = 0.05
    dies_after: int | None = None
    made: list = []

    def __init__(self, env, children):
        self.env, self.closed, self.took = env, False, []
        self.made_at, self.made_by = time.perf_counter(), threading.current_thread()
        StandInWorker.made.append(self)

    def alive(self):
        return self.dies_after is None or len(self.took) < self.dies_after

    def call(self, request, timeout):
        if not self.alive():
            return {"status": "crash", "error": "worker killed by signal 9"}
        self.took.append((request["id"], time.perf_counter()))
        time.sleep(self.seconds)
        return {"status": "ok"}

    def close(self):
        self.closed = True


def stand_in_pool(monkeypatch, points=8, dies_after=None):
    """Run `points` stand-in points under launcher=pool with two workers: each point's status, and the workers."""
    from types import SimpleNamespace

    monkeypatch.setattr(worker_processes, "ServingWorker", StandInWorker)
    monkeypatch.setattr(StandInWorker, "dies_after", dies_after)
    monkeypatch.setattr(StandInWorker, "made", [])
    measure = {"timeout_s": 10, "alloc_conf": None, "backend": "estimate", "isolate": "auto"}  # no fresh process
    items = [SimpleNamespace(config={"measure": measure, "id": str(i)}, point=SimpleNamespace(id=str(i)))
             for i in range(points)]
    statuses = {}
    runner = SimpleNamespace(with_snapshot_file=lambda item: item.config,
                             record=lambda item, out: statuses.setdefault(item.point.id, out["status"]))
    bar = SimpleNamespace(update=lambda n: None, set_postfix_str=lambda s: None)
    Pool(items, runner, 2, bar, None).run()
    assert sorted(statuses) == [str(i) for i in range(points)]  # every point exactly once
    return statuses, StandInWorker.made


def test_pool_forks_its_workers_before_any_point_runs_and_ends_them_once_every_row_is_in(monkeypatch):
    statuses, made = stand_in_pool(monkeypatch)
    assert set(statuses.values()) == {"ok"} and len(made) == 2 and all(w.closed for w in made)
    first_point = min(at for w in made for _, at in w.took)
    assert all(w.made_by is threading.main_thread() and w.made_at < first_point for w in made)
    assert all(len(w.took) >= 2 for w in made)  # both measured points


def test_a_worker_that_died_is_replaced_by_one_the_main_thread_forks_between_rows(monkeypatch):
    # each worker is dead after one point: its pool thread gets a new one for the next, forked by the main thread
    # (never by a pool thread: the main thread is then between rows, inside nothing)
    statuses, made = stand_in_pool(monkeypatch, points=6, dies_after=1)
    assert set(statuses.values()) == {"ok"} and len(made) == 6 and all(len(w.took) == 1 for w in made)
    assert all(w.made_by is threading.main_thread() for w in made) and all(w.closed for w in made)


@pytest.mark.slow  # ~12 s: submitit's local executor, a job killed
def test_submitit_jobs_give_the_rows_local_gives_and_a_killed_job_keeps_its_finished_points(tmp_path, monkeypatch,
                                                                                             capsys):
    # Two points in one job of submitit's local executor: the tiny model, then one whose batch kills the job's
    # process (SIGSEGV). The first point's row comes from the job's progress file; the second is a crash row.
    point = [*SMOKE, "sweep.axes.data.batch_size=[1]", "sweep.axes.data.lm_max_length=[32]"]
    jobs = ["launcher=submitit", "launcher.cluster=local", "launcher.parameters.gpus_per_node=0",
            "launcher.points_per_job=2", "launcher.poll_s=0.2",
            "+sweep.axes.model._target_=[vlmprobe.models.nanovlm.NanoVLMSpec,faulty_models.CrashingSpec]"]
    proc = run_cli([*point, *jobs, f"results_dir={tmp_path / 'jobs'}"], cwd=tmp_path,
                   env_extra={"PYTHONPATH": f"{REPO}:{REPO / 'tests'}"})
    assert proc.returncode == 0, proc.stderr
    rows = table(results_dir(tmp_path / "jobs")).set_index("model._target_")
    crashed = rows.loc["faulty_models.CrashingSpec"]
    assert crashed["status"] == "crash" and "ended before this point finished" in crashed["error"]
    monkeypatch.chdir(tmp_path)
    assert main([*point, f"results_dir={tmp_path / 'local'}"]) == 0  # launcher=local, in this process
    capsys.readouterr()
    local = table(results_dir(tmp_path / "local")).drop(columns=["point_id"]).iloc[0]
    ran = rows.loc["vlmprobe.models.nanovlm.NanoVLMSpec"].drop(["point_id"])
    assert ran["status"] == "ok"
    pd.testing.assert_series_equal(ran[local.index].rename(None), local.rename(None), check_dtype=False)


def test_submitit_without_its_package_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "submitit", None)  # import submitit now raises ImportError
    with pytest.raises(ConfigError, match=r"^launcher=submitit is not allowed here: the submitit package is not "
                                          r"installed; install it with `pip install submitit`"):
        launchers.check({"name": "submitit", "cluster": "local", "points_per_job": 1, "parameters": {}}, "estimate")


def test_a_sweep_may_be_resumed_under_another_launcher(tmp_path):
    from omegaconf import OmegaConf

    from vlmprobe.run.resume import check_resume

    saved = {"results_dir": "results", "sweep": {"name": "smoke"}, "data": {"batch_size": 1},
             "launcher": {"name": "local"}}
    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(saved))
    check_resume(tmp_path, {**saved, "resume": str(tmp_path), "launcher": {"name": "pool", "jobs": 2}})  # no row changes
