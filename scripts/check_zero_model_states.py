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

With --offload (stage 2: the optimizer on the CPU; stage 3: the optimizer and the parameters), the device and
the host are compared apart: ours are rank 0's after_step_bytes (device) and after_step_host_bytes (host,
told apart by vlmprobe.distributed.host_memory), against estimate_zero{2,3}_model_states_mem_needs with
cpu_offload=True (stage 3: cpu_offload_params=True, zero_init=True), whose CPU figure is per node and carries
a margin (additional_buffer_factor 1.5, taken out here). Beside them, a hand count of the buffers DeepSpeed
0.19.8 keeps between steps (HAND_DEVICE, HAND_HOST below; pinned host blocks rounded up to a power of two as
torch's CachingHostAllocator does), and what of ours it leaves (`ours - hand`):
  device, zero2: 2P (the bf16 weights, whole) + the largest parameter in bf16 (temp_grad_buffer_for_gpu_offload):
         the formula's 2P without that buffer. zero3: the reduce bucket (2R bytes) + the persistent parameters
         (below stage3_param_persistence_threshold, kept gathered): the formula's 4L (the largest layer's bf16
         weights and gradients, gathered in forward/backward) is a transient, in `device peak`. Both stages
         also hold what the formulas leave out: the batch and the model's buffers (rotary inv_freq), the loss
         and DeepSpeed's _global_grad_norm (a 0-dim fp32 tensor step() keeps), and, for a buffer that opens
         a segment of its own (the flat weights, the reduce bucket), the rest of its 2 MiB-rounded segment
         when that is not over 1 MiB, which CUDA's allocator hands out with the block (`own_segment`).
  host, zero2: pinned fp32 master partition, its bf16 copy buffer, the largest parameter's gradient buffer, the
         fp32 gradient partition; AdamW's moments (8p): equal to ours to the byte. The formula: 16P per node
         (fp32 master, fp32 gradients, moments: 16 B per parameter over the node's ranks), or 4P per GPU when
         that is more: a whole fp32 model loaded by every rank of the node, which the estimate does not build
         on the host. Ours is above the 16 B by the bf16 buffers and the power-of-two rounding of pinned blocks.
  host, zero3 (stage3.py unless named): the pinned bf16 flat partition (_create_param_groups_fp16_flat_cpu_
         memory, 2p); the pinned gradient partitions' flat buffer (grad_partitions_flat_buffer, 2p: it is made
         in gradient_accumulation_dtype, which is the model's dtype unless the config sets
         data_types.grad_accum_dtype, engine.py:get_data_types); a pinned fp32 gradient buffer per sub group
         (initialize_optimizer_states, 4 B per element of each sub group: sub_group_size cuts the partition
         into pieces of at least 1e9 elements, _create_fp16_sub_groups); the fp32 master partition (not pinned,
         4p); AdamW's moments (8p); the 1-byte inf/nan flag (inf_or_nan_tracker): equal to ours to the byte.
         (Each parameter's own pinned bf16 partition, made by partition_parameters.py:_partition_param, is
         freed when _move_to_flat_buffer points it into the flat partition: in the peak, not between steps.)
         The formula: 18P per node (2 B bf16 weights + 16 B), 2P/N per rank less than ours, plus the pinned
         rounding.

    python scripts/check_zero_model_states.py [--models nanovlm_222m,qwen2_vl_2b] [--worlds 1,2,4,8,16]
                                               [--stages 2,3] [--offload]
Needs DeepSpeed (pip install -e ".[deepspeed]"). Figures in GiB = 1024^3 bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time

import pandas as pd
import torch

from vlmprobe.config.plan import plan_overrides
from vlmprobe.models.base import DataShape, count_params
from vlmprobe.point.build import build_spec
from vlmprobe.run.ranks import simulate_elsewhere
from vlmprobe.sizes import GiB, MiB

SETUP = ["train.param_dtype=bfloat16", "train.autocast_dtype=null", "data.batch_size=1"]
SHORT = {"nanovlm_222m": ["data.lm_max_length=128"],  # 49 image tokens at its 224 px
         "qwen2_vl_2b": ["data.image_size=224", "data.lm_max_length=128"],  # 64 image tokens
         "qwen2_vl_7b": ["data.image_size=224", "data.lm_max_length=128"]}


def planned_config(overrides: list[str]) -> dict:
    (point,) = plan_overrides(overrides)
    return point.config


