"""The CUDA path for real; skipped without a GPU (conftest marks them)."""

import json

import pandas as pd
import pytest

from conftest import run_cli
from vlmprobe.sweep import run_point

pytestmark = pytest.mark.cuda


def test_cuda_point_runs_in_a_worker_and_reports_allocator_and_nvml_figures(point):
    row = run_point(point(["model=nanovlm_tiny", "data.lm_max_length=64", "measure.backend=cuda"]))
    assert row["backend"] == "cuda" and row["status"] == "ok", row.get("error")
    assert 0 < row["peak_allocated_bytes"] <= row["peak_reserved_bytes"]
    assert row["last_step_peak_allocated_bytes"] <= row["peak_allocated_bytes"]
    assert max(row[f"{p}_peak_bytes"] for p in ("forward", "backward", "optimizer")) == row["peak_allocated_bytes"]
    assert row["nvml_used_bytes"] >= row["peak_reserved_bytes"]


def test_cuda_out_of_memory_is_a_row_with_a_snapshot(point, tmp_path):
    config = point(["model=nanovlm_222m", "data.batch_size=4096", "data.lm_max_length=512", "measure.backend=cuda"])
    config["measure"]["snapshot_file"] = str(tmp_path / "oom.pickle")
    row = run_point(config)
    assert row["status"] == "oom" and row["oom_request_bytes"] > 0
    assert (tmp_path / "oom.pickle").stat().st_size > 0


def test_cuda_sweep_writes_cuda_rows_and_device_provenance(tmp_path):
    proc = run_cli(["+sweep=smoke", "measure.backend=cuda", f"results_dir={tmp_path}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    (out,) = tmp_path.glob("*/*/")
    assert set(pd.read_csv(out / "results.csv")["backend"]) == {"cuda"}
    env = json.loads((out / "env.json").read_text())
    assert env["device_total_memory_bytes"] > 0 and env["device_name"]
