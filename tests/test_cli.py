"""`python -m vlmprobe` as a user runs it: outputs, resume, a killed sweep, and bad input."""

import signal
import subprocess
import sys
import time

import pandas as pd
import pytest

from conftest import run_cli


def results_dir(root):
    (found,) = [p for p in root.glob("*/*") if p.is_dir()]
    return found


# The estimate is what these tests mean, GPU or not (`auto` would pick cuda on a GPU host)
ESTIMATE = "measure.backend=estimate"


def test_without_a_gpu_auto_estimates_and_says_so(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: auto measures")
    proc = run_cli(["+sweep=smoke", "sweep.axes.data.batch_size=[1]", "sweep.axes.data.lm_max_length=[32]",
                    f"results_dir={tmp_path}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "No CUDA GPU found: estimating with the 'estimate' backend" in proc.stderr
    assert set(pd.read_csv(results_dir(tmp_path) / "results.csv")["backend"]) == {"estimate"}


def test_smoke_sweep_writes_every_output(tmp_path):
    proc = run_cli(["+sweep=smoke", ESTIMATE, f"results_dir={tmp_path}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = results_dir(tmp_path)
    assert out.parent.name == "smoke"
    for name in ("results.csv", "results.parquet", "config.yaml", "env.json", "summary.md", "plot.png"):
        assert (out / name).stat().st_size > 0, name
    table = pd.read_parquet(out / "results.parquet")
    assert len(table) == 4 and set(table["status"]) == {"ok"} and set(table["backend"]) == {"estimate"}
    assert str(table["peak_allocated_bytes"].dtype) == "Int64"
    assert table["nvml_used_bytes"].isna().all()  # unknown to the estimate: empty, not zero
    assert (table["peak_reserved_bytes"] >= table["peak_allocated_bytes"]).all()  # the allocator model's
    summary = (out / "summary.md").read_text()
    assert "ESTIMATES" in summary and "lm_max_length=64" in summary


def test_resume_recomputes_no_finished_point(tmp_path):
    assert run_cli(["+sweep=smoke", ESTIMATE, f"results_dir={tmp_path}"], cwd=tmp_path).returncode == 0
    out = results_dir(tmp_path)
    first = pd.read_csv(out / "results.csv")
    lines = (out / "results.csv").read_text().splitlines()
    (out / "results.csv").write_text("\n".join(lines[:3]) + "\n")  # keep the header and 2 of 4 rows
    (out / "results.csv").open("a").write("1,2,")  # and a line cut short, as a kill mid-write leaves it
    proc = run_cli(["+sweep=smoke", ESTIMATE, f"resume={out}"], cwd=tmp_path)  # resume= names the dir: no results_dir=
    assert proc.returncode == 0, proc.stderr
    assert "resume: 2 of 4 points already have rows" in proc.stderr
    table = pd.read_parquet(out / "results.parquet")
    assert sorted(table["point_id"]) == sorted(first["point_id"])  # each point once
    kept = table.set_index("point_id").loc[first["point_id"][:2], "step_time_s"]
    assert kept.tolist() == first["step_time_s"][:2].tolist()  # the kept rows were not recomputed


@pytest.mark.slow  # ~15 s: two sweeps, one of them as an older version wrote it
def test_resuming_a_dir_an_older_version_wrote_keeps_its_rows_and_adds_the_columns_it_lacked(tmp_path):
    assert run_cli(["+sweep=smoke", ESTIMATE, f"results_dir={tmp_path}"], cwd=tmp_path).returncode == 0
    out = results_dir(tmp_path)
    first = pd.read_csv(out / "results.csv")
    older = first.drop(columns=["model_source"]).iloc[:2]  # a version that wrote no model_source column
    older.to_csv(out / "results.csv", index=False)
    proc = run_cli(["+sweep=smoke", ESTIMATE, f"resume={out}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    table = pd.read_csv(out / "results.csv")
    assert list(table.columns) == [*older.columns, "model_source"] and len(table) == 4
    assert table.iloc[:2].drop(columns=["model_source"]).equals(older)  # the older rows, value for value
    assert table["model_source"].isna().all()


def test_resume_refuses_a_dir_of_another_config(tmp_path):
    assert run_cli(["+sweep=smoke", ESTIMATE, f"results_dir={tmp_path}"], cwd=tmp_path).returncode == 0
    out = results_dir(tmp_path)
    proc = run_cli(["+sweep=smoke", ESTIMATE, "train.autocast_dtype=null", f"results_dir={tmp_path}", f"resume={out}"], cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith(f"vlmprobe: resume={out} is not allowed: it was run with a different config")


def test_a_sweep_killed_mid_way_leaves_a_readable_csv_with_every_finished_row(tmp_path):
    args = [sys.executable, "-m", "vlmprobe", "+sweep=smoke", ESTIMATE, "sweep.axes.data.batch_size=[1,2,3,4,5,6,7,8]",
            f"results_dir={tmp_path}"]
    proc = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    csv = None
    while time.time() < deadline:
        found = list(tmp_path.glob("*/*/results.csv"))
        if found and len(found[0].read_text().splitlines()) >= 3:  # header + 2 finished rows
            csv = found[0]
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert csv is not None, "no rows were written in time"
    table = pd.read_csv(csv)
    assert 2 <= len(table) < 16
    assert set(table["status"]) == {"ok"} and table["peak_allocated_bytes"].notna().all()


# Two through the real command (exit code, stderr, nothing written); tests/test_bad_input.py has every case
# in-process, these among them
BAD = {
    "unknown model": (["model=nope"], "model='nope' is not allowed: use one of deepseek_vl2_small, deepseek_vl2_tiny, deepseek_vl2_toy, gemma3_4b, gemma3_tiny, glm4_1v_9b, glm4_5v, glm4v_moe_tiny, glm4v_tiny, hf, idefics3_tiny"),
    "negative lr": (["model=nanovlm_tiny", "optimizer.lr=-1"],
                    "optimizer.lr=-1 is not allowed: torch.optim.AdamW refuses it: Invalid learning rate: -1"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_one_clear_line_and_exit_2(tmp_path, case):
    args, message = BAD[case]
    proc = run_cli([*args, f"results_dir={tmp_path}"], cwd=tmp_path)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("vlmprobe: ") and message in lines[0], proc.stderr
    assert not list(tmp_path.iterdir())  # nothing was started