def sizes(config: dict) -> tuple[int, int, list[int], int]:
    """(P, L) as deepspeed.runtime.zero.stage3.model_to_params counts them, on the meta device, every
    parameter's size, and the device blocks of what is neither parameter nor DeepSpeed's: the point's batch
    (input ids, labels, pixel values, ...: the step's input, alive between steps) and the model's buffers
    (rotary inv_freq: ZeRO partitions parameters only)."""
    spec = build_spec(config["model"])
    model = spec.build(torch.device("meta"), torch.bfloat16, init=False)
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    batch = spec.batch(DataShape.from_config(config["data"]), torch.device("meta"))
    inputs = [t for t in batch.values() if isinstance(t, torch.Tensor)] + list(model.buffers())
    return count_params(model)[0], largest, [p.numel() for p in model.parameters()], sum(block(t.nbytes) for t in inputs)


def partition(stage: int, numels: list[int], world: int) -> int:
    """Elements of rank 0's partition: stage 3 cuts every parameter into N equal padded pieces; stages 1-2 cut
    the flat buffer, padded to a multiple of 2N (stage_1_and_2.py: nccl_start_alignment_factor 2 x N)."""
    if stage == 3:
        return sum(math.ceil(n / world) for n in numels)
    return 2 * math.ceil(sum(numels) / (2 * world))


SUB_GROUP_SIZE = 10**9  # zero_optimization.sub_group_size (elements): DeepSpeed's default, the points leave it


def sub_groups(parts: list[int]) -> list[int]:
    """Elements of each of stage 3's sub groups of a rank's partition (`parts`: each parameter's piece, in
    order), cut as stage3.py:_create_fp16_sub_groups cuts them: a sub group closes once it holds at least
    sub_group_size elements."""
    groups, size = [], 0
    for i, n in enumerate(parts):
        size += n
        if size >= SUB_GROUP_SIZE or i == len(parts) - 1:
            groups.append(size)
            size = 0
    return groups


def pinned(nbytes: int) -> int:
    """A pinned host block: torch's CachingHostAllocator rounds it up to a power of two."""
    return 1 << (nbytes - 1).bit_length()


