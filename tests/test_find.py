"""+find=max_batch: bisection against a hand-made threshold, and the mode end to end."""

import math
import re

import pandas as pd
import pytest

from conftest import run_cli
from vlmprobe.run.max_batch import fits, largest_fitting, most_probes


def threshold_probe(limit, calls):
    def probe(batch_size):
        calls.append(batch_size)
        ok = batch_size <= limit
        return {"status": "ok" if ok else "oom", "peak_allocated_bytes": batch_size * 10 if ok else None,
                "peak_reserved_bytes": None}
    return probe


@pytest.mark.parametrize("limit", [1, 2, 300, 511, 512, 513, 1023, 1024])
def test_bisection_finds_the_largest_fitting_batch_in_at_most_11_probes(limit):
    calls = []
    assert largest_fitting(threshold_probe(limit, calls), 1, 1024, budget=10**9) == limit
    assert len(calls) <= math.ceil(math.log2(1024)) + 1 == 11
    assert len(set(calls)) == len(calls)  # no batch size probed twice


@pytest.mark.parametrize("low, high", [(1, 1), (1, 2), (1, 7), (1, 8), (3, 10), (1, 64)])
def test_the_progress_bar_total_is_the_most_probes_any_threshold_takes(low, high):
    taken = []
    for limit in range(low - 1, high + 1):
        calls = []
        largest_fitting(threshold_probe(limit, calls), low, high, budget=10**9)
        taken.append(len(calls))
    assert max(taken) == most_probes(low, high)  # counted over every outcome, not from the formula


def test_nothing_fits_when_the_smallest_batch_does_not():
    calls = []
    assert largest_fitting(threshold_probe(0, calls), 1, 1024, budget=10**9) is None and calls == [1]


def test_a_probe_fits_by_its_reserved_peak_where_measured_else_its_allocated_peak():
    assert fits({"status": "ok", "peak_allocated_bytes": 90, "peak_reserved_bytes": None}, 100)
    assert not fits({"status": "ok", "peak_allocated_bytes": 90, "peak_reserved_bytes": 120}, 100)
    assert not fits({"status": "oom", "peak_allocated_bytes": 10, "peak_reserved_bytes": None}, 100)


def test_a_probe_fits_by_what_the_card_would_show_where_a_card_is_named():
    row = {"status": "ok", "peak_allocated_bytes": 80, "peak_reserved_bytes": 90, "predicted_device_bytes": 110}
    assert not fits(row, 100) and fits(row, 110)


def test_the_margin_keeps_room_free_below_the_budget(compose):
    from omegaconf import OmegaConf

    from vlmprobe.run.max_batch import MaxBatchSearch

    overrides = ["+find=max_batch", "model=nanovlm_tiny", "device=rtx3090", "measure.backend=estimate"]
    search = MaxBatchSearch(compose, overrides, OmegaConf.to_container(compose(overrides), resolve=True))
    assert search.margin == int(0.05 * 25_438_126_080)  # the default: 5 % of the card
    overrides.append("find.margin=1GiB")
    assert MaxBatchSearch(compose, overrides, OmegaConf.to_container(compose(overrides), resolve=True)).margin == 2**30


def test_max_batch_mode_reports_a_batch_that_fits_and_one_more_that_does_not(tmp_path):
    # the estimate: a 6 MiB budget is below what a CUDA card needs for its cuBLAS workspace alone
    proc = run_cli(["+find=max_batch", "memory_budget=6MiB", "find.margin=0", "measure.backend=estimate", "+sweep=smoke", "~sweep.axes.data.batch_size",
                    "sweep.axes.data.lm_max_length=[64]", f"results_dir={tmp_path}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    (out,) = tmp_path.glob("*/*/")
    found = pd.read_csv(out / "max_batch.csv")
    rows = pd.read_csv(out / "results.csv").set_index("batch_size")
    best = int(found["largest_batch_size"].iloc[0])
    assert rows.loc[best, "status"] == "ok" and rows.loc[best, "peak_allocated_bytes"] <= 6 * 2**20
    assert rows.loc[best + 1, "status"] == "oom"  # bisection always probes the neighbour above the answer
    assert found["probes"].iloc[0] == len(rows) <= 11
    assert "Largest batch size that fits 6.0 MiB" in (out / "summary.md").read_text()
    assert proc.stdout.startswith("## Largest batch size that fits 6.0 MiB")  # the answer on stdout, not only a file
    assert re.search(rf"\| data\.lm_max_length=64 \|\s+{best} \|", proc.stdout)


def test_max_batch_without_a_budget_is_one_clear_line(tmp_path):
    proc = run_cli(["+find=max_batch", f"results_dir={tmp_path}"], cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "vlmprobe: memory_budget=null is not allowed with +find=max_batch: give bytes or a size like 24GiB, or a "
        "card (device=rtx3090, ...) whose total memory is the budget"]


def test_a_card_without_a_budget_is_searched_against_its_whole_memory(compose):
    from omegaconf import OmegaConf

    from vlmprobe.run.max_batch import MaxBatchSearch

    overrides = ["+find=max_batch", "model=nanovlm_tiny", "device=rtx3090", "measure.backend=estimate"]
    search = MaxBatchSearch(compose, overrides, OmegaConf.to_container(compose(overrides), resolve=True))
    assert search.budget == 25_438_126_080  # conf/device/rtx3090.yaml's total_memory
    assert search.planned[0].config["measure"]["device_memory"] == 25_438_126_080
