"""The worker protocol and the rows a real worker process produces when a point fails on purpose."""

import os

import pytest

from conftest import TESTS
from vlmprobe import child
from vlmprobe.point.measure import measure
from vlmprobe.run.sweep import run_point
from vlmprobe.run.workers import ServingWorker, worker_env

TINY = ["model=nanovlm_tiny", "data.lm_max_length=32", "measure.backend=cpu"]


@pytest.fixture
def faulty_env(monkeypatch):
    """Workers import tests/faulty_models.py."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))


def test_isolated_worker_returns_the_same_row_as_an_in_process_run(point):
    config = point(TINY + ["measure.isolate=true"])
    isolated = run_point(config)
    in_process = measure(config)
    assert isolated["status"] == "ok"
    figures = [k for k in in_process if k.endswith("_bytes")]
    assert {k: isolated[k] for k in figures} == {k: in_process[k] for k in figures}


@pytest.mark.parametrize("forks", [pytest.param(True, marks=pytest.mark.slow), False], ids=["forked", "fresh interpreter"])
def test_a_serving_worker_measures_points_one_after_another_and_fails_each_as_a_fresh_worker_would(point, faulty_env,
                                                                                                   forks, monkeypatch):
    # launcher=pool's long-lived worker (a fork of this process on Linux, a fresh interpreter elsewhere): the same
    # row as in-process for each point, whatever came before it; a point that raises is an error row and the
    # worker goes on; one that kills it or outlives its timeout is the crash / timeout row of a fresh worker,
    # and that worker is done
    monkeypatch.setattr(child, "FORKS", forks)
    ok = point(TINY)
    expected = measure(ok)
    figures = [k for k in expected if k.endswith("_bytes")]
    children = child.Children()
    worker = ServingWorker(worker_env(ok), children)
    first = worker.call(ok, 300)
    raised = worker.call(point(TINY + ["model._target_=faulty_models.RaisingSpec"]), 300)
    again = worker.call(ok, 300)
    assert {k: first[k] for k in figures} == {k: again[k] for k in figures} == {k: expected[k] for k in figures}
    assert raised["status"] == "error" and "RuntimeError: broken on purpose" in raised["error"]
    assert worker.alive()
    crashed = worker.call(point(TINY + ["model._target_=faulty_models.CrashingSpec"]), 300)
    assert crashed["status"] == "crash" and "killed by signal 11" in crashed["error"]
    assert "about to crash" in crashed["error"] and not worker.alive()

    worker = ServingWorker(worker_env(ok), children)
    hung = worker.call(point(TINY + ["model._target_=faulty_models.HangingSpec"]), 20)
    assert hung["status"] == "timeout" and hung["error"].startswith("no result after 20 s") and not worker.alive()
    assert not children._running


def test_out_of_memory_in_a_worker_is_a_row_with_the_peak_before_it_and_the_request(point, tmp_path):
    # The tiny model's tensors fit in 2 MiB small-pool segments; the 2 MiB logits of 8 x 256 tokens x 512
    # vocab x bf16 (autocast) need a 20 MiB large-pool segment, which does not fit in 10 MiB
    config = point(TINY + ["measure.isolate=true", "measure.device_memory=10MiB", "data.batch_size=8",
                           "data.lm_max_length=256"])
    config["measure"]["snapshot_file"] = str(tmp_path / "snapshots" / "point.pickle")  # as the sweep names it
    row = run_point(config)
    assert row["status"] == "oom"
    assert row["snapshot_file"] is None and not (tmp_path / "snapshots").exists()  # the estimate records none
    assert 0 < row["peak_allocated_bytes"] <= row["peak_reserved_bytes"] <= 10 * 2**20
    assert row["oom_segment_bytes"] == 20 * 2**20  # the segment that did not fit
    assert row["oom_block_bytes"] == 8 * 256 * 512 * 2  # for the logits, a multiple of 512 already
    assert "out of memory" in row["error"]


def test_a_worker_killed_by_a_signal_is_a_crash_row_with_the_stderr_tail(point, faulty_env):
    row = run_point(point(TINY + ["measure.isolate=true", "model._target_=faulty_models.CrashingSpec"]))
    assert row["status"] == "crash"
    assert "killed by signal 11" in row["error"] and "about to crash" in row["error"]


def test_a_worker_past_its_timeout_is_killed_and_is_a_timeout_row(point, faulty_env):
    row = run_point(point(TINY + ["measure.isolate=true", "measure.timeout_s=3", "model._target_=faulty_models.HangingSpec"]))
    assert row["status"] == "timeout"
    assert "no result after 3 s" in row["error"]


@pytest.mark.parametrize("isolate", ["true", "false"])
def test_a_point_that_raises_is_an_error_row_in_and_out_of_process(point, faulty_env, isolate):
    row = run_point(point(TINY + [f"measure.isolate={isolate}", "model._target_=faulty_models.RaisingSpec"]))
    assert row["status"] == "error"
    assert "RuntimeError: broken on purpose" in row["error"]


def test_a_worker_that_dies_after_printing_its_row_keeps_the_row_and_notes_the_exit(point, faulty_env):
    row = run_point(point(TINY + ["measure.isolate=true", "model._target_=faulty_models.DyingAtExitSpec"]))
    assert row["status"] == "ok" and row["peak_allocated_bytes"] > 0
    assert "worker killed by signal 11 after printing its row" in row["notes"]


@pytest.mark.parametrize("isolate", ["true", "false"])
def test_out_of_memory_outside_the_caching_allocator_is_an_oom_row(point, faulty_env, isolate):
    row = run_point(point(TINY + [f"measure.isolate={isolate}", "model._target_=faulty_models.OutOfLibraryMemorySpec"]))
    assert row["status"] == "oom" and "CUBLAS_STATUS_ALLOC_FAILED" in row["error"]
    assert row["oom_segment_bytes"] is None  # the library's own allocation: no segment was asked for


@pytest.mark.parametrize("exc,oom", [
    (RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"), True),
    (RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"), True),
    (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"), True),
    (RuntimeError("CUDA error: an illegal memory access was encountered"), False),
    (ValueError("out of memory"), False),  # only the RuntimeErrors torch raises for device failures
])
def test_out_of_memory_is_recognised_by_what_cuda_and_its_libraries_say(exc, oom):
    import torch

    from vlmprobe.point.measure import is_out_of_memory

    assert is_out_of_memory(exc) is oom
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB"))


@pytest.mark.parametrize("inherited", [{}, {"PYTORCH_ALLOC_CONF": "backend:cudaMallocAsync"},
                                       {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}])
def test_the_worker_gets_exactly_the_configured_allocator_settings_under_both_names(point, monkeypatch, inherited):
    from vlmprobe.run.workers import worker_env

    for name, value in inherited.items():
        monkeypatch.setenv(name, value)
    none = worker_env(point(TINY))
    assert "PYTORCH_ALLOC_CONF" not in none and "PYTORCH_CUDA_ALLOC_CONF" not in none
    both = worker_env(point(TINY + ["measure.alloc_conf=expandable_segments:True"]))
    assert both["PYTORCH_ALLOC_CONF"] == both["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
