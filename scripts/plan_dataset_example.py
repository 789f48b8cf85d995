#!/usr/bin/env python
"""The planning example of docs/datasets.md: a stated synthetic dataset planned for Qwen2-VL-7B (batch 4, 8 ranks,
grad_accum 2, 100 steps, max_length 4096, seed 42) under three samplers; prints, per sampler, the first step with a
micro batch padded to the max length and the median padded length. Lengths only: no model is built or run.

    python scripts/plan_dataset_example.py
"""

import json
import statistics
import time
from pathlib import Path

from omegaconf import OmegaConf

from vlmprobe.dataset import plan_batches, read_samples, summarize_plan
from vlmprobe.point.build import build_spec

SOURCE = {"samples": 10000, "seed": 0, "text_tokens": {"lognormal": {"mean": 5.5, "sigma": 0.8}},
          "images_per_sample": {"choice": [1, 2]}, "image_height": {"uniform": [336, 1344]},
          "image_width": {"uniform": [336, 1344]}}
MAX_LENGTH = 4096


def main() -> None:
    model = Path(__file__).resolve().parents[1] / "conf" / "model" / "qwen2_vl_7b.yaml"
    spec = build_spec(OmegaConf.to_container(OmegaConf.load(model)))
    samples = read_samples("synthetic:" + json.dumps(SOURCE))
    started = time.perf_counter()
    print(f"{'sampler':<16} {'first step at max length':>24} {'median padded length':>21}")
    for sampler in ("random", "group_by_length", "worst_first"):
        rows = summarize_plan(plan_batches(samples, spec, batch_size=4, world_size=8, grad_accum=2, steps=100,
                                           sampler=sampler, max_length=MAX_LENGTH, seed=42))
        full = [r["step"] for r in rows if r["padded_length"] == MAX_LENGTH]
        median = statistics.median(r["padded_length"] for r in rows)
        print(f"{sampler:<16} {min(full) if full else '-':>24} {median:>21}")
    print(f"planned in {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
