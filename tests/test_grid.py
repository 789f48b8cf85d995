import pytest

from vlmprobe.config.grid import Point, expand, flatten_axes
from vlmprobe.errors import ConfigError


def test_expand_is_the_cartesian_product_with_the_first_axis_slowest():
    points = expand({"data": {"batch_size": [1, 8], "lm_max_length": [128, 512]}})
    assert [p.values for p in points] == [
        {"data.batch_size": 1, "data.lm_max_length": 128},
        {"data.batch_size": 1, "data.lm_max_length": 512},
        {"data.batch_size": 8, "data.lm_max_length": 128},
        {"data.batch_size": 8, "data.lm_max_length": 512},
    ]
    assert [p.index for p in points] == [0, 1, 2, 3]


def test_point_id_is_the_overrides_hydra_reads_back():
    point = Point(0, {"data.batch_size": 8, "train.autocast_dtype": None, "measure.isolate": True, "model": "nanovlm_tiny"})
    assert point.overrides == ["data.batch_size=8", "train.autocast_dtype=null", "measure.isolate=true", "model=nanovlm_tiny"]
    assert point.id == "data.batch_size=8,train.autocast_dtype=null,measure.isolate=true,model=nanovlm_tiny"


def test_no_axes_is_one_default_point():
    (point,) = expand({})
    assert point.id == "default" and point.overrides == []


@pytest.mark.parametrize("bad", [{"data": {"batch_size": []}}, {"data": {"batch_size": 4}}])
def test_an_axis_must_be_a_non_empty_list(bad):
    with pytest.raises(ConfigError, match=r"sweep.axes.data.batch_size=.* non-empty list"):
        flatten_axes(bad)


def test_cases_go_together_and_cross_the_axes():
    points = expand({"data": {"batch_size": [1, 2]}}, [{}, {"train": {"grad_ckpt": {"lm": True}}, "optimizer": "sgd_momentum"}])
    assert [p.id for p in points] == [
        "data.batch_size=1", "data.batch_size=2",
        "train.grad_ckpt.lm=true,optimizer=sgd_momentum,data.batch_size=1",
        "train.grad_ckpt.lm=true,optimizer=sgd_momentum,data.batch_size=2",
    ]
    assert [p.case for p in points] == ["baseline", "baseline"] + ["train.grad_ckpt.lm=true,optimizer=sgd_momentum"] * 2


def test_a_case_that_picks_a_group_option_sets_that_options_own_keys(plan_points):
    # the preset's base is dist=zero2, which has no stage-3 keys; its last cases pick zero3 and set them, and keep
    # what the preset set for every dist (4 ranks)
    points = plan_points(["+sweep=preset_video_r1_sft_4xa100"])
    dists = [p.config["dist"] for p in points]
    assert [d["name"] for d in dists] == ["zero2"] * 6 + ["zero3"] * 2
    assert all("stage3_prefetch_bucket_size" not in d for d in dists[:6])
    assert all(d["stage3_prefetch_bucket_size"] == 11560550 and d["overlap_comm"] for d in dists[6:])
    assert {d["world_size"] for d in dists} == {4}


def test_a_cases_sweep_plots_one_bar_per_case(tmp_path):
    import pandas as pd

    from vlmprobe.results.report import plot

    table = pd.DataFrame({"sweep": "knobs", "model": "m", "backend": "estimate", "case": ["baseline", "optimizer=sgd", "x"],
                          "status": ["ok", "ok", "oom"], "peak_allocated_bytes": [2**30, 2**29, None]})
    plot(table, ["case"], tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 10_000
