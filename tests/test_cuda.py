"""The CUDA path for real; skipped without a GPU (conftest marks them)."""

import json

import pandas as pd
import pytest

from conftest import run_cli
from vlmprobe.run.sweep import run_point
from vlmprobe.run.workers import describe_backend

pytestmark = pytest.mark.cuda

TINY = ["model=nanovlm_tiny", "data.lm_max_length=64", "measure.backend=cuda"]


def nvml_readable() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except Exception:
        return False


def test_cuda_point_runs_in_a_worker_and_reports_allocator_and_nvml_figures(point):
    row = run_point(point(TINY))
    assert row["backend"] == "cuda" and row["status"] == "ok", row.get("error")
    assert 0 < row["peak_allocated_bytes"] <= row["peak_reserved_bytes"]
    assert row["last_step_peak_allocated_bytes"] <= row["peak_allocated_bytes"]
    assert max(row[f"{p}_peak_bytes"] for p in ("forward", "backward", "optimizer")) == row["peak_allocated_bytes"]
    assert row["allocator_backend"] == "native" and row["imposed_capacity_bytes"] is None
    if nvml_readable():  # without NVML the columns are empty, never a failure of the point
        assert row["nvml_used_bytes"] >= row["peak_reserved_bytes"]
    else:
        assert row["nvml_used_bytes"] is None


def test_cuda_out_of_memory_is_a_row_with_a_snapshot_and_the_block_it_asked_for(point, tmp_path):
    config = point(["model=nanovlm_222m", "data.batch_size=4096", "data.lm_max_length=512", "measure.backend=cuda"])
    config["measure"]["snapshot_file"] = str(tmp_path / "oom.pickle")
    row = run_point(config)
    assert row["status"] == "oom"
    assert 0 < row["oom_block_bytes"] <= row["oom_segment_bytes"] and row["oom_block_bytes"] % 512 == 0
    assert (tmp_path / "oom.pickle").stat().st_size > 0


def test_an_imposed_capacity_makes_a_larger_card_run_out_where_a_small_one_would(point):
    row = run_point(point([*TINY, "data.batch_size=256", "data.lm_max_length=256", "measure.device_memory=64MiB"]))
    assert row["imposed_capacity_bytes"] is not None and row["imposed_capacity_bytes"] <= 64 * 2**20
    assert row["status"] == "oom", row
    assert row["peak_reserved_bytes"] <= row["imposed_capacity_bytes"]


def test_cuda_malloc_async_points_run_without_history_and_say_why_there_is_no_snapshot(point, tmp_path):
    config = point([*TINY, "measure.alloc_conf=backend:cudaMallocAsync", "measure.snapshot=true"])
    config["measure"]["snapshot_file"] = str(tmp_path / "s.pickle")
    row = run_point(config)
    assert row["status"] == "ok", row.get("error")
    assert row["allocator_backend"] == "cudaMallocAsync" and row["snapshot_file"] is None
    assert "does not record" in row["notes"]


def test_the_worker_allocator_runs_the_configured_settings_and_env_json_says_so(point, monkeypatch):
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "backend:cudaMallocAsync")  # inherited: must not apply
    assert describe_backend("cuda", point(TINY))["allocator_backend"] == "native"
    info = describe_backend("cuda", point([*TINY, "measure.alloc_conf=expandable_segments:True"]))
    assert info["allocator_conf_effective"] == "expandable_segments:True"


def test_cuda_sweep_writes_cuda_rows_and_device_provenance(tmp_path):
    proc = run_cli(["+sweep=smoke", "measure.backend=cuda", f"results_dir={tmp_path}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    (out,) = tmp_path.glob("*/*/")
    assert set(pd.read_csv(out / "results.csv")["backend"]) == {"cuda"}
    env = json.loads((out / "env.json").read_text())
    assert env["device_total_memory_bytes"] > 0 and env["device_name"]