def block(nbytes: int) -> int:
    return -(-nbytes // 512) * 512


def own_segment(nbytes: int) -> int:
    """The block of a buffer that opens a segment of its own (made at initialize, when nothing cached fits):
    CUDA's caching allocator rounds a request of 10 MiB or more up to 2 MiB for its segment, and hands out
    the whole segment when what is left is not over 1 MiB (the large pool splits only larger remainders). Written
    out here rather than taken from vlmprobe.estimate.allocator, so that the hand count stays independent of
    the model it checks."""
    size = block(nbytes)
    if size < 10 * MiB:  # a 2 or 20 MiB segment: always split
        return size
    segment = -(-size // (2 * MiB)) * 2 * MiB
    return segment if segment - size <= MiB else size


SCALARS = 2 * block(4)  # the loss (alive until the next forward) and _global_grad_norm (kept by step(), fp32)


# Hand counts of what a rank keeps between steps under offload (bf16 weights, fp32 master), each buffer named
# after the DeepSpeed 0.19.8 code that makes it; p: rank 0's partition (elements), Lp: the largest parameter,
# R: reduce_bucket_size, S: the parameters stage 3 keeps gathered (below stage3_param_persistence_threshold),
# subgroups: stage 3's sub groups of rank 0's partition (elements each)
# (both: + the batch and the model's buffers, B, and the two scalars)
HAND_DEVICE = {
    # bf16 flat weights (whole); temp_grad_buffer_for_gpu_offload
    2: lambda r: own_segment(2 * r.N * r.p) + own_segment(2 * r.Lp) + r.B + SCALARS,
    # the ipg reduce bucket (bf16); the persistent parameters, gathered
    3: lambda r: own_segment(2 * r.R) + r.S + r.B + SCALARS}
HAND_HOST = {
    # pinned: the fp32 master partition, its bf16 copy buffer (param_buffer_of_bit16_for_cpu_offload_groups),
    # temp_grad_buffer_for_cpu_offload (the largest parameter, bf16), the fp32 gradient partition; AdamW's moments
    2: lambda r: pinned(4 * r.p) + pinned(2 * r.p) + pinned(2 * r.Lp) + pinned(4 * r.p) + 8 * r.p,
    # pinned: the bf16 partitions' flat buffer (_create_param_groups_fp16_flat_cpu_memory), the gradient
    # partitions' flat buffer (grad_partitions_flat_buffer, bf16: the model's dtype), an fp32 gradient buffer per
    # sub group; the fp32 master partition (not pinned); AdamW's moments; the inf/nan flag (1 bool)
    3: lambda r: (pinned(2 * r.p) + pinned(2 * r.p) + sum(pinned(4 * int(n)) for n in str(r.subgroups).split())
                  + 4 * r.p + 8 * r.p + 1)}


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


RAW = ["model", "stage", "N", "offload", "P", "L", "R", "p", "Lp", "S", "B", "subgroups", "after_load_bytes", "after_step_bytes", "params_bytes",
       "grads_bytes", "optimizer_state_bytes", "peak_allocated_bytes", "after_step_host_bytes", "peak_host_bytes",
       "simulation_s"]
OFFLOAD = {2: ["dist.offload_optimizer=cpu"], 3: ["dist.offload_optimizer=cpu", "dist.offload_param=cpu"]}


def simulate(models: list[str], stages: list[int], worlds: list[int], offload: bool = False,
             save: str | None = None) -> pd.DataFrame:
    """Rank 0's figures of each (model, stage, world size): one fresh-process simulation each, written to
    `save` (CSV) as each one ends."""
    raw = []
    for model in models:
        params = largest = numels = inputs = None
        for stage in stages:
            for world in worlds:
                config = planned_config([f"model={model}", *SETUP, *SHORT.get(model, []), f"dist=zero{stage}",
                                         f"dist.world_size={world}", "measure.backend=estimate",
                                         *(OFFLOAD[stage] if offload else [])])
                if params is None:
                    params, largest, numels, inputs = sizes(config)
                started = time.perf_counter()
                row = simulate_elsewhere(config, 0)
                took = round(time.perf_counter() - started, 1)
                print(f"{model} zero{stage} N={world}: {row['status']} ({took:.0f} s)", file=sys.stderr, flush=True)
                if row["status"] != "ok":
                    print(f"  {row.get('error', '')[:300]}", file=sys.stderr)
                    continue
                raw.append({**{k: row[k] for k in RAW if k in row}, "model": model, "stage": stage, "N": world,
                            "offload": offload,
                            "P": params, "L": largest, "R": config["dist"]["reduce_bucket_size"], "simulation_s": took,
                            "p": partition(stage, numels, world), "Lp": max(numels), "B": inputs,
                            "S": sum(block(2 * n) for n in numels
                                     if n < config["dist"].get("stage3_param_persistence_threshold", 0)),
                            "subgroups": " ".join(map(str, sub_groups([math.ceil(n / world) for n in numels])))})
                if save:
                    pd.DataFrame(raw, columns=RAW).to_csv(save, index=False)
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
                     "device: ours - hand, B": int(r.after_step_bytes - HAND_DEVICE[r.stage](r)),
                     "host after step, rank (ours)": r.after_step_host_bytes / GiB,
                     "host: ours - hand, B": int(r.after_step_host_bytes - HAND_HOST[r.stage](r)),
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
                       list(map(int, args.worlds.split(","))), args.offload, args.save)
    offloaded = raw["offload"].astype(bool) if "offload" in raw else pd.Series(False, index=raw.index)
    if (~offloaded).any():
        print(compare(raw[~offloaded]).to_markdown(index=False, floatfmt=".3f"))
        print("\nGiB = 1024^3 bytes. Ours: backend estimate, rank 0 (DeepSpeed ZeRO on a fake process group), "
              "allocated after the last optimizer step. DeepSpeed formula: deepspeed.runtime.zero "
              "estimate_zero{2,3}_model_states_mem_needs, cpu_offload=False.")
    if offloaded.any():
        print(compare_offload(raw[offloaded]).to_markdown(index=False, floatfmt=".3f"))
        print("\nGiB = 1024^3 bytes; `ours - hand` in bytes. Ours: backend estimate, rank 0, host buffers told apart "
              "(vlmprobe.distributed.host_memory); a node holds min(N, 8) ranks. DeepSpeed: "
              "estimate_zero{2,3}_model_states_mem_needs with cpu_offload=True (stage 3: cpu_offload_params=True, "
              "zero_init=True), CPU bytes divided by its additional_buffer_factor 1.5.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
