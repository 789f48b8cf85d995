"""A dataset's batches run step after step through the allocator (data.source=, vlmprobe.point.dataset_steps): the
estimate equals the cpu backend to the byte step by step, a longer batch's step has the higher peak, a capacity the
third batch exceeds ends the run there with that batch named, and each unsupported setting is one line. Checked
against the cpu backend (real tensors), a hand ordering of the batches, and the transformers Qwen2-VL model itself
(the batch's image features must match its image tokens, or its forward raises)."""

import json

import pandas as pd
import pytest
from conftest import load_script

from vlmprobe.errors import ConfigError
from vlmprobe.point.dataset_steps import append_steps_csv
from vlmprobe.point.measure import measure
from vlmprobe.results import report
from vlmprobe.results.answer import verdict
from vlmprobe.results.table import read_table

# sequential sampler, batch 2: step 1 short, step 2 medium, step 3 long (two 336 x 224 px images: 96 tokens each)
SAMPLES = [
    {"text_tokens": 20, "images": [[112, 112]]},
    {"text_tokens": 30, "images": [[56, 84]]},
    {"text_tokens": 80, "images": [[224, 168]]},
    {"text_tokens": 60, "images": [[112, 140], [56, 56]]},
    {"text_tokens": 150, "images": [[336, 224], [336, 224]]},
    {"text_tokens": 40, "images": []},
]
BASE = ["model=qwen2_vl_tiny", "data.batch_size=2", "data.steps=3", "data.sampler=sequential",
        "data.lm_max_length=1024"]


@pytest.fixture
def shapes(tmp_path):
    path = tmp_path / "shapes.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in SAMPLES))
    return path


RUNS: dict = {}  # the unbounded run of each family on both backends, made once for the tests that read it


def both_backends(point, shapes, *extra) -> dict:
    key = extra
    if key not in RUNS:
        RUNS[key] = {b: measure(point([*BASE, f"data.source={shapes}", f"measure.backend={b}", *extra]))
                     for b in ("estimate", "cpu")}
    return RUNS[key]


@pytest.fixture
def runs(point, shapes):
    return shapes, both_backends(point, shapes)


@pytest.mark.parametrize("family", [[], ["model=qwen3_vl_tiny"], ["model=glm4v_tiny"], ["model=llava_tiny"],
                                    ["model=internvl_tiny", "data.lm_max_length=2048"], ["data.packing=true"]],
                         ids=["qwen2_vl", "qwen3_vl", "glm4v", "llava", "internvl", "qwen2_vl_packed"])
def test_the_estimate_equals_the_cpu_backend_step_by_step_to_the_byte(point, shapes, family):
    rows = both_backends(point, shapes, *family)
    estimate, cpu = rows["estimate"], rows["cpu"]
    assert estimate["status"] == cpu["status"] == "ok"
    assert [r["step"] for r in estimate["steps"]] == [1, 2, 3]
    assert estimate["steps"] == cpu["steps"]  # every per-step figure, the batches' descriptions too
    for key in estimate:
        if key.endswith("_bytes"):
            assert estimate[key] == cpu[key], key


def test_the_longer_batchs_step_has_the_higher_allocated_peak(runs):
    _, rows = runs
    steps = rows["estimate"]["steps"]
    # by hand (smart_resize to multiples of 28 px, one token per 28 x 28 px, vision_start / end around each image):
    # step 1: 20 + 16 (112 x 112) + 2 and 30 + 6 (56 x 84) + 2 = 38; step 2: 80 + 48 (224 x 168) + 2 = 130 beside
    # 60 + 20 (112 x 140) + 4 (56 x 56) + 4 = 88; step 3: 150 + 2 x 96 + 4 = 346 beside 40
    lengths = [s["padded_length"] for s in steps]
    assert lengths == [38, 130, 346]
    peaks = [s["peak_allocated_bytes"] for s in steps]
    assert peaks[0] < peaks[1] < peaks[2]
    assert rows["estimate"]["peak_allocated_bytes"] == max(peaks)  # the row's peak is the run's
    assert steps[2]["images"] == "336x224 336x224" and steps[2]["image_tokens"] == 192


