"""Faults: a smoke sweep interrupted (SIGINT, as Ctrl-C) and killed (SIGKILL) at random moments, again and
again, then resumed, ends with the table an uninterrupted run makes, row for row (estimates are
deterministic in bytes; only step_time_s, a wall time, may differ). A SIGINT always ends in one line that
says how many rows are kept, where, and the command that resumes, and that command is the one run next.

A moment is drawn by progress, not in seconds (a range in seconds fits one machine's speed: on a 3x faster one
most moments fell after the sweep had ended, and start-up is most of a run's time, so a moment drawn over the
whole run is mostly one before any row): during start-up, or after this run's first row, delayed by a fraction
of what start-up or a point took in an uninterrupted run. A sweep takes faults until one of its runs ends before
its fault, is resumed to its end and compared; sweeps follow one another until FAULTS faults in all (at most
FAULTS sweeps). The draws come from a fixed seed (CI sees the same choices every run; the timing of the machine
still varies them); VLMPROBE_FAULT_SEED picks others.
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
import pytest

from conftest import REPO
from vlmprobe.results.table import read_table

SWEEP = ["+sweep=smoke", "measure.steps=1", "measure.backend=estimate"]  # POINTS points of the tiny nanoVLM
FAULTS = 4
POINTS = 4  # rows of the smoke sweep
POLL_S = 0.02
TIMING_COLUMNS = ["step_time_s"]
NATIVE_ABORT = "terminate called after throwing an instance of 'pybind11::error_already_set'"
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def start(command: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "vlmprobe", *command], cwd=cwd, text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ENV)


def run(command: list[str], cwd: Path) -> None:
    """The command to its end, which must be a success."""
    proc = start(command, cwd)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err


def rows_in(root: Path) -> int:
    """Rows in the sweep's results.csv under root (it is written a row at a time), 0 before there is one."""
    found = list(root.glob("smoke/*/results.csv"))
    return max(0, len(found[0].read_text().splitlines()) - 1) if found else 0


def wait_for_rows(proc: subprocess.Popen, root: Path, rows: int) -> bool:
    """Until root's table has `rows` rows (True) or the command has ended (False)."""
    while rows_in(root) < rows:
        if proc.poll() is not None:
            return False
        time.sleep(POLL_S)
    return True


def timed(command: list[str], cwd: Path, root: Path) -> tuple[float, float]:
    """Seconds to the command's first row in root and to its end, which must be a success."""
    started = time.monotonic()
    proc = start(command, cwd)
    wait_for_rows(proc, root, 1)
    first_row = time.monotonic() - started
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return first_row, time.monotonic() - started


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


@pytest.mark.slow  # ~70 s: many interrupted and resumed sweeps
def test_sigint_and_sigkill_at_random_moments_then_resume_give_the_uninterrupted_table(tmp_path):
    seed = int(os.environ.get("VLMPROBE_FAULT_SEED", 20261123))
    print(f"VLMPROBE_FAULT_SEED={seed}")
    rng = random.Random(seed)
    # uninterrupted, timed: start-up (to the first row) and a point
    first_row, span = timed([*SWEEP, f"results_dir={tmp_path / 'reference'}"], tmp_path, tmp_path / "reference")
    (reference,) = (tmp_path / "reference" / "smoke").iterdir()
    moments = {"start-up": first_row, "after a row": (span - first_row) / (POINTS - 1)}

    faults, aborts = [], []
    # a sweep takes a few faults before one of its runs ends it; then it is compared, and another one starts
    for sweep in range(FAULTS):
        root = tmp_path / f"faulted-{sweep}"
        faults += interrupted_until_done(root, rng, moments, aborts)
        out_dir = only_dir(root)
        run([*SWEEP, f"results_dir={root}", *([f"resume={out_dir}"] if out_dir else [])], tmp_path)
        pd.testing.assert_frame_equal(table(only_dir(root)), table(reference))
        if len(faults) >= FAULTS:
            break
    assert len(faults) >= 3, faults
    assert len(aborts) <= 1, aborts  # an abort is the rare exception, never the rule


def interrupted_until_done(root: Path, rng: random.Random, moments: dict, aborts: list) -> list[str]:
    """Runs the sweep into root, interrupting or killing each run at a random moment and resuming it as its
    SIGINT line says (or, after a kill, from its dir), until a run ends before its fault or FAULTS faults."""
    command = [*SWEEP, f"results_dir={root}"]
    faults = []
    while len(faults) < FAULTS:
        before = rows_in(root)
        proc = start(command, root.parent)
        when, how = rng.choice(list(moments)), rng.choice([signal.SIGINT, signal.SIGKILL])
        if when == "start-up" or wait_for_rows(proc, root, before + 1):
            time.sleep(rng.uniform(0.05, 1.0) * moments[when])
            if proc.poll() is None:
                proc.send_signal(how)
        _, err = proc.communicate()
        lines = err.strip().splitlines()
        if proc.returncode == 0:  # the sweep finished before the fault
            break
        out_dir = only_dir(root)
        faults.append(f"{how.name} {when}: exit {proc.returncode}, {rows_in(root)} rows kept")
        print(faults[-1])
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
    return faults
