#!/usr/bin/env bash
# Everything CUDA-related in this repository, checked on one GPU, into one directory to commit:
#   results/gpu_check/<device>/<UTC stamp>/   (VLMPROBE_GPU_CHECK_DIR overrides it)
# Steps (a failed step does not stop the later ones; the exit status is non-zero if any failed):
#   1. cuda_tests       python -m pytest -m cuda (tests/test_cuda.py)
#   1a. fork            the seq_len sweep on cuda twice: workers forked from the sweep (PYTORCH_NVML_BASED_CUDA_CHECK=1:
#                       the sweep's GPU check starts no driver, vlmprobe/run/workers.py fork_refusal) and spawned;
#                       the status table's seconds per part / 8 points is the cost of a point each way (issue 52:
#                       3 s a point or less), and the two results dirs' byte columns must be equal
#   2. nightly          scripts/nightly.sh on cuda: the seq_len and Qwen2-VL-2B image-size sweeps, the
#                       nanoVLM finding check, the regression gate where a baseline exists
#   3. estimate_vs_cuda scripts/check_estimate.py --cuda-dir on both sweeps: estimate vs measurement per point
#   4. finding          python -m vlmprobe.results.finding on the measured seq_len sweep (also in 2; here with its table)
#   5. recording_cost   one seq_len point with measure.record_history=off|alloc|all: what history costs in
#                       step_time_s (device figures must not change)
#   6. allocator        the whole seq_len sweep under three allocator settings (default, expandable_segments:True,
#                       max_split_size_mb:128; 24 points, about 5 minutes on an H200) with snapshots, then
#                       scripts/check_allocator.py replaying each through the allocator model (check_allocator.log)
#                       and counting what each run asked the allocator for (allocator_requests.csv, which
#                       tests/test_estimate_vs_cuda.py holds the estimate's allocations to), and
#                       scripts/check_estimate.py --cuda-dir on the sweep (allocator_vs_estimate); then batch 1
#                       and 8 at 512 with flash attention first (TORCH_CUDNN_SDPA_DEPRIORITIZED=1, the card's profile
#                       with device.sdpa.default=flash), their requests (allocator_flash_requests.csv) and estimate
#                       (allocator_flash_vs_estimate): flash's backward scratch as attention_scratch.py reads it from
#                       torch's source, against the card (cuDNN's workspaces in that trace: the variable was ignored);
#                       tests/test_estimate_vs_cuda.py holds the estimate to every <part>_requests.csv committed
#   7. grpo             the VLM-R1 preset's batch-1 GRPO point (Qwen2.5-VL-3B, 4 x 2048 completion tokens) on
#                       cuda, SDPA attention (flash-attn is not in the GPU image) and no card profile (this card's
#                       memory is the capacity), then scripts/check_estimate.py --cuda-dir on it (grpo_vs_estimate)
#   8. dpo              step=dpo on Qwen2-VL-2B, TRL's and LLaMA-Factory's logits paths, full fine-tune and LoRA
#                       (one 448 px image in a 512-token prompt, 256-token completions, 2 pairs), on cuda, then
#                       scripts/check_estimate.py --cuda-dir on it (dpo_vs_estimate)
#   8d. dataset         data.source on cuda (issue 49): Qwen2-VL-2B, bf16, batch 2, 8 steps of a seeded synthetic
#                       dataset (lengths and image sizes vary from step to step), default allocator and
#                       expandable_segments, then scripts/check_estimate.py --cuda-dir on it, point by point and step by
#                       step from steps.csv (dataset_vs_estimate)
#   8a. pixtral_mask    Mistral 3's tower (mistral3_tiny, bf16, one 70 px image: 36 patches, a mask with unaligned
#                       rows, and two: 72, aligned) on cuda, then scripts/check_estimate.py --cuda-dir on it
#                       (pixtral_mask_vs_estimate): whether the memory-efficient kernel's padded mask copies, or
#                       cuDNN taking the mask as it is on sm90, are what the card does
#   8b. moe             the experts of Qwen3-VL-MoE and GLM-4.5V (qwen3_vl_moe_tiny, glm4v_moe_tiny: GLM's fp32 router
#                       and shared expert beside them) on cuda: fp32 weights under bf16 autocast (grouped_mm in fp32:
#                       CUDA's fallback kernel) and bf16 weights (the CUTLASS kernel on sm90), grouped_mm and
#                       batched_mm, then scripts/check_estimate.py --cuda-dir on each (moe_<model>_vs_estimate)
#   8c. dist            every engine at world size 1 (+sweep=dist_world1: ddp, fsdp2 with and without CPU offload,
#                       zero2, zero3 with and without offload; DeepSpeed's rows are skipped where it is not
#                       installed) on cuda, then scripts/check_estimate.py --cuda-dir on it (dist_vs_estimate)
#   9. nanovlm_code     nanoVLM's own model code (a checkout at VLMPROBE_NANOVLM_DIR, or .nanovlm/ in the repository
#                       when it exists: one carried to the machine) beside vlmprobe's implementation on the seq_len
#                       points, both measured on cuda (scripts/check_nanovlm_code.py --backend cuda); skipped without
#  10. baseline         the first baseline of this device (results/baseline/<device>/<sweep>/) when none exists
# Needs nothing but the installed project (pip install -e ".[test]") and a CUDA GPU; about 15 minutes on an H100.
# In parts, where a command may run only so long (10 minutes through the device tool):
#   VLMPROBE_GPU_CHECK_ONLY="cuda_tests nightly"   the named steps of 1, 1a, 2, 5, 6, 7, 8, 8a-8d, 9 only, each with the steps
#                                                  that read its output (3-4 and 10 with 2, the replay with 6, ...)
# On a machine reached through a tool that returns few files, pack the directory: tar czf out.tgz -C DIR .
set -uo pipefail
cd "$(dirname "$0")/.."

