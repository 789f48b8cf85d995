"""The published nanoVLM issue #103 table as data, the finding check on it, and on a real estimate run."""

import subprocess
import sys

import pandas as pd
import pytest

from conftest import REPO, run_cli
from vlmprobe.results import published as reference
from vlmprobe.results.report import write_reports
from vlmprobe.results.table import columns_for

MiB = 2**20
# FACTS.md section 1, typed by hand: (batch, lm_max_length) -> MiB, or the word the table has instead
PUBLISHED = {
    (1, 512): 4450.70, (8, 512): 9753.21, (16, 512): 16630.95, (32, 512): "oom",
    (1, 128): 4447.19, (8, 128): 5174.62, (16, 128): 7283.11,
}
# measure_vram.py's setup as vlmprobe rows spell it (FACTS.md section 2; the logits `_` live through backward)
SETUP = {"model": "nanovlm_222m", "dtype": "float32", "autocast_dtype": "bfloat16", "optimizer": "AdamW(foreach)",
         "grad_accum_steps": 1, "grad_ckpt_lm": False, "grad_ckpt_vision": False, "freeze_vision": False,
         "freeze_lm": False, "lora_r": 0, "attn_implementation": "sdpa", "steps": 2, "hold_outputs": True,
         "image_size": 224, "images_per_sample": 1}
AXES = ["data.batch_size", "data.lm_max_length"]


def write_results(out_dir, peaks, backend="cuda", **setup):
    """A results dir as a seq_len sweep leaves it, with the given peaks (MiB or a status word)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = [{"sweep": "seq_len", "point_id": f"data.batch_size={b},data.lm_max_length={n}", **SETUP, **setup,
             "batch_size": b, "lm_max_length": n, "backend": backend,
             "status": "ok" if isinstance(peak, float) else peak,
             "peak_allocated_bytes": round(peak * MiB) if isinstance(peak, float) else None}
            for (b, n), peak in peaks.items()]
    pd.DataFrame(rows).reindex(columns=columns_for(AXES)).to_csv(out_dir / "results.csv", index=False)
    return out_dir


def check(out_dir):
    return subprocess.run([sys.executable, "-m", "vlmprobe.results.finding", str(out_dir)], capture_output=True, text=True,
                          cwd=REPO, timeout=120)


def verdicts(stdout):
    """criterion text -> PASS/FAIL, from the check's output."""
    return {line[6:]: line[:4] for line in stdout.splitlines() if line[:4] in ("PASS", "FAIL")}


def failed(stdout):
    return [text for text, word in verdicts(stdout).items() if word == "FAIL"]


def markdown_row(text, label):
    """The cells after `label` in the markdown table row that starts with it."""
    (line,) = [line for line in text.splitlines() if line.startswith(f"| {label} ")]
    return [cell.strip() for cell in line.strip("|").split("|")[1:]]


def test_reference_table_holds_the_published_figures():
    table = reference.load().set_index(["batch_size", "lm_max_length"])
    assert len(table) == 8
    for point, expected in PUBLISHED.items():
        row = table.loc[point]
        if expected == "oom":
            assert row["status"] == "oom" and pd.isna(row["peak_bytes"])
        else:
            assert row["status"] == "ok" and row["peak_mib"] == expected
            assert row["peak_bytes"] == round(expected * MiB)  # MiB = 1024^2 B, as measure_vram.py divides
    assert table.loc[(32, 128), "status"] == "absent"
    assert set(table["device"]) == {"RTX 3090 24 GB"}
    assert table[list(SETUP)].drop_duplicates().to_dict("records") == [SETUP]


def test_check_passes_on_the_published_figures(tmp_path):
    proc = check(write_results(tmp_path / "run", PUBLISHED))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert list(verdicts(proc.stdout).values()) == ["PASS"] * 4
    assert "finding holds" in proc.stdout
    # the published slopes, by hand: (16630.95 - 9753.21) / 8 and (7283.11 - 5174.62) / 8
    assert "859.7 / 263.6 = 3.26" in proc.stdout
    assert "1.000 (+0.0%)" in proc.stdout and "not reported" in proc.stdout


def test_check_fails_when_batch_1_peaks_are_5_percent_apart(tmp_path):
    doctored = {**PUBLISHED, (1, 512): 4447.19 * 1.05}  # still within 10% of the published 4450.70
    proc = check(write_results(tmp_path / "run", doctored))
    assert proc.returncode == 1
    (criterion,) = failed(proc.stdout)
    assert criterion.startswith("batch-1 peaks at 128 and 512 within 2%") and "5.00% apart" in criterion


