#!/usr/bin/env python
"""The column reference of docs/results.md, made from the code's own column lists.

Rule: every column results.csv can have (vlmprobe.results.table's INPUT_COLUMNS and OUTPUT_COLUMNS) and every
column of ranks.csv (RANK_COLUMNS) is one row of a table, with the files it is in and a one-line meaning taken
from DESCRIPTIONS below; `python scripts/columns_doc.py` writes that table between the two marker comments of
docs/results.md (MARKERS), leaving the rest of the page as it is. Reason: the columns are defined in code and
described in prose; a column added to the code without a line here makes this script stop (one line naming it,
exit 2) and tests/test_docs.py fail, so the reference cannot fall behind. Limits: the one column per other swept
key (`axis_column`) depends on the sweep and is described once in the page's prose, not listed; a description
is kept here by hand, and only its presence is checked, not its truth.

    python scripts/columns_doc.py            # rewrite the section of docs/results.md
    python scripts/columns_doc.py --check    # exit 1 where the section is not what this script writes
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vlmprobe.results.table import INPUT_COLUMNS, OUTPUT_COLUMNS, RANK_COLUMNS

__all__ = ["columns", "DESCRIPTIONS", "main", "MARKERS", "render", "RESULTS_PAGE", "section", "with_section"]

RESULTS_PAGE = Path(__file__).resolve().parent.parent / "docs" / "results.md"
MARKERS = ("<!-- columns:begin (made by scripts/columns_doc.py: edit the descriptions there) -->",
           "<!-- columns:end -->")

# One line per column: what it holds. Byte columns are integers in bytes; an empty cell is a value the backend
# cannot know, never zero.
DESCRIPTIONS = {
    # inputs: what the point is
    "sweep": "the sweep's name (`sweep.name`; `single` without `+sweep=`)",
    "point_id": "the point's overrides, stable across runs (resume matches rows on it)",
    "case": "the overrides of the point's sweep case (`baseline` for an empty case; empty without cases)",
    "model": "the model config's name (`model=`; `model.name` or the folder's name with `model=hf`)",
    "model_source": "the nanoVLM checkout whose own modules ran (`model.source`); empty for vlmprobe's modules",
    "params": "parameters of the built model, adapters included",
    "trainable_params": "parameters that get gradients (after freezing, LoRA and quantization)",
    "dtype": "the weights' dtype (`train.param_dtype`)",
    "autocast_dtype": "the autocast dtype of the forward (`train.autocast_dtype`; empty: no autocast)",
    "optimizer": "the optimizer with its implementation, e.g. `AdamW(foreach)`",
    "batch_size": "samples per micro batch (`data.batch_size`; with `step=grpo` completions, `step=dpo` pairs)",
    "grad_accum_steps": "micro batches per optimizer step (`train.grad_accum_steps`)",
    "effective_batch_size": "`batch_size` x `grad_accum_steps`",
    "lm_max_length": "tokens of the whole LM sequence, image tokens included (with `step=grpo` / `dpo`: the prompt)",
    "image_size": "px per image side; empty for a sample of videos only",
    "images_per_sample": "images in each sample (`data.images_per_sample`)",
    "max_pixels": "Qwen's cap on an image's H x W (`data.max_pixels`)",
    "image_tokens": "LM tokens the images of one sample take",
    "data_source": "`data.source`: the dataset whose batches ran, step by step (steps.csv); `image_size`, "
                   "`images_per_sample` and `image_tokens` are then empty, `steps` is `data.steps`",
    "videos_per_sample": "videos in each sample (`data.videos_per_sample`); empty without videos",
    "video_frames": "frames each video hands the processor (`data.video_frames`); empty without videos",
    "video_size": "px per frame side after the processor's resize; empty without videos",
    "video_max_pixels": "the per-frame pixel cap (`data.video_max_pixels`); empty without videos",
    "video_tokens": "LM tokens the videos of one sample take; empty without videos",
    "grad_ckpt_lm": "activation checkpointing of the LM (`train.grad_ckpt.lm`)",
    "grad_ckpt_vision": "activation checkpointing of the vision tower (`train.grad_ckpt.vision`: true, false, unsloth)",
    "freeze_vision": "the vision tower frozen: no gradients or optimizer state (`train.freeze_vision`)",
    "freeze_lm": "the LM frozen (`train.freeze_lm`)",
    "lora_r": "the LoRA rank (`train.lora_r`; 0: no LoRA)",
    "quantization": "QLoRA's quantized base (`train.quantization`: nf4, int8; empty: none)",
    "dist": "the data-parallel engine (`dist=`: none, ddp, fsdp2, zero1-3)",
    "world_size": "GPUs (ranks) of the point (`dist.world_size`)",
    "device": "the target card's profile (`device=`); empty without one",
    "step": "what one optimizer step does (`step=`: sft, grpo, dpo)",
    "num_generations": "`step=grpo`: completions per prompt (`step.num_generations`)",
    "max_completion_length": "`step=grpo`: tokens each completion is forced to (`step.max_completion_length`)",
    "beta": "`step=grpo`: the KL coefficient (`step.beta`; 0: no reference scoring)",
    "use_vllm": "`step=grpo`: vLLM generates elsewhere, so the generate phase is absent (`step.use_vllm`)",
    "completion_length": "`step=dpo`: tokens of the chosen and of the rejected completion (`step.completion_length`)",
    "reference": "`step=grpo` / `dpo`: whether a frozen reference scores the rows",
    "logits_path": "`step=grpo` / `dpo`: how the log-probabilities are made (`step.logits`)",
    "attn_implementation": "the attention kernels asked for (`model.attn_implementation`: sdpa, eager, flash_attention_2)",
    "alloc_conf": "the allocator settings of the point (`measure.alloc_conf`, `PYTORCH_ALLOC_CONF` syntax)",
    "hold_outputs": "the logits kept alive through backward and the step (`measure.hold_outputs`)",
    "steps": "training steps measured (`measure.steps`)",
    # outputs: what was measured or estimated
    "backend": "how the figures were made: `cuda` (measured), `estimate` or `cpu`",
    "status": "`ok`, `oom`, `error`, `timeout`, `crash` or `skipped`",
    "peak_allocated_bytes": "max allocated over all steps (`max_memory_allocated`, what measure_vram.py reports)",
    "last_step_peak_allocated_bytes": "peak allocated of the last, steady-state step (optimizer state already there)",
    "max_rank": "several ranks: the rank with the peak",
    "min_rank_peak_allocated_bytes": "several ranks: the lowest rank's peak allocated",
    "rank_imbalance": "several ranks: max / min of the ranks' peaks allocated",
    "peak_reserved_bytes": "max reserved by the caching allocator (on estimate / cpu: its model's)",
    "last_step_peak_reserved_bytes": "peak reserved of the last step",
    "peak_active_bytes": "peak active bytes (`active_bytes.all.peak`; one stream on estimate / cpu, so = allocated)",
    "num_alloc_retries": "times the allocator freed its cached blocks and retried an allocation",
    "num_ooms": "out-of-memory errors the allocator raised",
    "nvml_used_bytes": "cuda: the whole device's used memory by NVML, read once after the steps",
    "nvml_process_bytes": "cuda: this worker's memory by NVML, read once after the steps",
    "predicted_device_bytes": "estimate / cpu: what the card would show in use at the peak (peak reserved + CUDA context)",
    "after_load_bytes": "allocated after load: model, batch and optimizer object",
    "build_peak_bytes": "peak allocated while the model was built and its weights filled",
    "load_peak_bytes": "peak allocated through build and engine preparation (the whole load, the batch included)",
    "after_step_bytes": "allocated after the last optimizer step: what a training loop carries between steps",
    "peak_host_bytes": "offload to the CPU: one rank's peak host memory (empty where host memory is not told apart)",
    "after_step_host_bytes": "offload to the CPU: one rank's host memory after the last step",
    "generate_peak_bytes": "`step=grpo`: peak of the rollout (empty where the phase is absent)",
    "reference_peak_bytes": "`step=grpo` / `dpo`: peak of the reference's scoring (empty where absent)",
    "forward_peak_bytes": "peak of the forward, max over steps",
    "backward_peak_bytes": "peak of the backward, max over steps",
    "optimizer_peak_bytes": "peak of the optimizer step, max over steps",
    "peak_phase": "the phase of the peak (on an `oom` row: the phase it ran out in)",
    "params_bytes": "the parameters' bytes",
    "grads_bytes": "the gradients' bytes before the optimizer step; on an oom row, as they stood when it ran out",
    "optimizer_state_bytes": "the optimizer state's bytes; on an oom row, as it stood when it ran out",
    "optimizer_state_dtype": "the dtypes of the optimizer state tensors, e.g. `float32`",
    "activations_bytes": "what the last forward left live for backward",
    "oom_block_bytes": "`oom` rows: the block the allocator was asked for (the tensor's bytes rounded up to 512)",
    "oom_segment_bytes": "`oom` rows: the segment it tried to reserve for it (the size CUDA's message prints)",
    "oom_filled": "`oom` rows, estimate / cpu: the five largest groups of live memory when it ran out, by module, kind "
                  "and dtype, e.g. `bf16 activations of model.language_model.layers.*.mlp.act_fn 3.42 GiB; ...` "
                  "(empty on cuda)",
    "dataset_steps": "`data.source` points: where the dataset's steps first ran out (`runs out at step 3: a batch with "
                     "...`), else the worst step and its batch (steps.csv has every step)",
    "imposed_capacity_bytes": "the device capacity the point ran against, where one was imposed",
    "allocator_backend": "cuda: `native` or `cudaMallocAsync`, as the worker's allocator ran",
    "step_time_s": "wall time of the last step (estimate: fake-tensor time, not a GPU time)",
    "snapshot_file": "cuda with `measure.snapshot=true`: the point's allocator snapshot",
    "notes": "what to know about how the point was measured",
    "error": "why a row is not `ok`: the message (an `oom` row's: CUDA's out-of-memory message) or traceback tail",
    # ranks.csv only
    "rank": "the rank the row is of",
    "simulated_as": "the rank whose simulation stands for this one (estimate; cpu and cuda with `dist.ranks=simulate`, "
                    "on one device on a fake process group); empty: run itself in a launched job",
}


def columns() -> list[tuple[str, str]]:
    """Every column once, in the code's order, with the files it is in."""
    rank_columns = set(RANK_COLUMNS)
    rows = [(name, "results.csv, ranks.csv" if name in rank_columns else "results.csv")
            for name in INPUT_COLUMNS + OUTPUT_COLUMNS]
    seen = {name for name, _ in rows}
    rows += [(name, "ranks.csv") for name in RANK_COLUMNS if name not in seen]
    return rows


