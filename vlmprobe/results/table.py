"""Rows on disk: the schema, the CSV appended after every point, and the tables made from it at the end.

One row per point, one column per variable; memory figures are integers in bytes (an empty cell is a value
the backend cannot know, never zero). Reports show MiB/GiB, 1024-based.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path

import pandas as pd

from vlmprobe.sizes import MiB
from vlmprobe.states import Status

__all__ = ["axis_column", "columns_for", "gpu_check_runs", "INPUT_COLUMNS", "mib", "pivot", "RANK_COLUMNS",
           "RANK_VALUE_COLUMNS", "read_results_dir", "read_table", "RowWriter", "SUPERSEDED", "superseded",
           "value_text"]

INPUT_COLUMNS = [
    "sweep", "point_id", "case", "model", "model_source", "params", "trainable_params", "dtype", "autocast_dtype", "optimizer",
    "batch_size", "grad_accum_steps", "effective_batch_size", "lm_max_length", "image_size", "images_per_sample",
    "max_pixels", "image_tokens",
    "videos_per_sample", "video_frames", "video_size", "video_max_pixels", "video_tokens",  # empty without videos
    "grad_ckpt_lm", "grad_ckpt_vision", "freeze_vision", "freeze_lm", "lora_r", "quantization",
    "dist", "world_size", "device",
    "step", "num_generations", "max_completion_length", "beta", "use_vllm",  # step=grpo (empty otherwise)
    "completion_length",  # step=dpo: tokens of the chosen and of the rejected completion (empty otherwise)
    "reference", "logits_path",  # step=grpo and step=dpo: whether a frozen reference scores the rows; the logits path
    "attn_implementation", "alloc_conf", "hold_outputs", "steps",
]
OUTPUT_COLUMNS = [
    "backend", "status",
    "peak_allocated_bytes",  # max over all steps: what measure_vram.py's max_memory_allocated reports
    "last_step_peak_allocated_bytes",  # the steady-state step (optimizer state already allocated)
    # several ranks (dist.world_size > 1): every memory figure is the max over ranks; these say where it sits
    "max_rank", "min_rank_peak_allocated_bytes", "rank_imbalance",  # rank of the peak; lowest rank peak; max / min
    "peak_reserved_bytes", "last_step_peak_reserved_bytes", "peak_active_bytes",
    "num_alloc_retries", "num_ooms", "nvml_used_bytes", "nvml_process_bytes",
    # estimate/cpu with a device profile that knows its CUDA context: the allocator model's peak reserved + the
    # cuBLAS workspaces + the context, what the card would show in use at the peak (cuda: nvml_process_bytes)
    "predicted_device_bytes",
    "after_load_bytes",
    "build_peak_bytes",  # allocated at the most while the model was built (ZeRO-3 zero.Init: its pieces)
    "load_peak_bytes",  # ... while it was built and prepared (sharded, wrapped): the whole load, the batch included
    "after_step_bytes",  # allocated after the last optimizer step: what a training loop carries between steps
    # offload to the CPU on estimate/cpu: host memory this rank holds (offloaded partitions, optimizer state, host
    # grads), outside every device figure; its peak over the point (load included), and after the last step
    "peak_host_bytes", "after_step_host_bytes",
    "generate_peak_bytes", "reference_peak_bytes",  # step=grpo / dpo: the rollout, the reference scoring (empty: absent)
    "forward_peak_bytes", "backward_peak_bytes", "optimizer_peak_bytes", "peak_phase",
    "params_bytes", "grads_bytes", "optimizer_state_bytes", "optimizer_state_dtype", "activations_bytes",
    "oom_block_bytes",  # oom rows: the block the allocator was asked for (the tensor's bytes rounded up to 512)
    "oom_segment_bytes",  # oom rows: the segment it tried to reserve for it (the size CUDA's message prints)
    "imposed_capacity_bytes",  # the device capacity the point ran against, where one was imposed (else the card's)
    "allocator_backend",  # cuda: native | cudaMallocAsync, as the worker's allocator really ran
    "step_time_s", "snapshot_file", "notes", "error",
]
# ranks.csv (points of several ranks): a rank's figures are the point's output columns but those about ranks
RANK_VALUE_COLUMNS = [c for c in OUTPUT_COLUMNS if c not in ("backend", "status", "error", "snapshot_file", "max_rank",
                                                             "min_rank_peak_allocated_bytes", "rank_imbalance")]
RANK_COLUMNS = ["point_id", "rank", "simulated_as", "backend", "status", *RANK_VALUE_COLUMNS, "error"]


def axis_column(axis: str) -> str:
    """The row column a swept config key lands in: data.batch_size -> batch_size (an input column already);
    any other key keeps its dotted name as a column of its own."""
    leaf = axis.split(".")[-1]
    return leaf if leaf in INPUT_COLUMNS else axis


def columns_for(axes: list[str]) -> list[str]:
    return INPUT_COLUMNS + [axis_column(a) for a in axes if axis_column(a) not in INPUT_COLUMNS] + OUTPUT_COLUMNS


def value_text(value, missing: str) -> str:
    """A table cell as text: `missing` for an empty cell, 8 rather than 8.0 for a whole number (a column with an
    empty cell is read as float), anything else as str()."""
    if pd.isna(value):
        return missing
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


class RowWriter:
    """Appends one CSV row per finished point and flushes it to disk at once, so a sweep killed at any
    moment keeps every row it finished. On resume it keeps the existing header, extended by any column this
    version writes that the file's older version did not (its rows get them empty)."""

    def __init__(self, path: Path, columns: list[str]):
        self.path = path
        if path.exists():
            drop_cut_line(path)  # a kill mid-header leaves nothing: the header is written again below
        if path.exists() and path.stat().st_size:
            with path.open(newline="") as f:
                existing = next(csv.reader(f))
            added = [c for c in columns if c not in existing]
            columns = existing + added
            if added:
                widen(path, columns)
        else:
            with path.open("w", newline="") as f:
                csv.writer(f).writerow(columns)
        self.columns = columns

    def append(self, row: dict) -> None:
        unknown = set(row) - set(self.columns)
        if unknown:
            raise ValueError(f"row has columns the results file does not: {sorted(unknown)}")
        with self.path.open("a", newline="") as f:
            csv.DictWriter(f, self.columns).writerow(row)
            f.flush()
            os.fsync(f.fileno())


