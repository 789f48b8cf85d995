#!/usr/bin/env python
"""ZeRO model states per GPU: the estimate (the real DeepSpeed engine on a fake process group, rank 0) against
DeepSpeed's own formulas, estimate_zero2_model_states_mem_needs and estimate_zero3_model_states_mem_needs
(deepspeed/runtime/zero/stage_1_and_2.py and stage3.py, no offload), for each model and world size.

Full fine-tune, bf16 weights as DeepSpeed's bf16 mode runs them (train.param_dtype=bfloat16, no autocast),
AdamW, batch 1 at a short length: the model states do not depend on the batch. Ours is rank 0's
`after_step_bytes`: what stays allocated once the optimizer step is done, i.e. what a rank carries from one
step to the next. The columns beside it are the row's own: the bf16 weights this rank holds (params_bytes),
the gradient buffers at the end of backward (grads_bytes, before the step), the AdamW moments.
DeepSpeed's formulas, with P the parameters (tied ones once), L the largest module's own parameters, N ranks:
  zero2: 2P + 18P/N   (2 = bf16 params; 18 = bf16 grads 2 + fp32 grads 4 + fp32 params 4 + Adam 8)
  zero3: 4L + 18P/N   (4L = the largest layer gathered, bf16 params + grads)
The difference, term by term (`explained`; `unexplained` is what is left after it, R being
zero_optimization.reduce_bucket_size in elements):
  zero2: formula - ours = 6P/N. After the step a rank holds the whole bf16 weights (2P), its fp32 master
         partition (4P/N) and AdamW's moments (8P/N): 2P + 12P/N. The formula's gradients, bf16 (2P/N) and
         their fp32 copy for the update (4P/N), live from backward into step() and are freed there: they are
         in `peak`, not held between steps.
  zero3: formula - ours = 4L + 2P/N - 2R. After the step a rank holds its bf16 weight partition (2P/N), its
         bf16 gradient partition (2P/N, kept by stage 3 between steps), the fp32 master (4P/N), AdamW's
         moments (8P/N) and the reduce bucket of R bf16 elements (2R bytes, 0.93 GiB at DeepSpeed's default
         5e8) that initialize allocates and the formula leaves out: 16P/N + 2R. The formula's fp32 gradient
         copy (4P/N, 2P/N more than ours holds for gradients) is a transient of step(), and its 4L the
         largest layer gathered during forward and backward: both are in `peak`.

    python scripts/check_zero_model_states.py [--models nanovlm_222m,qwen2_vl_2b] [--worlds 1,2,4,8,16]
                                               [--stages 2,3]
Needs DeepSpeed (pip install -e ".[deepspeed]"). Figures in GiB = 1024^3 bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time

import pandas as pd
import torch

from vlmprobe.distributed.ranks import simulate_elsewhere
from vlmprobe.models.base import count_params
from vlmprobe.plan import plan_overrides
from vlmprobe.results import GiB
from vlmprobe.worker import build_spec

SETUP = ["train.param_dtype=bfloat16", "train.autocast_dtype=null", "data.batch_size=1"]
SHORT = {"nanovlm_222m": ["data.lm_max_length=128"],  # 49 image tokens at its 224 px
         "qwen2_vl_2b": ["data.image_size=224", "data.lm_max_length=128"],  # 64 image tokens
         "qwen2_vl_7b": ["data.image_size=224", "data.lm_max_length=128"]}


def planned_config(overrides: list[str]) -> dict:
    (point,) = plan_overrides(overrides)
    return point.config


def sizes(config: dict) -> tuple[int, int]:
    """(P, L) as deepspeed.runtime.zero.stage3.model_to_params counts them, on the meta device."""
    model = build_spec(config["model"]).build(torch.device("meta"), torch.bfloat16, init=False)
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    return count_params(model)[0], largest


# formula - ours, term by term (see the module doc); P parameters, L the largest module's, N ranks, R the
# reduce bucket in elements
RANKS_PER_NODE = 8  # dist.ranks_per_node's default: DeepSpeed's CPU figure is per node
BUFFER_FACTOR = 1.5  # additional_buffer_factor, the margin DeepSpeed's formulas multiply their CPU bytes by
EXPLAINED = {2: lambda P, L, N, R: 6 * P / N, 3: lambda P, L, N, R: 4 * L + 2 * P / N - 2 * R}


def deepspeed_formula(stage: int, params: int, largest: int, world: int, offload: bool = False) -> tuple[int, int]:
    """(CPU bytes per node, GPU bytes per GPU) of DeepSpeed's formula for one node of `world` GPUs; offload:
    the optimizer (stage 2) or the optimizer and the parameters (stage 3) on the CPU, built under zero.Init
    for stage 3 (zero_init: the steady state, not the load of one whole model per rank)."""
    # DeepSpeed logs to stdout (its accelerator choice, on import): keep the printed table clean
    with contextlib.redirect_stdout(sys.stderr):
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    if stage == 2:
        return estimate_zero2_model_states_mem_needs(params, world, cpu_offload=offload)
    return estimate_zero3_model_states_mem_needs(params, largest, world, cpu_offload=offload,
                                                 cpu_offload_params=offload, zero_init=True)[:2]


RAW = ["model", "stage", "N", "offload", "P", "L", "R", "after_load_bytes", "after_step_bytes", "params_bytes",
       "grads_bytes", "optimizer_state_bytes", "peak_allocated_bytes", "after_step_host_bytes", "peak_host_bytes",
       "simulation_s"]
OFFLOAD = {2: ["dist.offload_optimizer=cpu"], 3: ["dist.offload_optimizer=cpu", "dist.offload_param=cpu"]}


def simulate(models: list[str], stages: list[int], worlds: list[int], offload: bool = False) -> pd.DataFrame:
    """Rank 0's figures of each (model, stage, world size): one fresh-process simulation each."""
    raw = []
    for model in models:
        params = largest = None
        for stage in stages:
            for world in worlds:
                config = planned_config([f"model={model}", *SETUP, *SHORT.get(model, []), f"dist=zero{stage}",
                                         f"dist.world_size={world}", "measure.backend=estimate",
                                         *(OFFLOAD[stage] if offload else [])])
                if params is None:
                    params, largest = sizes(config)
                started = time.perf_counter()
                row = simulate_elsewhere(config, 0)
                took = round(time.perf_counter() - started, 1)
                print(f"{model} zero{stage} N={world}: {row['status']} ({took:.0f} s)", file=sys.stderr, flush=True)
                if row["status"] != "ok":
                    print(f"  {row.get('error', '')[:300]}", file=sys.stderr)
                    continue
                raw.append({**{k: row[k] for k in RAW if k in row}, "model": model, "stage": stage, "N": world,
                            "offload": offload,
                            "P": params, "L": largest, "R": config["dist"]["reduce_bucket_size"], "simulation_s": took})
    return pd.DataFrame(raw, columns=RAW)


