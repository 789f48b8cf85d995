"""The estimate against the CUDA measurements committed under results/gpu_check/ (real runs, each on the card its
env.json names): every point of each nightly sweep a GPU check measured, estimated for that card as
scripts/check_estimate.py --cuda-dir does, is within TOLERANCE of its measured peak allocated
(max_memory_allocated) and peak reserved (max_memory_reserved) bytes, with the same status. A run whose directory
holds SUPERSEDED.md measured a program the code no longer runs (the file says what changed): it is not a
measurement of what the estimate runs today, and is skipped with that reason."""

import pytest

from conftest import REPO, load_script
from vlmprobe.results import gpu_check_runs, superseded

CUDA_RUNS = gpu_check_runs(REPO / "results" / "gpu_check")
TOLERANCE = 0.5  # percent
# Known reserved-memory gaps, (card, point) -> the measured gap in percent, open (issue 12). At the one whose CUDA
# trace was recorded (batch 1 at 512: check_allocator.log beside the run) the allocator model fed that trace gives
# CUDA's peak reserved to the byte, so that gap is in the estimate's sequence of allocations, not in the allocator's
# rules; the other two were not recorded. Each stays beyond TOLERANCE or the test says to drop it.
RESERVED_GAPS = {("nvidia-h200", "data.batch_size=1,data.lm_max_length=512"): 2.40,
                 ("nvidia-h200", "data.batch_size=8,data.lm_max_length=128"): 2.02,
                 ("nvidia-h200", "data.batch_size=16,data.lm_max_length=128"): -0.53}  # two 20 MiB segments


def test_there_are_cuda_measurements_to_judge_the_estimate_by():
    assert [run for run in CUDA_RUNS if not superseded(run)], \
        "no results/gpu_check/<card>/<stamp>/nightly/<sweep>/<stamp>/results.csv of a program the code runs today"


@pytest.mark.parametrize("run", CUDA_RUNS, ids=lambda p: f"{p.parents[3].name}/{p.parent.name}")
def test_the_estimate_for_the_card_is_within_half_a_percent_of_every_measured_peak(run, tmp_path):
    if note := superseded(run):
        pytest.skip(note.split(". ")[0])
    table = load_script("check_estimate").against(run, tmp_path)
    assert len(table) and (table["status_cuda"] == table["status_estimate"]).all()
    assert table["rel_error_%"].abs().max() <= TOLERANCE, table.to_string()
    card = run.parents[3].name
    gaps = {p: RESERVED_GAPS[(card, p)] for p in table["point_id"] if (card, p) in RESERVED_GAPS}
    known = table["point_id"].isin(gaps)
    assert table.loc[~known, "reserved rel_error_%"].abs().max() <= TOLERANCE, table.to_string()
    for point, error in zip(table.loc[known, "point_id"], table.loc[known, "reserved rel_error_%"]):
        assert abs(error) > TOLERANCE, f"{card} {point}: reserved now within {TOLERANCE}% ({error}): drop its gap"
        assert error == pytest.approx(gaps[point], abs=0.05), (point, error)


@pytest.mark.parametrize("ran, card, estimated", [
    (["+sweep=seq_len"], "NVIDIA H100 80GB HBM3", ["+sweep=seq_len", "device=h100_80gb"]),
    (["+sweep=x", "device=none", "measure.backend=cuda"], "NVIDIA H100 80GB HBM3", ["+sweep=x", "device=h100_80gb"]),
    (["+sweep=x", "device=a100_80gb"], "NVIDIA H100 80GB HBM3", ["+sweep=x", "device=a100_80gb"]),  # its own choice
    (["+sweep=x", "results_dir=/tmp/r"], "NVIDIA B200", ["+sweep=x"]),  # no profile is that card's
])
def test_a_cuda_run_that_named_no_card_is_estimated_for_the_card_it_ran_on(ran, card, estimated):
    overrides = load_script("check_estimate").estimate_overrides({"overrides": ran, "device_name": card})
    assert overrides == [*estimated, "measure.backend=estimate"]