def test_check_fails_when_a_point_is_15_percent_off(tmp_path):
    # batch 8 at 512 +15%: the slope ratio moves to (16630.95 - 11216.19) / 8 / 263.56 = 2.57, still in range
    doctored = {**PUBLISHED, (8, 512): 9753.21 * 1.15}
    proc = check(write_results(tmp_path / "run", doctored))
    assert proc.returncode == 1
    (criterion,) = failed(proc.stdout)
    assert criterion.startswith("every published figure matched within 10%") and "batch 8 at 512: +15.0%" in criterion


def test_check_fails_when_the_slope_ratio_is_out_of_range(tmp_path):
    # each point within 10%, but the slope at 512 drops to (15134.17 - 10630.999) / 8 = 562.9: ratio 2.14
    doctored = {**PUBLISHED, (8, 512): 9753.21 * 1.09, (16, 512): 16630.95 * 0.91}
    proc = check(write_results(tmp_path / "run", doctored))
    assert proc.returncode == 1
    (criterion,) = failed(proc.stdout)
    assert criterion.startswith("slope ratio 512/128") and "= 2.14" in criterion


def test_check_fails_when_batch_32_at_512_is_not_above_24_gib(tmp_path):
    proc = check(write_results(tmp_path / "run", {**PUBLISHED, (32, 512): 24_300.0}))  # 23.73 GiB < 24 GiB = 24,576 MiB
    assert proc.returncode == 1
    (criterion,) = failed(proc.stdout)
    assert criterion.startswith("batch 32 at 512 above 24 GiB (the RTX 3090 holds 23.69 GiB)")


def test_check_passes_a_batch_32_figure_just_above_24_gib(tmp_path):
    proc = check(write_results(tmp_path / "run", {**PUBLISHED, (32, 512): 24_600.0}))  # just above 24,576 MiB
    assert proc.returncode == 0, proc.stdout


def test_check_fails_on_a_sweep_missing_published_points(tmp_path):
    partial = {k: v for k, v in PUBLISHED.items() if k[0] != 16}
    proc = check(write_results(tmp_path / "run", partial))
    assert proc.returncode == 1
    assert len(failed(proc.stdout)) == 2  # no slope, and published figures without ours
    assert "batch 16 at 512: ours missing" in proc.stdout


@pytest.mark.parametrize("make, message", [
    (lambda tmp: tmp / "nope", "is not a vlmprobe results dir (no results.csv)"),
    (lambda tmp: write_results(tmp / "run", PUBLISHED, model="nanovlm_tiny"), "has no rows with the published setup"),
    (lambda tmp: write_results(tmp / "run", PUBLISHED, autocast_dtype=None), "has no rows with the published setup"),
])
def test_check_refuses_a_dir_it_cannot_judge_in_one_line(tmp_path, make, message):
    proc = check(make(tmp_path))
    assert proc.returncode == 2
    assert proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1 and message in proc.stderr


def test_report_sets_ours_beside_the_published_figures(tmp_path):
    ours = {**PUBLISHED, (8, 512): 9753.21 * 0.95, (32, 128): 10_869.0}
    out = write_results(tmp_path / "run", ours, backend="estimate")
    write_reports(out, AXES, {"device_name": "x86_64 CPU (fake tensors)"})
    summary = (out / "summary.md").read_text()
    assert "## Against the published figures (nanoVLM issue #103, RTX 3090, measured)" in summary
    assert "ESTIMATES" in summary and "ours MiB (estimate)" in summary
    assert "0.950 (-5.0%)" in summary and "not reported" in summary
    # ours at 512: (16630.95 - 9265.55) / 8 = 920.7 MiB per sample; over the published 263.6 at 128: 3.49
    assert markdown_row(summary, "MiB per sample, batch 8 -> 16, length 512") == ["920.7", "859.7"]
    assert markdown_row(summary, "slope ratio 512 / 128") == ["3.49", "3.26"]
    assert markdown_row(summary, "batch sizes that fit the RTX 3090, length 128") == ["1, 8, 16, 32",
                                                                                     "1, 8, 16 (32: no figure)"]
    assert "25,438,126,080 B = 23.69 GiB" in summary
    assert (out / "plot.png").stat().st_size > 0


def test_report_of_another_model_has_no_published_figures(tmp_path):
    out = write_results(tmp_path / "run", {(1, 32): 1.7, (2, 32): 1.9}, backend="estimate", model="nanovlm_tiny")
    write_reports(out, AXES, {})
    summary = (out / "summary.md").read_text()
    assert "published" not in summary and "ESTIMATES" in summary


def test_seq_len_sweep_on_the_estimate_backend_reproduces_the_finding(tmp_path):
    """CI runs the finding check on every commit: the real sweep through the CLI, then the check."""
    proc = run_cli(["+sweep=seq_len", "measure.backend=estimate", f"results_dir={tmp_path}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    (out,) = tmp_path.glob("seq_len/*")
    result = check(out)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "backend estimate" in result.stdout
    assert "## Against the published figures" in (out / "summary.md").read_text()