def widen(path: Path, columns: list[str]) -> None:
    """Rewrite the CSV at `path` under the header `columns` (its own header plus new ones at the end), every
    row kept; written beside it and renamed over it, so a kill midway leaves the old file whole."""
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    partial = path.with_name(path.name + ".widening")
    with partial.open("w", newline="") as f:
        writer = csv.DictWriter(f, columns)
        writer.writeheader()
        writer.writerows(rows)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)


def drop_cut_line(path: Path) -> None:
    """A kill mid-write can leave a last line without its newline: that row never finished, drop it so
    the next row starts on a line of its own."""
    data = path.read_bytes()
    if not data.endswith(b"\n"):
        path.write_bytes(data[: data.rfind(b"\n") + 1])


def read_table(path: Path) -> pd.DataFrame:
    """The CSV as typed columns: byte figures and counts as nullable integers. A last line cut short by a
    kill mid-write is dropped."""
    table = pd.read_csv(path, on_bad_lines="skip", engine="python")
    for column in table.columns:
        if column.endswith("_bytes") or column in ("params", "trainable_params", "num_alloc_retries", "num_ooms"):
            table[column] = pd.to_numeric(table[column], errors="coerce").astype("Int64")
    return table.dropna(subset=["status"])


def read_results_dir(out_dir: Path) -> pd.DataFrame:
    """The rows of a results dir given on a command line; ValueError (one line) if it is not one."""
    csv = out_dir / "results.csv"
    if not csv.is_file():
        raise ValueError(f"{out_dir} is not a vlmprobe results dir (no results.csv)")
    try:
        return read_table(csv)
    except Exception as exc:  # any unreadable file is bad input, whatever pandas calls it
        raise ValueError(f"{csv} could not be read: {exc}") from None


def gpu_check_runs(root: Path, sweep: str = "*", part: str = "nightly") -> list[Path]:
    """The results dirs scripts/gpu_check.sh's `part` (nightly, allocator) measured under `root`
    (results/gpu_check/: <card>/<stamp>/<part>/<sweep>/<stamp>/), of `sweep` or of every sweep, oldest first per card."""
    return sorted(csv.parent for csv in Path(root).glob(f"*/*/{part}/{sweep}/*/results.csv"))


SUPERSEDED = "SUPERSEDED.md"  # in a results dir: it measured a program the code no longer runs, and says what changed


def superseded(out_dir: Path) -> str | None:
    """The SUPERSEDED.md note of a results dir, or None where the code still runs the program it measured."""
    note = Path(out_dir) / SUPERSEDED
    return note.read_text().strip() if note.exists() else None


def mib(value) -> str:
    return "" if pd.isna(value) else f"{value / MiB:,.1f}"


def pivot(table: pd.DataFrame, axes: list[str], value: str = "peak_allocated_bytes") -> pd.DataFrame:
    """Peak MiB with rows = batch size (or the first axis) and columns = the other swept axes; a point that
    did not finish shows its status in capitals."""
    cells = table.apply(lambda r: mib(r[value]) if r["status"] == Status.OK else r["status"].upper(), axis=1)
    row_key = "batch_size" if "data.batch_size" in axes or not axes else axis_column(axes[0])
    others = [axis_column(a) for a in axes if axis_column(a) != row_key]
    frame = table.assign(cell=cells)
    if not others:
        return frame.set_index(row_key)[["cell"]].rename(columns={"cell": "peak MiB"})
    frame["columns"] = frame[others].astype(str).apply(
        lambda r: ", ".join(f"{k}={v}" for k, v in zip(others, r)), axis=1)
    wide = frame.pivot_table(index=row_key, columns="columns", values="cell", aggfunc="first", sort=False)
    return wide.sort_index().fillna("")  # a cell no point filled (a max-batch search probes different sizes)
