"""Launchers (`launcher=local|pool`): pool runs points at once in worker processes and gives the rows local
gives; a failed point is a row; a distributed point runs in the sweep process; Ctrl-C ends every worker,
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
from vlmprobe import child, launchers
from vlmprobe.__main__ import main
from vlmprobe.errors import ConfigError

SMOKE = ["+sweep=smoke", "measure.backend=estimate", "measure.steps=1"]  # 4 points of the tiny nanoVLM
POOL = ["launcher=pool", "launcher.jobs=2"]
ENV = {"PYTHONPATH": str(REPO)}


def table(out_dir: Path) -> pd.DataFrame:
    rows = pd.read_parquet(out_dir / "results.parquet").drop(columns=["step_time_s"])  # a wall time
    return rows.sort_values("point_id").reset_index(drop=True)


def results_dir(root: Path) -> Path:
    (found,) = [p for p in root.glob("*/*") if p.is_dir()]
    return found


def test_pool_gives_the_rows_local_gives(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main([*SMOKE, f"results_dir={tmp_path / 'local'}"]) == 0  # launcher=local, the default
    capsys.readouterr()
    proc = run_cli([*SMOKE, *POOL, f"results_dir={tmp_path / 'pool'}"], cwd=tmp_path, env_extra=ENV)
    assert proc.returncode == 0, proc.stderr
    pooled = table(results_dir(tmp_path / "pool"))
    assert len(pooled) == 4 and set(pooled["status"]) == {"ok"}
    pd.testing.assert_frame_equal(pooled, table(results_dir(tmp_path / "local")))


@pytest.mark.slow  # ~30 s of workers; the Ctrl-C and equal-rows tests keep pool in CI
def test_under_pool_a_failed_point_is_a_row_and_a_distributed_point_runs_in_the_sweep(tmp_path):
    # 0.5 s is too short for a worker to import torch: that point times out; the other pool point is ok, and
    # the FSDP2 points (in the sweep process, where no timeout applies) are ok too
    proc = run_cli([*SMOKE, *POOL, "sweep.axes.data.batch_size=[1]", "sweep.axes.data.lm_max_length=[32]",
                    "+sweep.axes.dist=[none,fsdp2]", "+sweep.axes.measure.timeout_s=[0.5,600]",
                    f"results_dir={tmp_path}"], cwd=tmp_path, env_extra=ENV)
    assert proc.returncode == 0, proc.stderr
    rows = pd.read_parquet(results_dir(tmp_path) / "results.parquet")
    status = {(r.dist, r.point_id.endswith("timeout_s=0.5")): r.status for r in rows.itertuples()}
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


def test_ctrl_c_during_a_pool_sweep_ends_every_worker_keeps_the_rows_and_resumes(tmp_path):
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
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in err, err

    out_dir = results_dir(tmp_path)
    kept = len(pd.read_csv(out_dir / "results.csv"))
    line = err.strip().splitlines()[-1]
    assert 1 <= kept < 4 and line.startswith(f"vlmprobe: interrupted: {kept} rows kept in {out_dir / 'results.csv'}; "
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


def test_pool_jobs_default_to_the_usable_cores_and_cuda_is_refused():
    assert launchers.jobs({"name": "pool", "jobs": None}) == len(os.sched_getaffinity(0))
    assert launchers.jobs({"name": "pool", "jobs": 3}) == 3
    launchers.check({"name": "pool", "jobs": None}, "estimate")
    launchers.check({"name": "local"}, "cuda")
    with pytest.raises(ConfigError, match=r"^launcher=pool is not allowed with backend cuda yet: pinning each worker"):
        launchers.check({"name": "pool", "jobs": 2}, "cuda")


def test_a_sweep_may_be_resumed_under_another_launcher(tmp_path):
    from omegaconf import OmegaConf

    from vlmprobe.__main__ import check_resume

    saved = {"results_dir": "results", "sweep": {"name": "smoke"}, "data": {"batch_size": 1},
             "launcher": {"name": "local"}}
    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(saved))
    check_resume(tmp_path, {**saved, "resume": str(tmp_path), "launcher": {"name": "pool", "jobs": 2}})  # no row changes
