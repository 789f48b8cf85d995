"""The timeline of a point's run (vlmprobe.estimate.allocator.Timeline): allocated and reserved after each allocation,
bucketed by each bucket's maximum, with the step's phases; carried to timeline.jsonl and drawn as timeline.png.
Checked against the row's own peaks (an independent reading of the same allocator model) and a hand reckoning of the
buckets."""

import json
import random

import pandas as pd

from vlmprobe.estimate.allocator import Timeline
from vlmprobe.point.measure import measure


def test_buckets_keep_their_maximum_and_stay_within_the_limit():
    rng = random.Random(7)
    values = [rng.randrange(10**6) for _ in range(1001)]
    timeline = Timeline(limit=16)
    for value in values:
        timeline.note(value, value + 1)
    data = timeline.data()
    width = data["width"]
    # 16 buckets of 1 are merged into 8 of 2 at the 17th allocation, ... into 8 of 64 at the 513th: 1001 make 16 of 64
    assert len(data["allocated"]) == 16 and width == 64
    # each bucket is the maximum of its own allocations, by hand
    assert data["allocated"] == [max(values[i:i + width]) for i in range(0, len(values), width)]
    assert data["reserved"] == [v + 1 for v in data["allocated"]] and data["x"] == list(range(0, 1001, 64))
    assert data["allocations"] == 1001 and max(data["allocated"]) == max(values)


def test_the_timelines_highest_figures_are_the_rows_peaks_and_its_phases_follow_the_steps(point):
    row = measure(point(["model=nanovlm_tiny", "data.batch_size=2", "data.lm_max_length=48", "measure.steps=3",
                         "measure.backend=estimate", "device=rtx3090"]))
    assert row["status"] == "ok"
    timeline = row["timeline"]
    # the load's peak is below the steps' here, so the run's highest figures are the steps' peaks
    assert row["load_peak_bytes"] < row["peak_allocated_bytes"]
    assert max(timeline["allocated"]) == row["peak_allocated_bytes"]
    assert max(timeline["reserved"]) == row["peak_reserved_bytes"]
    names = [name for name, _, _ in timeline["phases"]]
    assert names == ["load"] + ["forward", "backward", "optimizer"] * 3
    ends = [end for _, _, end in timeline["phases"]]
    assert all(first <= end for _, first, end in timeline["phases"]) and ends[-1] == timeline["allocations"]
    assert len(timeline["x"]) <= 2000


def test_an_oom_rows_timeline_stays_under_the_capacity_and_leaves_its_phase_open(point):
    row = measure(point(["model=nanovlm_tiny", "measure.backend=estimate", "measure.device_memory=2MiB"]))
    assert row["status"] == "oom"
    timeline = row["timeline"]
    assert max(timeline["reserved"]) <= row["imposed_capacity_bytes"]
    assert timeline["phases"][-1] == [row["peak_phase"], timeline["phases"][-1][1], None]  # where it ran out


def test_a_sweep_writes_timeline_jsonl_and_timeline_png_and_no_timeline_column(cli, tmp_path):
    code, err = cli(["+sweep=smoke", "sweep.axes.data.batch_size=[1]", "sweep.axes.data.lm_max_length=[32]",
                     "launcher=local"])
    assert code == 0, err
    (out_dir,) = (tmp_path / "r" / "smoke").iterdir()
    table = pd.read_csv(out_dir / "results.csv")
    lines = [json.loads(line) for line in (out_dir / "timeline.jsonl").read_text().splitlines()]
    assert [line["point_id"] for line in lines] == list(table["point_id"]) and len(lines) == 1
    assert "timeline" not in table and table["oom_filled"].isna().all()
    for line in lines:
        assert max(line["allocated"]) == table.set_index("point_id").loc[line["point_id"], "peak_allocated_bytes"]
    assert (out_dir / "timeline.png").stat().st_size > 0
