#!/usr/bin/env python
"""Speed of the estimate backend on this machine, against the targets of the estimate issue.

Runs (1) one qwen2_vl_7b point (bf16 weights, batch 1, lm_max_length 2048, 448 px), (2) the whole seq_len
sweep and (3) the 100-point grid100 sweep, each under launcher=local, launcher=pool and launcher=auto (all
usable cores), (4) one qwen2_vl_7b FSDP2 point and one ZeRO-3 point at world size 8 (all ranks alike, so one rank is
simulated), (5) one qwen2_5_vl_7b GRPO step, (6) issue 49's many-steps target scaled down (a dataset's steps on 2
ZeRO-3 ranks), each as `python -m vlmprobe ... measure.backend=estimate` in a subprocess, and (7) the smoke sweep
on the cpu backend under launcher=local, in the sweep process and in a fresh worker per point
(measure.isolate=true), forked from the sweep or spawned (`python -m vlmprobe.point.worker`, as where
vlmprobe.run.workers.fork_refusal refuses a fork: child.FORKS set false in the sweep process); and prints a table:
step time (the row's step_time_s), wall time and the subprocess's peak RSS (under pool and auto: the sweep
process's own, not its workers'), then the ratios of each sweep's wall times, local / pool and local / auto, and
what a fresh worker adds to a point, forked and spawned.

    python scripts/bench_estimate.py [NAME_PART]   # e.g. fsdp2: only the cases whose name contains it
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

CASES = [
    ("qwen2_vl_7b bf16 b1 L2048 448px", ["model=qwen2_vl_7b", "train.param_dtype=bfloat16", "train.autocast_dtype=null",
                                         "data.batch_size=1", "data.lm_max_length=2048", "data.image_size=448"],
     {"step_time_s": 5.0, "rss_gib": 1.0}),
    ("seq_len sweep (8 points), launcher=local", ["+sweep=seq_len", "launcher=local"], {"wall_s": 60.0}),
    # the same points, several at once (the target for the sweep: 12 s on a 2-core machine)
    ("seq_len sweep (8 points), launcher=pool", ["+sweep=seq_len", "launcher=pool"], {"wall_s": 12.0}),
    # the default: pool where points can run at once (here), else local
    ("seq_len sweep (8 points), launcher=auto", ["+sweep=seq_len", "launcher=auto"], {"wall_s": 12.0}),
    # the launcher issue's targets: a usual 100-point question in at most 2.5 minutes, under either launcher
    ("grid100 (100 points), launcher=local", ["+sweep=grid100", "launcher=local"], {"wall_s": 150.0}),
    ("grid100 (100 points), launcher=pool", ["+sweep=grid100", "launcher=pool"], {"wall_s": 150.0}),
    ("grid100 (100 points), launcher=auto", ["+sweep=grid100", "launcher=auto"], {"wall_s": 150.0}),
    ("qwen2_vl_7b fsdp2 world 8 (one rank simulated)",
     ["model=qwen2_vl_7b", "dist=fsdp2_bf16", "dist.world_size=8", "data.batch_size=1", "data.lm_max_length=2048",
      "data.image_size=448"], {"wall_s": 30.0, "rss_gib": 2.0}),
    # the sharding issue's own case: the real DeepSpeed engine, ZeRO-3, bf16 weights as its bf16 mode runs them
    # (every rank alike: one rank simulated, in a fresh process)
    ("qwen2_vl_7b zero3 world 8 (one rank simulated)",
     ["model=qwen2_vl_7b", "dist=zero3", "dist.world_size=8", "train.param_dtype=bfloat16",
      "train.autocast_dtype=null", "data.batch_size=1", "data.lm_max_length=2048", "data.image_size=448"],
     {"wall_s": 30.0, "rss_gib": 2.0}),
    # the GRPO issue's target: a Qwen2.5-VL-7B GRPO point, 4 generations of 512 tokens (one prompt, 4 rows, bf16
    # weights as VLM-R1 loads them), one optimizer step (rollout, reference, policy, optimizer)
    ("qwen2_5_vl_7b grpo G4 C512 rows 4, 1 step",
     ["model=qwen2_5_vl_7b", "step=grpo", "step.num_generations=4", "step.max_completion_length=512",
      "data.batch_size=4", "train.param_dtype=bfloat16", "train.autocast_dtype=null", "measure.steps=1"],
     {"wall_s": 60.0}),
    # issue 49's target, scaled down: 1,000 steps of Qwen2-VL-7B LoRA on 8 ZeRO-3 ranks with varied images in 120 s
    # is 15 ms a step and rank; here 2 ranks x 2 steps of a seeded synthetic dataset, so 4 x 15 ms = 0.06 s
    ("qwen2_vl_7b lora zero3, data.source: 2 ranks x 2 steps",
     ["model=qwen2_vl_7b", "dist=zero3", "dist.world_size=2", "train.param_dtype=bfloat16", "train.autocast_dtype=null",
      "train.lora_r=16", "train.freeze_vision=true", "train.grad_ckpt.lm=true", "data.batch_size=1",
      "data.lm_max_length=2048", "data.steps=2",
      "data.source='synthetic:{\"samples\": 64, \"seed\": 0, \"text_tokens\": {\"uniform\": [100, 1500]}, "
      "\"images_per_sample\": {\"constant\": 1}, \"image_height\": {\"uniform\": [336, 1344]}, "
      "\"image_width\": {\"uniform\": [336, 1344]}}'"],
     {"wall_s": 0.06}),
    # issue 52: a fresh worker per point (cuda's way), forked from the sweep or spawned; no target, a comparison
    ("smoke (4 points) cpu, in the sweep process", ["+sweep=smoke", "measure.backend=cpu", "launcher=local"], {}),
    ("smoke (4 points) cpu, isolate, forked workers",
     ["+sweep=smoke", "measure.backend=cpu", "measure.isolate=true", "launcher=local"], {}),
    ("smoke (4 points) cpu, isolate, spawned workers",
     ["+sweep=smoke", "measure.backend=cpu", "measure.isolate=true", "launcher=local"], {}, "spawned"),
]
# `python -m vlmprobe` with every point's worker spawned: no fork (vlmprobe.run.workers.fork_refusal)
SPAWNING = ("import runpy; from vlmprobe import child; child.FORKS = False; "
            "runpy.run_module('vlmprobe', run_name='__main__', alter_sys=True)")


def run(args: list[str], spawned: bool = False) -> dict:
    """The case `args` (measure.backend=estimate unless they say otherwise); `spawned`: no worker is forked."""
    with tempfile.TemporaryDirectory() as tmp, open(Path(tmp) / "stderr", "w+") as err:
        started = time.perf_counter()
        command = ["-c", SPAWNING] if spawned else ["-m", "vlmprobe"]
        proc = subprocess.Popen([sys.executable, *command, "measure.backend=estimate", *args, f"results_dir={tmp}"],
                                stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage: ru_maxrss in KiB on Linux
        wall = time.perf_counter() - started
        if os.waitstatus_to_exitcode(status) != 0:
            err.seek(0)
            raise SystemExit(f"failed: {' '.join(args)}\n{err.read()[-2000:]}")
        table = pd.read_csv(next(Path(tmp).glob("*/*/results.csv")))
    return {"wall_s": wall, "step_time_s": table["step_time_s"].max(), "rss_gib": usage.ru_maxrss / 2**20,
            "points": len(table), "status": ",".join(sorted(set(table["status"])))}


def main() -> None:
    chosen = sys.argv[1] if len(sys.argv) > 1 else ""  # run only the cases whose name contains this
    rows = []
    for name, args, targets, *how in CASES:
        if chosen not in name:
            continue
        measured = run(args, spawned="spawned" in how)
        verdict = all(measured[k] is not None and measured[k] <= v for k, v in targets.items()) if targets else None
        rows.append({"case": name, **{k: round(v, 2) if isinstance(v, float) else v for k, v in measured.items()},
                     "targets": ", ".join(f"{k} <= {v}" for k, v in targets.items()), "meets": verdict})
    print(pd.DataFrame(rows).to_markdown(index=False))
    walls = {row["case"]: row["wall_s"] for row in rows}
    for sweep in ("seq_len sweep (8 points)", "grid100 (100 points)"):
        local = walls.get(f"{sweep}, launcher=local")
        for other in ("pool", "auto"):
            wall = walls.get(f"{sweep}, launcher={other}")
            if local and wall:
                print(f"\n{sweep} wall time, local / {other}: {local / wall:.2f} "
                      f"({other}: {len(os.sched_getaffinity(0))} jobs, launcher.jobs=null)")
    per_point = {row["case"].rpartition(", ")[2]: row["wall_s"] / row["points"] for row in rows
                 if row["case"].startswith("smoke (4 points) cpu")}
    if {"forked workers", "spawned workers"} <= per_point.keys():
        print(f"\nsmoke on cpu, launcher=local, wall seconds a point: "
              + ", ".join(f"{how} {seconds:.2f}" for how, seconds in per_point.items())
              + f"; a spawned worker costs {per_point['spawned workers'] - per_point['forked workers']:.2f} s a point "
                f"more than a forked one (a forked worker runs torch on one thread: vlmprobe.child._as_child)")
    print("\nrss_gib: peak resident set of the vlmprobe process (GiB, 1024^3 B); step_time_s: slowest point's last step "
          "(a replayed step where the estimate replays the steps after the first: vlmprobe/estimate/replay/steps.py).")


if __name__ == "__main__":
    main()
