"""The answer a person reads: a table and a verdict per point on stdout (progress on stderr), JSON lines with
output=json, exit 1 with fail_on_oom=true, where an out-of-memory point ran out, and the front door (--help lists
the options, --cfg job prints the composed config)."""

import json

import pandas as pd

from conftest import CONF, run_cli
from vlmprobe.results.answer import answer_lines, verdict

GiB = 2**30
TINY = ["model=nanovlm_tiny", "data.batch_size=2", "data.lm_max_length=64", "measure.backend=estimate"]


def row(**figures) -> dict:
    return {"point_id": "p", "status": "ok", "device": "rtx4090", "peak_phase": "backward", **figures}


def test_a_verdict_says_the_room_left_or_how_far_over_from_the_rows_figures():
    capacity = 25_386_352_640  # the RTX 4090's total memory (conf/device/rtx4090.yaml)
    fits = row(imposed_capacity_bytes=capacity, predicted_device_bytes=capacity - 3 * GiB, peak_allocated_bytes=GiB)
    assert verdict(fits).startswith("p: fits on the NVIDIA GeForce RTX 4090 with 3.00 GiB to spare (20.64 GiB of 23.64 "
                                    "GiB, peak in backward; its CUDA context taken as 760.0 MiB, not measured on it)")
    over = row(imposed_capacity_bytes=capacity, predicted_device_bytes=capacity + GiB // 2, peak_allocated_bytes=GiB)
    assert verdict(over).startswith("p: does not fit on the NVIDIA GeForce RTX 4090: needs 24.14 GiB, 512.0 MiB over "
                                    "23.64 GiB")
    oom = row(status="oom", peak_phase="forward", imposed_capacity_bytes=capacity, oom_block_bytes=4_982_833_152,
              peak_allocated_bytes=21 * GiB)
    assert verdict(oom) == ("p: does not fit on the NVIDIA GeForce RTX 4090: ran out in forward, asking for 4.64 GiB "
                            "with 21.00 GiB allocated of 23.64 GiB")
    free = row(device="none", peak_allocated_bytes=5 * GiB, peak_reserved_bytes=6 * GiB)
    assert verdict(free) == ("p: needs 5.00 GiB allocated, 6.00 GiB reserved, peak in backward (no card given: "
                             "device=NAME gives a verdict)")
    assert verdict(row(device="none", peak_allocated_bytes=2_516_582, peak_reserved_bytes=4 * 2**20)).startswith(
        "p: needs 2.4 MiB allocated, 4.0 MiB reserved")  # a tiny model's figures, not 0.00 GiB


def test_the_table_breaks_the_peak_into_weights_gradients_optimizer_state_and_the_rest():
    figures = row(device="none", peak_allocated_bytes=10 * GiB, peak_reserved_bytes=11 * GiB, params_bytes=4 * GiB,
                  grads_bytes=GiB, optimizer_state_bytes=2 * GiB, backend="estimate")
    head, columns, line, blank, said = answer_lines(pd.DataFrame([figures]))
    assert columns.split() [:4] == ["point", "status", "peak", "alloc"]
    assert line.split() == ["p", "ok", "10.00", "11.00", "-", "-", "-", "4.00", "1.00", "2.00", "3.00", "backward"]
    assert head.startswith("vlmprobe: estimate (GiB = 2^30 B") and said == verdict(figures)


def test_the_answer_is_on_stdout_a_launch_guard_exits_1_and_an_oom_says_where(tmp_path):
    ok = run_cli([*TINY, f"results_dir={tmp_path}"], cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.splitlines()[-1].startswith("default: needs ") and "results in" not in ok.stdout
    assert "default: ok, peak" in ok.stderr and "points:" not in ok.stderr  # not a terminal: no bar, one line a point
    small = [*TINY, "measure.device_memory=2MiB", f"results_dir={tmp_path}", "fail_on_oom=true", "output=json"]
    out = run_cli(small, cwd=tmp_path)
    assert out.returncode == 1, out.stderr
    (record,) = [json.loads(line) for line in out.stdout.splitlines()]
    assert record["status"] == "oom" and record["backend"] == "estimate"
    assert record["peak_phase"] == "forward"  # where it ran out (the step's phases up to it fit in 2 MiB)
    # what held the memory when it ran out, in the second step's forward: the weights, AdamW's two moments of them
    # (fp32, a hand count), no gradient (zero_grad sets them to None)
    assert record["grads_bytes"] == 0 and record["optimizer_state_bytes"] == 2 * record["params_bytes"] > 0
    assert record["error"].endswith("alloc-conf)")  # the whole first line, never cut


def test_help_lists_the_options_and_cfg_job_prints_the_composed_config_own_configs_included(tmp_path):
    shown = run_cli(["--help"], cwd=tmp_path)
    assert shown.returncode == 0 and "  model: " in shown.stdout and "qwen2_5_vl_7b" in shown.stdout
    assert "  +sweep: " in shown.stdout and "  device: " in shown.stdout and "rtx4090" in shown.stdout
    job = run_cli(["model=qwen2_vl_2b", "data.batch_size=3", "--cfg", "job"], cwd=tmp_path)
    assert job.returncode == 0, job.stderr
    assert "name: qwen2_vl_2b" in job.stdout and "batch_size: 3" in job.stdout
    own = tmp_path / "mine" / "model"
    own.mkdir(parents=True)
    (own / "my_qwen.yaml").write_text((CONF / "model" / "qwen2_vl_tiny.yaml").read_text().replace(
        "name: qwen2_vl_tiny", "name: my_qwen"))
    mine = run_cli(["--config-dir", str(tmp_path / "mine"), "model=my_qwen", "--cfg", "job"], cwd=tmp_path)
    assert mine.returncode == 0 and "name: my_qwen" in mine.stdout, mine.stderr
    bad = run_cli(["data.batch_size=[1,", "--cfg", "job"], cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.startswith("vlmprobe: data.batch_size=[1, is not allowed")


def test_the_plot_draws_the_card_the_rows_ran_against_and_the_peak_in_its_parts(tmp_path):
    from vlmprobe.results.answer import breakdown
    from vlmprobe.results.report import card, plot

    figures = row(peak_allocated_bytes=10 * GiB, params_bytes=4 * GiB, grads_bytes=GiB, optimizer_state_bytes=2 * GiB,
                  imposed_capacity_bytes=25_386_352_640, sweep="single", model="m", backend="estimate")
    assert breakdown(figures) == {"weights": 4 * GiB, "gradients": GiB, "optimizer state": 2 * GiB, "rest": 3 * GiB}
    table = pd.DataFrame([figures])
    assert card(table) == {"capacity_bytes": 25_386_352_640, "capacity_label": "NVIDIA GeForce RTX 4090 capacity"}
    assert card(pd.concat([table, table.assign(imposed_capacity_bytes=GiB)])) == {}  # no one card to draw
    plot(table, [], tmp_path / "plot.png", **card(table))
    assert (tmp_path / "plot.png").stat().st_size > 0