def test_a_packed_micro_batch_is_one_row_of_its_samples_and_needs_less_than_padding_them(point, shapes):
    padded = both_backends(point, shapes)["estimate"]["steps"]
    packed = both_backends(point, shapes, "data.packing=true")["estimate"]["steps"]
    assert [s["padded_length"] for s in packed] == [38 + 38, 130 + 88, 346 + 40]  # the samples' tokens, end to end
    # step 3 pads the 40-token sample to 346 and masks it: packed, 306 fewer tokens and no (2, 1, 346, 346) mask
    assert packed[2]["peak_allocated_bytes"] < padded[2]["peak_allocated_bytes"]


def test_a_capacity_the_third_batch_exceeds_ends_the_run_at_step_3_with_that_batch_named(runs, point):
    path, rows = runs
    steps = rows["estimate"]["steps"]
    # what steps 1-2 reserved unbounded (so they run as before), below what step 3 reserved unbounded; the allocator
    # then frees its cache and retries, and still cannot place step 3's blocks
    capacity = max(s["peak_reserved_bytes"] for s in steps[:2])
    assert capacity < steps[2]["peak_reserved_bytes"]
    row = measure(point([*BASE, f"data.source={path}", "measure.backend=estimate",
                         f"measure.device_memory={capacity}"]))
    assert row["status"] == "oom"
    assert [(r["step"], r["status"]) for r in row["steps"]] == [(1, "ok"), (2, "ok"), (3, "oom")]
    assert row["steps"][:2] == steps[:2]  # the steps before it ran as they did without the capacity
    line = verdict({**row, "point_id": "p", "device": None})
    assert "runs out at step 3: a batch with a 346-token sample holding two 336 x 224 images" in line


def test_a_sweep_writes_steps_csv_and_steps_png(cli, shapes, tmp_path):
    code, err = cli([*BASE, f"data.source={shapes}", "measure.backend=estimate"])
    assert code == 0, err
    (out_dir,) = (tmp_path / "r" / "single").iterdir()
    table = pd.read_csv(out_dir / "steps.csv")
    assert list(table.columns) == ["point_id", "step", "micro", "rank", "samples", "longest_tokens", "padded_length",
                                   "image_tokens", "images", "peak_allocated_bytes", "peak_reserved_bytes",
                                   "num_alloc_retries", "status"]
    assert table["step"].tolist() == [1, 2, 3] and (out_dir / "steps.png").stat().st_size > 0
    (row,) = pd.read_csv(out_dir / "results.csv").to_dict("records")  # the records are steps.csv's, not a row's
    assert row["data_source"] == str(shapes) and pd.isna(row["image_size"]) and pd.isna(row["image_tokens"])


@pytest.mark.parametrize("extra, words", [
    (["model=nanovlm_tiny"], "model=nanovlm_tiny is not allowed with data.source"),
    (["step=grpo", "step.num_generations=2"], "step=grpo is not allowed with data.source"),
    (["model=llava_tiny", "data.packing=true"], "data.packing=true is not allowed for llava_tiny"),
    (["data.image_size=224"], "data.image_size=224 is not allowed with data.source"),
    (["data.sampler=shuffled"], "data.sampler='shuffled' is not allowed: use one of random, group_by_length"),
    (["data.steps=0"], "data.steps=0 is not allowed"),
    (["data.lm_max_length=100"], "is not allowed for qwen2_vl_tiny: after truncation it keeps 100 tokens"),
])
def test_each_unsupported_setting_is_one_line(point, shapes, extra, words):
    with pytest.raises(ConfigError) as caught:
        point([*BASE, f"data.source={shapes}", "measure.backend=estimate", *extra])
    assert words in str(caught.value) and "\n" not in str(caught.value)


