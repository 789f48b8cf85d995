"""The nightly workflow and scripts/nightly.sh, run end to end on the estimate backend."""

import json
import os
import subprocess

import pandas as pd
import pytest
import yaml

from conftest import REPO
from vlmprobe.results.compare import device_slug

WORKFLOW = REPO / ".github" / "workflows" / "nightly.yml"
SCRIPT = REPO / "scripts" / "nightly.sh"
# the image-size sweep at toy size: one point of the Qwen2-VL code path in seconds
TINY_IMAGE_SIZE = "model=qwen2_vl_tiny sweep.axes.data.image_size=[112] data.lm_max_length=64"
TINY_POINT = "data.image_size=112"


def test_workflow_runs_the_nightly_script_on_a_gpu_every_night_and_keeps_the_results():
    workflow = yaml.safe_load(WORKFLOW.read_text())
    triggers = workflow.get("on", workflow.get(True))  # YAML 1.1 reads the bare key `on` as true
    assert triggers["schedule"][0]["cron"] and "workflow_dispatch" in triggers
    (job,) = workflow["jobs"].values()
    assert "self-hosted" in job["runs-on"] and "gpu" in job["runs-on"]
    runs = [step.get("run", "") for step in job["steps"]]
    install = next(r for r in runs if "pip install" in r)
    # torch first: the CUDA build the runner's driver runs, checked before anything else
    assert install.index("scripts/install_torch_cuda.sh") < install.index('install -e ".[test]"')
    tests, sweeps = (next(i for i, r in enumerate(runs) if what in r) for what in ("pytest -q -m cuda", "scripts/nightly.sh"))
    assert tests < sweeps
    (upload,) = [s for s in job["steps"] if s.get("uses", "").startswith("actions/upload-artifact@")]
    assert upload["if"] == "always()" and upload["with"]["path"] == job["env"]["VLMPROBE_RESULTS"]


def nightly(tmp_path, **env):
    environment = {**os.environ, "VLMPROBE_BACKEND": "estimate", "VLMPROBE_RESULTS": str(tmp_path / "nightly"),
                   "VLMPROBE_BASELINES": str(tmp_path / "baseline"), "VLMPROBE_IMAGE_SIZE_ARGS": TINY_IMAGE_SIZE,
                   **env}
    return subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=environment, timeout=600)


def write_baseline(tmp_path, peak_bytes):
    """A hand-made baseline for the tiny image-size point, under the estimate backend's device. It has only some
    input columns: the gate matches rows on the input columns both tables have."""
    out = tmp_path / "baseline" / device_slug("x86_64 CPU (fake tensors)") / "qwen2_vl_image_size"
    out.mkdir(parents=True)
    row = {"sweep": "qwen2_vl_image_size", "point_id": TINY_POINT, "model": "qwen2_vl_tiny", "batch_size": 1,
           "lm_max_length": 64, "image_size": 112, "backend": "estimate", "status": "ok",
           "peak_allocated_bytes": peak_bytes}
    pd.DataFrame([row]).to_csv(out / "results.csv", index=False)
    (out / "env.json").write_text(json.dumps({"device_name": "x86_64 CPU (fake tensors)"}))
    return out


@pytest.mark.slow  # the whole seq_len sweep of nanoVLM-222M (~100 s here); test_finding.py runs it in CI
def test_nightly_runs_both_sweeps_the_finding_check_and_the_gate(tmp_path):
    write_baseline(tmp_path, 2**30)  # 1 GiB: far above the tiny model's few MiB, so nothing grew
    proc = nightly(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (seq_len,) = (tmp_path / "nightly" / "seq_len").iterdir()
    (image_size,) = (tmp_path / "nightly" / "qwen2_vl_image_size").iterdir()
    assert (seq_len / "summary.md").is_file() and (image_size / "summary.md").is_file()
    assert "finding holds" in proc.stdout
    assert "no regression(s) among 1 point(s)" in proc.stdout  # the image-size sweep against its baseline
    no_baseline = tmp_path / "baseline" / "x86-64-cpu-fake-tensors" / "seq_len"
    assert f"no baseline at {no_baseline}" in proc.stderr and f"cp -r {seq_len}/. {no_baseline}/" in proc.stderr
    assert "nightly: every step passed" in proc.stderr


@pytest.mark.slow  # ~15 s: the nightly script's steps as subprocesses
def test_nightly_goes_on_after_a_failed_step_and_exits_non_zero(tmp_path):
    write_baseline(tmp_path, 1024)  # 1 KiB: the tiny point's peak has "grown" past it
    # a toy seq_len sweep: it runs, but the finding check has nothing of nanoVLM-222M to judge
    proc = nightly(tmp_path, VLMPROBE_SEQ_LEN_ARGS="model=nanovlm_tiny sweep.axes.data.batch_size=[1] "
                                                   "sweep.axes.data.lm_max_length=[32]")
    assert proc.returncode == 1
    (seq_len,) = (tmp_path / "nightly" / "seq_len").iterdir()  # both sweeps ran and wrote their reports
    (image_size,) = (tmp_path / "nightly" / "qwen2_vl_image_size").iterdir()
    assert (seq_len / "summary.md").is_file() and (image_size / "summary.md").is_file()
    assert "nightly: 2 step(s) failed:" in proc.stderr
    assert "- finding check on" in proc.stderr and "- regression gate:" in proc.stderr
    assert "GREW" in proc.stdout


@pytest.mark.parametrize("driver_cuda,tag", [("13.1", "cu130"), ("12.9", "cu128"), ("12.6", "cu126"), ("12.2", None)])
def test_torch_is_installed_for_the_newest_cuda_build_the_driver_runs(tmp_path, driver_cuda, tag):
    # stand-ins on PATH: nvidia-smi reports the driver's CUDA version, python records what it was asked
    (tmp_path / "nvidia-smi").write_text(f"#!/bin/sh\necho '| NVIDIA-SMI 570.1  Driver Version: 570.1  CUDA Version: {driver_cuda} |'\n")
    (tmp_path / "python").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path}/calls\n")
    for name in ("nvidia-smi", "python"):
        (tmp_path / name).chmod(0o755)
    proc = subprocess.run(["bash", str(REPO / "scripts" / "install_torch_cuda.sh")], capture_output=True, text=True,
                          env={**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"})
    if tag is None:
        assert proc.returncode == 1 and "update the driver" in proc.stderr
        return
    assert proc.returncode == 0, proc.stderr
    install, check = (tmp_path / "calls").read_text().splitlines()
    assert install.endswith(f"/whl/{tag}") and "torch>=2.11,<2.14" in install
    assert check.endswith("cuda_usable.py")
