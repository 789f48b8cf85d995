#!/usr/bin/env bash
# The nightly run, on any GPU box by hand or from .github/workflows/nightly.yml:
#   1. the seq_len sweep (nanoVLM-222M, issue #103) and the Qwen2-VL-2B image-size sweep;
#   2. the finding check on the seq_len results (python -m vlmprobe.results.finding);
#   3. the regression gate of each sweep against its baseline, when one exists (python -m vlmprobe.results.compare).
# A failed step does not stop the later ones (one night shows everything that broke); the exit status is
# non-zero if any step failed.
#
# Environment:
#   VLMPROBE_BACKEND          measure.backend of both sweeps (default cuda; `estimate` runs without a GPU)
#   VLMPROBE_RESULTS          results root (default results/nightly): a sweep lands in ROOT/<sweep>/<timestamp>/
#   VLMPROBE_BASELINES        baseline root (default results/baseline): ROOT/<device>/<sweep>/ is a results dir,
#                             <device> = env.json's device_name slugified (vlmprobe.results.compare.device_slug)
#   VLMPROBE_TOLERANCE        largest allowed growth of a peak (default 0.02)
#   VLMPROBE_LAUNCHER         launcher of both sweeps (default: pool on cuda, a worker pinned to each GPU of the
#                             runner; local otherwise, where the points of these small sweeps run in the sweep process)
#   VLMPROBE_EXTRA_ARGS       Hydra overrides for both sweeps, e.g. measure.alloc_conf=expandable_segments:True
#   VLMPROBE_SEQ_LEN_ARGS     Hydra overrides for the seq_len sweep only
#   VLMPROBE_IMAGE_SIZE_ARGS  Hydra overrides for the image-size sweep only (tests shrink it with these)
# Overrides are split on whitespace, so a value must not contain spaces. Relative paths are taken from the
# repository root (the script runs there).
set -uo pipefail
cd "$(dirname "$0")/.."

BACKEND=${VLMPROBE_BACKEND:-cuda}
ROOT=${VLMPROBE_RESULTS:-results/nightly}
BASELINES=${VLMPROBE_BASELINES:-results/baseline}
TOLERANCE=${VLMPROBE_TOLERANCE:-0.02}
if [ "$BACKEND" = cuda ]; then LAUNCHER=${VLMPROBE_LAUNCHER:-pool}; else LAUNCHER=${VLMPROBE_LAUNCHER:-local}; fi
read -r -a EXTRA <<< "${VLMPROBE_EXTRA_ARGS:-}"
read -r -a SEQ_LEN <<< "${VLMPROBE_SEQ_LEN_ARGS:-}"
read -r -a IMAGE_SIZE <<< "${VLMPROBE_IMAGE_SIZE_ARGS:-}"
FAILED=()

fail() {
  echo "nightly: FAILED: $1" >&2
  FAILED+=("$1")
}

# run_sweep NAME [OVERRIDES...]: run one sweep; set DIR to the results dir it made ("" if none).
run_sweep() {
  local sweep=$1
  shift
  DIR=""
  local before
  before=$(LC_ALL=C ls -d "$ROOT/$sweep"/*/ 2>/dev/null)  # C: the sort order comm expects
  echo "nightly: sweep $sweep (backend $BACKEND, launcher $LAUNCHER)" >&2
  python -m vlmprobe "+sweep=$sweep" "results_dir=$ROOT" "measure.backend=$BACKEND" "launcher=$LAUNCHER" \
    "${EXTRA[@]}" "$@" ||
    fail "sweep $sweep (python -m vlmprobe exited $?)"
  # the new dir is the one that was not there before (timestamped names: a rerun never reuses one)
  DIR=$(LC_ALL=C comm -13 <(echo "$before") <(LC_ALL=C ls -d "$ROOT/$sweep"/*/ 2>/dev/null) | tail -n 1)
  DIR=${DIR%/}
  if [ -z "$DIR" ]; then
    fail "sweep $sweep wrote no results dir"
    return
  fi
  # the sweep exits 0 when any point finished; a nightly also wants every point to have a figure or an OOM
  python - "$DIR" <<'EOF' || fail "sweep $sweep: points that did not finish (see $DIR/summary.md)"
import sys
from pathlib import Path
from vlmprobe.results.table import read_table
table = read_table(Path(sys.argv[1]) / "results.csv")
bad = table[~table["status"].isin(["ok", "oom"])]
for row in bad.itertuples():
    print(f"nightly: {row.point_id}: {row.status}", file=sys.stderr)
sys.exit(1 if len(bad) else 0)
EOF
}

# gate DIR: compare DIR with its baseline, or say how to make one
gate() {
  local dir=$1 baseline
  baseline=$(python -c 'import sys; from vlmprobe.results.compare import baseline_path; print(baseline_path(*sys.argv[1:]))' \
    "$BASELINES" "$dir") || { fail "finding the baseline of $dir"; return; }
  if [ ! -f "$baseline/results.csv" ]; then
    echo "nightly: no baseline at $baseline: nothing to gate against. To make this run the baseline:" >&2
    echo "  mkdir -p $baseline && cp -r $dir/. $baseline/" >&2
    return
  fi
  python -m vlmprobe.results.compare "$baseline" "$dir" --tolerance "$TOLERANCE" || fail "regression gate: $dir vs $baseline"
}

run_sweep seq_len "${SEQ_LEN[@]}"
SEQ_LEN_DIR=$DIR
run_sweep qwen2_vl_image_size "${IMAGE_SIZE[@]}"
IMAGE_SIZE_DIR=$DIR

if [ -n "$SEQ_LEN_DIR" ]; then
  python -m vlmprobe.results.finding "$SEQ_LEN_DIR" || fail "finding check on $SEQ_LEN_DIR"
fi
for dir in "$SEQ_LEN_DIR" "$IMAGE_SIZE_DIR"; do
  if [ -n "$dir" ]; then
    gate "$dir"
  fi
done

echo "nightly: results in $ROOT" >&2
if [ ${#FAILED[@]} -gt 0 ]; then
  echo "nightly: ${#FAILED[@]} step(s) failed:" >&2
  printf '  - %s\n' "${FAILED[@]}" >&2
  exit 1
fi
echo "nightly: every step passed" >&2