def ranks_steps(cli, shapes, tmp_path, backend: str, *extra) -> pd.DataFrame:
    """The steps.csv of one run (moved to tmp_path/BACKEND_steps.csv, ranks.csv beside it where there is one)."""
    code, err = cli([*BASE, f"data.source={shapes}", f"measure.backend={backend}", *extra])
    assert code == 0, err
    (out_dir,) = (tmp_path / "r" / "single").iterdir()
    steps = pd.read_csv(out_dir / "steps.csv")
    for path in (out_dir / "steps.csv", out_dir / "ranks.csv"):
        if path.exists():
            path.rename(tmp_path / f"{backend}_{path.name}")
    out_dir.rename(tmp_path / f"{backend}_run")
    return steps


@pytest.mark.parametrize("dist", ["ddp", pytest.param("fsdp2", marks=pytest.mark.slow)])
def test_each_rank_runs_its_own_batches_and_the_estimate_equals_real_gloo_ranks(cli, shapes, tmp_path, dist):
    # sequential sampler, batch 2, two ranks: batch i goes to rank i % 2 (accelerate's BatchSamplerShard), so rank 0
    # runs samples 0 1 then 4 5, rank 1 samples 2 3 then, the round unfinished, 0 1 again (even_batches)
    estimate = ranks_steps(cli, shapes, tmp_path, "estimate", f"dist={dist}", "dist.world_size=2", "data.steps=2")
    by_rank = {r: g["samples"].tolist() for r, g in estimate.groupby("rank")}
    assert by_rank == {0: ["0 1", "4 5"], 1: ["2 3", "0 1"]}
    ranks = pd.read_csv(tmp_path / "estimate_ranks.csv")
    assert ranks["simulated_as"].tolist() == [0, 1]  # each rank simulated itself: their batches differ
    drawn = {}  # steps.png: a line per rank
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(report, "save_panels", lambda plt, fig, axes, *args: drawn.update(axes=axes))
        report.steps_plot(read_table(tmp_path / "estimate_run" / "results.csv"), estimate, tmp_path / "steps.png")
    assert [line.get_label() for line in drawn["axes"][0, 0].get_lines()] == [
        "peak reserved (highest rank)", "rank 0 allocated", "rank 1 allocated"]
    cpu = ranks_steps(cli, shapes, tmp_path, "cpu", f"dist={dist}", "dist.world_size=2", "data.steps=2")  # torchrun
    byte_columns = ["rank", "step", "samples", "peak_allocated_bytes", "peak_reserved_bytes"]
    assert estimate[byte_columns].values.tolist() == cpu[byte_columns].values.tolist()


def test_a_point_run_again_on_resume_leaves_its_steps_once(tmp_path):
    first = [{"step": 1, "status": "ok"}, {"step": 2, "status": "oom"}]
    append_steps_csv(tmp_path, "a", first)
    append_steps_csv(tmp_path, "b", [{"step": 1, "status": "ok"}])
    append_steps_csv(tmp_path, "a", [{"step": 1, "status": "ok"}, {"step": 2, "status": "ok"}])  # "a" again
    table = pd.read_csv(tmp_path / "steps.csv")
    assert table[["point_id", "step", "status"]].values.tolist() == [["b", 1, "ok"], ["a", 1, "ok"], ["a", 2, "ok"]]


def test_check_estimate_compares_two_runs_step_by_step(runs, tmp_path):
    _, rows = runs
    for backend in ("estimate", "cpu"):  # each run's steps.csv as a sweep writes it
        (tmp_path / backend).mkdir()
        append_steps_csv(tmp_path / backend, "default", rows[backend]["steps"])
    check = load_script("check_estimate")
    table = check.step_by_step(tmp_path / "cpu" / "steps.csv", tmp_path / "estimate" / "steps.csv")
    assert table["step"].tolist() == [1, 2, 3]
    assert (table["rel_error_%"] == 0).all() and (table["reserved rel_error_%"] == 0).all()
