"""Faults: a smoke sweep interrupted (SIGINT, as Ctrl-C) and killed (SIGKILL) at random moments, again and
again, then resumed, ends with the table an uninterrupted run makes, row for row (estimates are
deterministic in bytes; only step_time_s, a wall time, may differ). A SIGINT always ends in one line that
says how many rows are kept, where, and the command that resumes, and that command is the one run next.

Bounded: the faults stop after FAULT_BUDGET_S seconds. The moments come from a fixed seed (CI sees the same
choices every run; the timing of the machine still varies them); VLMPROBE_FAULT_SEED picks others.
"""

import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd

from conftest import REPO
from vlmprobe.__main__ import main
from vlmprobe.results import read_table

SWEEP = ["+sweep=smoke", "measure.steps=1", "measure.backend=estimate"]  # 4 points of the tiny nanoVLM
FAULT_BUDGET_S = 20
TIMING_COLUMNS = ["step_time_s"]
NATIVE_ABORT = "terminate called after throwing an instance of 'pybind11::error_already_set'"


def table(out_dir: Path) -> pd.DataFrame:
    rows = pd.read_parquet(out_dir / "results.parquet").drop(columns=TIMING_COLUMNS)
    return rows.sort_values("point_id").reset_index(drop=True)


def only_dir(root: Path) -> Path | None:
    found = [p for p in root.glob("smoke/*") if p.is_dir()]
    assert len(found) <= 1, found  # a resume never starts a second dir
    if found and not (found[0] / "config.yaml").exists():
        shutil.rmtree(found[0])  # killed between making the dir and writing its config: nothing to resume
        return None
    return found[0] if found else None


def test_sigint_and_sigkill_at_random_moments_then_resume_give_the_uninterrupted_table(tmp_path, monkeypatch, capsys):
    seed = int(os.environ.get("VLMPROBE_FAULT_SEED", 20261123))
    print(f"VLMPROBE_FAULT_SEED={seed}")
    rng = random.Random(seed)
    monkeypatch.chdir(tmp_path)
    assert main([*SWEEP, f"results_dir={tmp_path / 'reference'}"]) == 0  # uninterrupted, in this process
    capsys.readouterr()
    (reference,) = (tmp_path / "reference" / "smoke").iterdir()

    root = tmp_path / "faulted"
    command = [*SWEEP, f"results_dir={root}"]
    faults, aborts, deadline = [], [], time.monotonic() + FAULT_BUDGET_S
    while time.monotonic() < deadline:
        proc = subprocess.Popen([sys.executable, "-m", "vlmprobe", *command], cwd=tmp_path, text=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                env={**os.environ, "PYTHONPATH": str(REPO)})
        how = rng.choice([signal.SIGINT, signal.SIGKILL])
        try:
            proc.wait(timeout=rng.uniform(0.3, 9.0))  # from start-up to the last point
        except subprocess.TimeoutExpired:
            proc.send_signal(how)
        _, err = proc.communicate()
        lines = err.strip().splitlines()
        if proc.returncode == 0:  # the sweep finished before the fault
            break
        faults.append(f"{how.name}: exit {proc.returncode}")
        out_dir = only_dir(root)
        if how == signal.SIGINT and proc.returncode == -signal.SIGABRT:
            # Known, rare (seen once in ~40 SIGINTs): the KeyboardInterrupt lands where native code that
            # called into Python cannot pass it on, and the C++ runtime aborts. Rows stay as after a kill.
            assert NATIVE_ABORT in err, err
            aborts.append(err)
        elif how == signal.SIGKILL:
            assert proc.returncode == -signal.SIGKILL
        else:
            # 130 is ours; -SIGINT (which a shell also shows as 130) was seen once, after the one line
            # was printed, on an interrupt at start-up: not explained yet
            assert proc.returncode in (130, -signal.SIGINT) and "Traceback" not in err, err
            if out_dir is None:
                assert lines[-1] == "vlmprobe: interrupted before any point ran; nothing was written", err
                continue
            kept, _, resume = lines[-1].partition("; resume with: ")
            csv = out_dir / "results.csv"
            rows = len(read_table(csv)) if csv.exists() else 0
            assert kept == f"vlmprobe: interrupted: {rows} rows kept in {out_dir / 'results.csv'}", err
            assert shlex.split(resume)[:3] == ["python", "-m", "vlmprobe"]
            command = shlex.split(resume)[3:]  # the printed command is the one run next
            continue
        if out_dir is not None:
            command = [*SWEEP, f"results_dir={root}", f"resume={out_dir}"]
    assert len(faults) >= 3, faults
    assert len(aborts) <= 1, aborts  # an abort is the rare exception, never the rule

    out_dir = only_dir(root)
    final = [*SWEEP, f"results_dir={root}", *([f"resume={out_dir}"] if out_dir else [])]
    proc = subprocess.run([sys.executable, "-m", "vlmprobe", *final], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out_dir = only_dir(root)
    pd.testing.assert_frame_equal(table(out_dir), table(reference))
