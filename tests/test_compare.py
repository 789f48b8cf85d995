"""The regression gate: rows matched by their inputs, growth against a tolerance, ok -> oom, backends kept apart."""

import json
import subprocess
import sys

import pandas as pd

from conftest import REPO
from vlmprobe.results.compare import baseline_path, device_slug
from vlmprobe.results.table import columns_for

MiB = 2**20
POINTS = {"data.batch_size=1": 1000.0, "data.batch_size=8": 4000.0, "data.batch_size=16": 7000.0}


def write_results(out_dir, peaks, backend="cuda", device="NVIDIA H100 80GB HBM3"):
    """A results dir of a one-axis sweep: point id -> peak MiB, or a status word for a point without a figure."""
    out_dir.mkdir(parents=True)
    rows = [{"sweep": "batch", "point_id": point, "model": "nanovlm_222m", "dtype": "float32",
             "batch_size": int(point.split("=")[1]), "lm_max_length": 512, "backend": backend,
             "status": "ok" if isinstance(peak, float) else peak,
             "peak_allocated_bytes": round(peak * MiB) if isinstance(peak, float) else None}
            for point, peak in peaks.items()]
    pd.DataFrame(rows).reindex(columns=columns_for(["data.batch_size"])).to_csv(out_dir / "results.csv", index=False)
    (out_dir / "env.json").write_text(json.dumps({"device_name": device, "git_commit": "abc"}))
    return out_dir


def compare(baseline, results, *extra):
    return subprocess.run([sys.executable, "-m", "vlmprobe.results.compare", str(baseline), str(results), *extra],
                          capture_output=True, text=True, cwd=REPO, timeout=120)


def test_a_dir_against_itself_passes(tmp_path):
    run = write_results(tmp_path / "run", POINTS)
    proc = compare(run, run)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no regression(s) among 3 point(s)" in proc.stdout
    assert "MiB = 1024^2 bytes" in proc.stdout and "7,000.0" in proc.stdout


def test_a_3_percent_growth_fails_at_2_percent_and_passes_at_5(tmp_path):
    baseline = write_results(tmp_path / "base", POINTS)
    grown = write_results(tmp_path / "new", {**POINTS, "data.batch_size=8": 4120.0})
    strict = compare(baseline, grown, "--tolerance", "0.02")
    assert strict.returncode == 1
    assert "GREW +3.0%" in strict.stdout and "1 regression(s) among 3 point(s)" in strict.stdout
    loose = compare(baseline, grown, "--tolerance", "0.05")
    assert loose.returncode == 0, loose.stdout
    assert "same (+3.0%)" in loose.stdout


def test_the_default_tolerance_is_2_percent(tmp_path):
    baseline = write_results(tmp_path / "base", POINTS)
    assert compare(baseline, write_results(tmp_path / "a", {**POINTS, "data.batch_size=1": 1019.0})).returncode == 0
    assert compare(baseline, write_results(tmp_path / "b", {**POINTS, "data.batch_size=1": 1021.0})).returncode == 1


def test_a_point_that_fit_and_now_ooms_fails(tmp_path):
    baseline = write_results(tmp_path / "base", POINTS)
    proc = compare(baseline, write_results(tmp_path / "new", {**POINTS, "data.batch_size=16": "oom"}))
    assert proc.returncode == 1
    assert "was ok, now oom" in proc.stdout


def test_a_point_that_ooms_and_now_fits_passes(tmp_path):
    baseline = write_results(tmp_path / "base", {**POINTS, "data.batch_size=16": "oom"})
    assert compare(baseline, write_results(tmp_path / "new", POINTS)).returncode == 0


def test_a_baseline_point_missing_from_the_results_fails(tmp_path):
    baseline = write_results(tmp_path / "base", POINTS)
    proc = compare(baseline, write_results(tmp_path / "new", {"data.batch_size=1": 1000.0, "data.batch_size=8": 4000.0}))
    assert proc.returncode == 1
    assert "missing from results" in proc.stdout


def test_rows_of_different_backends_are_refused_in_one_line(tmp_path):
    measured = write_results(tmp_path / "base", POINTS, backend="cuda")
    estimated = write_results(tmp_path / "new", POINTS, backend="estimate")
    proc = compare(measured, estimated)
    assert proc.returncode == 2 and proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("vlmprobe.results.compare: refusing to compare backend cuda (baseline) with estimate (results)")


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    run = write_results(tmp_path / "run", POINTS)
    proc = compare(tmp_path / "nope", run)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "is not a vlmprobe results dir (no results.csv)" in proc.stderr
    other = write_results(tmp_path / "other", {"data.batch_size=2": 1.0})
    proc = compare(run, other)
    assert proc.returncode == 2 and "have no point in common" in proc.stderr


def test_a_baseline_lives_under_the_slugified_device_name_and_sweep(tmp_path):
    assert device_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert device_slug("x86_64 CPU (fake tensors)") == "x86-64-cpu-fake-tensors"
    run = write_results(tmp_path / "run", POINTS)
    assert baseline_path(tmp_path / "baseline", run) == tmp_path / "baseline" / "nvidia-h100-80gb-hbm3" / "batch"
