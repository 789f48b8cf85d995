"""launcher=submitit: the points as jobs of one SLURM array through submitit (what Hydra's submitit launcher runs
on). Each job runs launcher.points_per_job points one after another as launcher=local runs them (run_point: a fresh
worker per point on cuda) and notes each point's outputs in a file as it finishes, so a job killed half way (time
limit, node lost, scancel) loses no finished point: the sweep takes them from there, and the job's unfinished
points become `crash` rows saying what happened.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

from vlmprobe import interrupt
from vlmprobe.errors import ConfigError
from vlmprobe.run.sweep import run_point
from vlmprobe.states import Status

__all__ = ["check_submitit", "run_job", "run_submitit"]

POLL_S = 0.5  # how often the sweep looks at its jobs, unless launcher.poll_s says otherwise


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


def run_submitit(todo: list, runner, launcher: dict, bar) -> None:
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
                    outputs += [{"status": Status.CRASH, "error": lost}] * (len(group) - len(outputs))
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