def compare(raw: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for r in raw.itertuples():
        ours = r.after_step_bytes
        theirs = deepspeed_formula(r.stage, r.P, r.L, r.N)[1]
        explained = EXPLAINED[r.stage](r.P, r.L, r.N, r.R)
        rows.append({"model": r.model, "stage": r.stage, "N": r.N,
                     "bf16 params": r.params_bytes / GiB, "grads before step": r.grads_bytes / GiB,
                     "optimizer": r.optimizer_state_bytes / GiB,
                     "after step (ours)": ours / GiB, "DeepSpeed formula": theirs / GiB,
                     "formula - ours": (theirs - ours) / GiB, "explained": explained / GiB,
                     "unexplained": (theirs - ours - explained) / GiB, "peak (ours)": r.peak_allocated_bytes / GiB})
    return pd.DataFrame(rows)


def compare_offload(raw: pd.DataFrame) -> pd.DataFrame:
    """Device and host, offloaded: ours per rank (host also per node: ranks_per_node ranks alike) beside
    DeepSpeed's GPU bytes per GPU and CPU bytes per node (its additional_buffer_factor 1.5 taken out)."""
    rows = []
    for r in raw.itertuples():
        cpu, gpu = deepspeed_formula(r.stage, r.P, r.L, r.N, offload=True)
        node = min(r.N, RANKS_PER_NODE)
        rows.append({"model": r.model, "stage": r.stage, "N": r.N,
                     "device after step (ours)": r.after_step_bytes / GiB, "DeepSpeed GPU": gpu / GiB,
                     "device peak (ours)": r.peak_allocated_bytes / GiB,
                     "host after step, rank (ours)": r.after_step_host_bytes / GiB,
                     "host after step, node (ours)": node * r.after_step_host_bytes / GiB,
                     "DeepSpeed CPU, node": cpu / BUFFER_FACTOR / GiB,
                     "ours / DeepSpeed, host": node * r.after_step_host_bytes / (cpu / BUFFER_FACTOR),
                     "host peak, node (ours)": node * r.peak_host_bytes / GiB})
    return pd.DataFrame(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="nanovlm_222m,qwen2_vl_2b")
    parser.add_argument("--worlds", default="1,2,4,8,16")
    parser.add_argument("--stages", default="2,3")
    parser.add_argument("--offload", action="store_true",
                        help="offload to the CPU: the optimizer (stage 2), the optimizer and the parameters (stage 3)")
    parser.add_argument("--save", help="write the simulations' raw figures (bytes) to this CSV")
    parser.add_argument("--rows", help="print the table from a CSV written by --save instead of simulating")
    args = parser.parse_args()
    if args.rows:
        raw = pd.read_csv(args.rows)
    else:
        raw = simulate(args.models.split(","), list(map(int, args.stages.split(","))),
                       list(map(int, args.worlds.split(","))), args.offload)
        if args.save:
            raw.to_csv(args.save, index=False)
    offloaded = raw["offload"].astype(bool) if "offload" in raw else pd.Series(False, index=raw.index)
    if (~offloaded).any():
        print(compare(raw[~offloaded]).to_markdown(index=False, floatfmt=".3f"))
        print("\nGiB = 1024^3 bytes. Ours: backend estimate, rank 0 (DeepSpeed ZeRO on a fake process group), "
              "allocated after the last optimizer step. DeepSpeed formula: deepspeed.runtime.zero "
              "estimate_zero{2,3}_model_states_mem_needs, cpu_offload=False.")
    if offloaded.any():
        print(compare_offload(raw[offloaded]).to_markdown(index=False, floatfmt=".3f"))
        print("\nGiB = 1024^3 bytes. Ours: backend estimate, rank 0, host buffers told apart "
              "(vlmprobe.distributed.host_memory); a node holds min(N, 8) ranks. DeepSpeed: "
              "estimate_zero{2,3}_model_states_mem_needs with cpu_offload=True (stage 3: cpu_offload_params=True, "
              "zero_init=True), CPU bytes divided by its additional_buffer_factor 1.5.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