def render() -> str:
    """The table, between and with its markers. A column without a description stops it (KeyError naming it)."""
    missing = [name for name, _ in columns() if name not in DESCRIPTIONS]
    if missing:
        raise KeyError(f"column {missing[0]!r} has no description: add it to DESCRIPTIONS in scripts/columns_doc.py")
    lines = [MARKERS[0], "", "| column | in | meaning |", "|---|---|---|"]
    lines += [f"| `{name}` | {where} | {DESCRIPTIONS[name]} |" for name, where in columns()]
    return "\n".join([*lines, "", MARKERS[1]])


def section(page: str) -> str:
    """The part of `page` from its first marker to the end of its second."""
    start, end = page.find(MARKERS[0]), page.find(MARKERS[1])
    if start < 0 or end < start:
        raise ValueError(f"{RESULTS_PAGE.name} lacks the two marker comments {MARKERS[0]!r} ... {MARKERS[1]!r}")
    return page[start:end + len(MARKERS[1])]


def with_section(page: str, table: str) -> str:
    return page.replace(section(page), table, 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 where the section is out of date")
    args = parser.parse_args(argv)
    try:
        page = RESULTS_PAGE.read_text(encoding="utf-8")
        table = render()
        updated = with_section(page, table)
    except (KeyError, ValueError, OSError) as exc:
        print(f"columns_doc: {exc.args[0] if exc.args else exc}", file=sys.stderr)
        return 2
    if args.check:
        if updated != page:
            print(f"columns_doc: {RESULTS_PAGE} is out of date: run python scripts/columns_doc.py", file=sys.stderr)
            return 1
        return 0
    if updated != page:
        RESULTS_PAGE.write_text(updated, encoding="utf-8")
    print(f"columns_doc: {len(columns())} columns in {RESULTS_PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
