#!/usr/bin/env python
"""ZeRO model states per GPU: the estimate (the real DeepSpeed engine on a fake process group, rank 0) against
DeepSpeed's own formulas, estimate_zero2_model_states_mem_needs and estimate_zero3_model_states_mem_needs
(deepspeed/runtime/zero/stage_1_and_2.py and stage3.py, no offload), for each model and world size.

Full fine-tune, bf16 weights as DeepSpeed's bf16 mode runs them (train.param_dtype=bfloat16, no autocast),
AdamW, batch 1 at a short length: the model states do not depend on the batch. Ours, from rank 0's row:
  after_load = the bf16 weights (stage 2: whole; stage 3: this rank's partition and the persistent small
               params) + the fp32 master partition + whatever deepspeed.initialize allocates on the device,
  grads      = the gradient partition buffers the engine keeps (grads_bytes),
  optimizer  = the AdamW moments of the fp32 partition (optimizer_state_bytes),
  states     = their sum; peak = the step's peak (activations and transients included).
DeepSpeed's formulas, with P the parameters (tied ones once) and L the largest module's own parameters:
  zero2: 2P + 18P/N   (2 = bf16 params; 18 = bf16 grads 2 + fp32 grads 4 + fp32 params 4 + Adam 8)
  zero3: 4L + 18P/N   (4L = the largest layer gathered, bf16 params + grads)
The difference is explained by two terms, and `unexplained` is what is left after them:
  zero2: formula - ours = 4P/N. DeepSpeed's bf16 mode keeps the gradient partition in bf16 (in `grads`) and
         makes its fp32 copy for the update inside step(), freeing it after: a transient of the optimizer phase
         (in `peak`), not a state held between steps.
  zero3: formula - ours = 4L - 2R, R = zero_optimization.reduce_bucket_size. Ours holds 18P/N too, but made of
         other buffers: initialize() leaves two bf16 copies of the partition (2 x 2P/N), the fp32 master (4P/N),
         the bf16 gradient partition (2P/N) and AdamW's moments (8P/N); it also allocates the reduce bucket of R
         bf16 elements (2R bytes, 0.93 GiB at DeepSpeed's default 5e8) at initialize, which the formula leaves
         out. The formula's 4L is the largest layer gathered during forward and backward (in `peak`).

    python scripts/check_zero_model_states.py [--models nanovlm_222m,qwen2_vl_2b] [--worlds 1,2,4,8,16]
                                               [--stages 2,3]
Needs DeepSpeed (pip install -e ".[deepspeed]"). Figures in GiB = 1024^3 bytes.
"""

from __future__ import annotations

import argparse
import sys
import time

import pandas as pd
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from vlmprobe.overrides import CONF
from vlmprobe.distributed.ranks import simulate_elsewhere
from vlmprobe.models.base import count_params
from vlmprobe.plan import plan
from vlmprobe.results import GiB
from vlmprobe.worker import build_spec

SETUP = ["train.param_dtype=bfloat16", "train.autocast_dtype=null", "data.batch_size=1"]
SHORT = {"nanovlm_222m": ["data.lm_max_length=128"],  # 49 image tokens at its 224 px
         "qwen2_vl_2b": ["data.image_size=224", "data.lm_max_length=128"],  # 64 image tokens
         "qwen2_vl_7b": ["data.image_size=224", "data.lm_max_length=128"]}


def planned_config(overrides: list[str]) -> dict:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        config = lambda extra: compose(config_name="config", overrides=list(extra))  # noqa: E731
        (point,) = plan(config, overrides, OmegaConf.to_container(config(overrides), resolve=True))
    return point.config


def sizes(config: dict) -> tuple[int, int]:
    """(P, L) as deepspeed.runtime.zero.stage3.model_to_params counts them, on the meta device."""
    model = build_spec(config["model"]).build(torch.device("meta"), torch.bfloat16, init=False)
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    return count_params(model)[0], largest


def deepspeed_formula(stage: int, params: int, largest: int, world: int) -> int:
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    if stage == 2:
        return estimate_zero2_model_states_mem_needs(params, world, cpu_offload=False)[1]
    return estimate_zero3_model_states_mem_needs(params, largest, world, cpu_offload=False)[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="nanovlm_222m,qwen2_vl_2b")
    parser.add_argument("--worlds", default="1,2,4,8,16")
    parser.add_argument("--stages", default="2,3")
    args = parser.parse_args()
    rows = []
    for model in args.models.split(","):
        params = largest = None
        for stage in map(int, args.stages.split(",")):
            for world in map(int, args.worlds.split(",")):
                config = planned_config([f"model={model}", *SETUP, *SHORT.get(model, []), f"dist=zero{stage}",
                                         f"dist.world_size={world}", "measure.backend=estimate"])
                if params is None:
                    params, largest = sizes(config)
                started = time.perf_counter()
                row = simulate_elsewhere(config, 0)
                took = time.perf_counter() - started
                if row["status"] != "ok":
                    print(f"{model} zero{stage} N={world}: {row['status']}: {row.get('error', '')[:300]}", file=sys.stderr)
                    continue
                ours = row["after_load_bytes"] + row["grads_bytes"] + row["optimizer_state_bytes"]
                theirs = deepspeed_formula(stage, params, largest, world)
                explained = 4 * params / world if stage == 2 else 4 * largest - 2 * config["dist"]["reduce_bucket_size"]
                rows.append({"model": model, "stage": stage, "N": world, "P": params, "L": largest,
                             "after_load": row["after_load_bytes"] / GiB, "grads": row["grads_bytes"] / GiB,
                             "optimizer": row["optimizer_state_bytes"] / GiB, "states (ours)": ours / GiB,
                             "DeepSpeed formula": theirs / GiB, "formula - ours": (theirs - ours) / GiB,
                             "explained": explained / GiB, "unexplained": (theirs - ours - explained) / GiB,
                             "peak (ours)": row["peak_allocated_bytes"] / GiB, "simulation s": round(took, 1)})
                print(f"{model} zero{stage} N={world}: ours {ours / GiB:.3f} GiB, DeepSpeed {theirs / GiB:.3f} GiB "
                      f"({took:.0f} s)", file=sys.stderr, flush=True)
    table = pd.DataFrame(rows)
    print(table.to_markdown(index=False, floatfmt=".3f"))
    print("\nGiB = 1024^3 bytes. Ours: backend estimate, rank 0 (DeepSpeed ZeRO on a fake process group). DeepSpeed "
          "formula: deepspeed.runtime.zero estimate_zero{2,3}_model_states_mem_needs, cpu_offload=False.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