PARTS="cuda_tests fork nightly recording_cost allocator grpo dpo dataset pixtral_mask moe dist nanovlm_code"
# the dataset part's samples: lengths and image sizes drawn with a seed (docs/datasets.md, "Synthetic")
DATASET_SOURCE='synthetic:{"samples": 64, "seed": 0, "text_tokens": {"lognormal": {"mean": 5.5, "sigma": 0.7}}, "images_per_sample": {"choice": [1, 1, 2]}, "image_height": {"uniform": [224, 1024]}, "image_width": {"uniform": [224, 1024]}}'
ONLY=" ${VLMPROBE_GPU_CHECK_ONLY:-$PARTS} "
for part in $ONLY; do
  if [[ " $PARTS " != *" $part "* ]]; then
    echo "gpu_check: VLMPROBE_GPU_CHECK_ONLY names '$part': give some of: $PARTS" >&2
    exit 2
  fi
done
wanted() { [[ "$ONLY" == *" $1 "* ]]; }

python scripts/cuda_usable.py || exit 1
DEVICE=$(python -c 'import torch; from vlmprobe.results.compare import device_slug; print(device_slug(torch.cuda.get_device_name(0)))')
OUT=${VLMPROBE_GPU_CHECK_DIR:-results/gpu_check/$DEVICE/$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
# the device, driver, versions and commit of every figure below, written the way each results dir's env.json is
python -c 'import sys; from vlmprobe import backends; from vlmprobe.results import provenance; from pathlib import Path
provenance.write_env(Path(sys.argv[1]), provenance.environment(backends.get("cuda").describe(), {"measure": {}}))' "$OUT/env.json"
STATUS=()

# step NAME COMMAND...: run it with its output in OUT/NAME.log, and remember how it ended
step() {
  local name=$1 started rc
  shift
  echo "gpu_check: $name ..." >&2
  started=$(date +%s)
  "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  STATUS+=("| $name | $([ $rc -eq 0 ] && echo ok || echo "FAILED (exit $rc)") | $(( $(date +%s) - started )) s | [$name.log]($name.log) |")
  echo "gpu_check: $name: exit $rc" >&2
  return $rc
}

newest() { LC_ALL=C ls -d "$1"/*/ 2>/dev/null | tail -n 1 | sed 's:/$::'; }

wanted cuda_tests && step cuda_tests python -m pytest -q -m cuda -p no:cacheprovider
if wanted fork; then  # seconds a point: the step log's own time, forked workers (NVML's device check) vs spawned
  step fork_forked env PYTORCH_NVML_BASED_CUDA_CHECK=1 python -m vlmprobe +sweep=seq_len measure.backend=cuda \
    "results_dir=$OUT/fork/forked"
  step fork_spawned python -m vlmprobe +sweep=seq_len measure.backend=cuda "results_dir=$OUT/fork/spawned"
fi
SEQ_LEN= IMAGE_SIZE=
if wanted nightly; then
  step nightly env VLMPROBE_BACKEND=cuda VLMPROBE_RESULTS="$OUT/nightly" scripts/nightly.sh
  SEQ_LEN=$(newest "$OUT/nightly/seq_len")
  IMAGE_SIZE=$(newest "$OUT/nightly/qwen2_vl_image_size")
  CUDA_DIRS=()
  for dir in "$SEQ_LEN" "$IMAGE_SIZE"; do
    [ -n "$dir" ] && CUDA_DIRS+=(--cuda-dir "$dir")
  done
  # without a dir check_estimate.py would run both sweeps again on this GPU
  [ ${#CUDA_DIRS[@]} -gt 0 ] && step estimate_vs_cuda python scripts/check_estimate.py --parts cuda "${CUDA_DIRS[@]}"
  [ -n "$SEQ_LEN" ] && step finding python -m vlmprobe.results.finding "$SEQ_LEN"
fi
wanted recording_cost && step recording_cost python -m vlmprobe +sweep=seq_len measure.backend=cuda \
  "results_dir=$OUT/recording_cost" "sweep.axes.data.batch_size=[8]" "sweep.axes.data.lm_max_length=[512]" \
  "+sweep.axes.measure.record_history=[off,alloc,all]"
if wanted allocator; then
  step allocator python -m vlmprobe +sweep=seq_len measure.backend=cuda measure.snapshot=true \
    "results_dir=$OUT/allocator" '+sweep.axes.measure.alloc_conf=[null,"expandable_segments:True","max_split_size_mb:128"]'
  ALLOCATOR=$(newest "$OUT/allocator/seq_len")
  if [ -n "$ALLOCATOR" ]; then
    step check_allocator python scripts/check_allocator.py "$ALLOCATOR" --requests-csv "$OUT/allocator_requests.csv"
    step allocator_vs_estimate python scripts/check_estimate.py --parts cuda --cuda-dir "$ALLOCATOR"
  fi
  CARD=$(python -c 'import torch; from vlmprobe.gpu.device_profile import key_of_card
print(key_of_card(torch.cuda.get_device_name(0)) or "")')
  if [ -n "$CARD" ]; then
    step allocator_flash env TORCH_CUDNN_SDPA_DEPRIORITIZED=1 python -m vlmprobe +sweep=seq_len measure.backend=cuda \
      measure.snapshot=true "results_dir=$OUT/allocator_flash" "device=$CARD" device.sdpa.default=flash \
      "sweep.axes.data.batch_size=[1,8]" "sweep.axes.data.lm_max_length=[512]"
    FLASH=$(newest "$OUT/allocator_flash/seq_len")
    if [ -n "$FLASH" ]; then
      step check_allocator_flash python scripts/check_allocator.py "$FLASH" \
        --requests-csv "$OUT/allocator_flash_requests.csv"
      step allocator_flash_vs_estimate python scripts/check_estimate.py --parts cuda --cuda-dir "$FLASH"
    fi
  fi
fi
if wanted grpo; then
  step grpo python -m vlmprobe +sweep=preset_vlm_r1_grpo_h20 measure.backend=cuda "results_dir=$OUT/grpo" \
    'sweep.cases=[{}]' 'sweep.axes.data.batch_size=[1]' model.attn_implementation=sdpa device=none
  GRPO=$(newest "$OUT/grpo/preset_vlm_r1_grpo_h20")
  [ -n "$GRPO" ] && step grpo_vs_estimate python scripts/check_estimate.py --parts cuda --cuda-dir "$GRPO"
fi
if wanted dpo; then
  step dpo python -m vlmprobe model=qwen2_vl_2b step=dpo measure.backend=cuda "results_dir=$OUT/dpo" sweep.name=dpo \
    data.batch_size=2 data.lm_max_length=512 data.image_size=448 step.completion_length=256 \
    '+sweep.axes.step.logits=[chunked,full_fp32]' '+sweep.axes.train.lora_r=[0,8]'
  DPO=$(newest "$OUT/dpo/dpo")
  [ -n "$DPO" ] && step dpo_vs_estimate python scripts/check_estimate.py --parts cuda --cuda-dir "$DPO"
fi
if wanted dataset; then
  step dataset python -m vlmprobe model=qwen2_vl_2b measure.backend=cuda "results_dir=$OUT/dataset" sweep.name=dataset \
    "data.source='$DATASET_SOURCE'" data.batch_size=2 data.lm_max_length=2048 data.steps=8 \
    train.param_dtype=bfloat16 train.autocast_dtype=null '+sweep.axes.measure.alloc_conf=[null,"expandable_segments:True"]'
  DATASET=$(newest "$OUT/dataset/dataset")
  [ -n "$DATASET" ] && step dataset_vs_estimate python scripts/check_estimate.py --parts cuda --cuda-dir "$DATASET"
fi
if wanted pixtral_mask; then
  step pixtral_mask python -m vlmprobe model=mistral3_tiny measure.backend=cuda "results_dir=$OUT/pixtral_mask" \
    sweep.name=pixtral_mask data.lm_max_length=48 data.image_size=70 train.param_dtype=bfloat16 \
    train.autocast_dtype=null '+sweep.axes.data.batch_size=[1,2]'
  PIXTRAL=$(newest "$OUT/pixtral_mask/pixtral_mask")
  [ -n "$PIXTRAL" ] && step pixtral_mask_vs_estimate python scripts/check_estimate.py --parts cuda --cuda-dir "$PIXTRAL"
fi

if wanted moe; then
  for model in qwen3_vl_moe_tiny glm4v_moe_tiny; do
    step "moe_$model" python -m vlmprobe model=$model measure.backend=cuda "results_dir=$OUT/moe" \
      sweep.name=$model data.batch_size=2 data.lm_max_length=48 '+sweep.axes.train.param_dtype=[float32,bfloat16]' \
      '+sweep.axes.model.experts_implementation=[grouped_mm,batched_mm]'
    MOE=$(newest "$OUT/moe/$model")
    [ -n "$MOE" ] && step "moe_${model}_vs_estimate" python scripts/check_estimate.py --parts cuda --cuda-dir "$MOE"
  done
fi
if wanted dist; then
  step dist python -m vlmprobe +sweep=dist_world1 measure.backend=cuda "results_dir=$OUT/dist"
  DIST=$(newest "$OUT/dist/dist_world1")
  [ -n "$DIST" ] && step dist_vs_estimate python scripts/check_estimate.py --parts cuda --cuda-dir "$DIST"
fi
if wanted nanovlm_code; then
  NANOVLM=${VLMPROBE_NANOVLM_DIR:-$( [ -d .nanovlm ] && echo .nanovlm )}
  if [ -n "$NANOVLM" ]; then
    step nanovlm_code python scripts/check_nanovlm_code.py --nanovlm-dir "$NANOVLM" --backend cuda
  else
    STATUS+=("| nanovlm_code | skipped: no nanoVLM checkout (VLMPROBE_NANOVLM_DIR, or .nanovlm/) | 0 s | |")
  fi
fi

baseline() {
  local dir target
  for dir in "$SEQ_LEN" "$IMAGE_SIZE"; do
    [ -n "$dir" ] || continue
    target=$(python -c 'import sys; from vlmprobe.results.compare import baseline_path; print(baseline_path(*sys.argv[1:]))' results/baseline "$dir")
    if [ -f "$target/results.csv" ]; then
      echo "baseline exists: $target"
    else
      mkdir -p "$target" && cp -r "$dir/." "$target/" && echo "baseline written: $target (from $dir)"
    fi
  done
}
[ -n "$SEQ_LEN$IMAGE_SIZE" ] && step baseline baseline

{
  echo "# vlmprobe GPU check: $(python scripts/cuda_usable.py 2>&1)"
  echo
  echo "Started from commit $(git rev-parse HEAD 2>/dev/null)$(git diff --quiet HEAD 2>/dev/null || echo ' (dirty)'), $(date -u +%FT%TZ). Every figure here is a CUDA measurement on this device unless a table says estimate."
  echo
  echo "Parts run:$ONLY(of: $PARTS)."
  echo
  echo "| step | result | time | log |"
  echo "|---|---|---|---|"
  printf '%s\n' "${STATUS[@]}"
} >"$OUT/summary.md"
echo "gpu_check: wrote $OUT (summary.md); commit it with the baseline dirs it names" >&2
if printf '%s\n' "${STATUS[@]}" | grep -q FAILED; then
  exit 1
fi
