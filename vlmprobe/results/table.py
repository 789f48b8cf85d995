"""Rows on disk: the schema, the CSV appended after every point, and the tables made from it at the end.

One row per point, one column per variable; memory figures are integers in bytes (an empty cell is a value
the backend cannot know, never zero). Reports show MiB/GiB, 1024-based. Beside results.csv, timeline.jsonl holds each
point's timeline where its backend keeps one (estimate, cpu): one JSON line a point, appended as its row is, the
last line of a point winning (a point run again on resume); a line cut short by a kill is skipped.
"""

from __future__ import annotations

import contextlib
import csv
import io
import itertools
import json
import os
import re
from pathlib import Path

import pandas as pd

from vlmprobe.errors import WriteError, first_line
from vlmprobe.sizes import MiB
from vlmprobe.states import Status

__all__ = ["append_timeline", "axis_column", "columns_for", "gpu_check_runs", "INPUT_COLUMNS", "integer_column",
           "mib", "pivot", "RANK_COLUMNS", "RANK_VALUE_COLUMNS", "read_results_dir", "read_table", "read_timelines",
           "repair", "replacing", "RowWriter", "SUPERSEDED", "superseded", "TIMELINES", "value_text",
           "write_atomically"]

INPUT_COLUMNS = [
    "sweep", "point_id", "case", "model", "model_source", "params", "trainable_params", "dtype", "autocast_dtype", "optimizer",
    "batch_size", "grad_accum_steps", "effective_batch_size", "lm_max_length", "image_size", "images_per_sample",
    "max_pixels", "image_tokens",
    "data_source",  # data.source: the dataset whose batches ran (image_size, images_per_sample, image_tokens empty)
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
    "oom_filled",  # oom rows (estimate, cpu): the largest live groups by module, kind and dtype when it ran out
    "dataset_steps",  # data.source points: where the dataset's steps first ran out, else the worst step and its batch
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
    version writes that the file's older version did not (its rows get them empty), and first sets aside the rows
    it cannot trust (`repair`: `problems` says which), so that no damaged line can swallow a row appended after it.
    `key`: the columns that name a row (a second row of one key is set aside)."""

    def __init__(self, path: Path, columns: list[str], key: tuple[str, ...] = ("point_id",)):
        self.path = path
        self.problems: list[str] = []
        if path.exists():
            drop_cut_line(path)  # a kill mid-header leaves nothing: the header is written again below
        if path.exists() and path.stat().st_size:
            self.problems = repair(path, key)
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
        try:
            with self.path.open("a", newline="") as f:
                csv.DictWriter(f, self.columns).writerow(row)
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:  # a row cut short by it is dropped when the file is next opened (drop_cut_line)
            raise WriteError(f"{self.path} could not be written ({first_line(exc)}); the rows written before this "
                             f"one are kept in it, and the sweep stops here") from exc


def widen(path: Path, columns: list[str]) -> None:
    """Rewrite the CSV at `path` under the header `columns` (its own header plus new ones at the end), every
    row kept; written beside it and renamed over it, so a kill midway leaves the old file whole."""
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))

    def write(f) -> None:
        writer = csv.DictWriter(f, columns)
        writer.writeheader()
        writer.writerows(rows)

    write_atomically(path, write)


def integer_column(name: str) -> bool:
    """Whether a column holds a whole number or nothing: byte figures and counts."""
    return name.endswith("_bytes") or name in ("params", "trainable_params", "num_alloc_retries", "num_ooms")


_INTEGER = re.compile(r"^-?\d+(\.0*)?$")
STATUSES = {str(s) for s in Status}


def damage(record: list[str], header: list[str], seen: set, key: tuple[int, ...]) -> str | None:
    """Why a CSV record cannot be kept as a row under `header`, or None: bytes that are not UTF-8, a field too
    many or too few (a quote left open swallows what follows it), a status that is none, a byte figure or count
    that is not a whole number, a second row of a key already seen (`seen` takes the keys kept)."""
    if any("\ufffd" in field for field in record):
        return "it holds bytes that are not UTF-8 text"
    if len(record) != len(header):
        return f"it has {len(record)} fields, the header {len(header)} (a quote left open, or a cut line)"
    row = dict(zip(header, record))
    if "status" in row and row["status"] not in STATUSES:
        return f"its status {row['status'][:40]!r} is none of {', '.join(sorted(STATUSES))}"
    for name, value in row.items():
        if integer_column(name) and value and not _INTEGER.match(value):
            return f"its {name} {value[:40]!r} is not a whole number"
    named = tuple(record[i] for i in key)
    if named in seen:
        return f"it is a second row for {', '.join(named)}"
    seen.add(named)
    return None


def repair(path: Path, key: tuple[str, ...]) -> list[str]:
    """Keep in `path` only the rows that can be trusted (`damage`); one line per row set aside. The file as it
    was is kept whole beside it (<name>.damaged), and the cleaned file written beside it and renamed over it, so
    nothing is lost and no half file is left."""
    data = path.read_bytes()
    reader = csv.reader(io.StringIO(data.decode("utf-8", errors="replace"), newline=""))
    header = next(reader, [])
    at = {name: i for i, name in enumerate(header)}
    key_index = tuple(at[k] for k in key if k in at)
    kept, problems, seen, line = [], [], set(), reader.line_num
    for record in reader:
        why = damage(record, header, seen, key_index)
        if why:
            problems.append(f"{path.name} line {line + 1}: {why}; set aside, its point runs again")
        else:
            kept.append(record)
        line = reader.line_num
    if not problems:
        return []
    aside = path.with_name(path.name + ".damaged")
    aside = next(p for n in itertools.count() if not (p := aside.with_name(aside.name + (f".{n}" if n else ""))).exists())
    aside.write_bytes(data)
    write_atomically(path, lambda f: csv.writer(f).writerows([header, *kept]))
    return problems + [f"{path.name} as it was is kept in {aside.name}"]


@contextlib.contextmanager
def replacing(path: Path):
    """A path beside `path` (its suffix kept, for writers that read it) to write the file to, renamed over `path`
    once the block ends without an error, removed otherwise: a failing disk or a kill midway leaves the old file
    whole, and never a half file under `path`. A failure is a WriteError naming `path`."""
    partial = path.with_name(f"{path.stem}.partial{path.suffix}")
    try:
        yield partial
        os.replace(partial, path)
    except OSError as exc:
        raise WriteError(f"{path} could not be written ({first_line(exc)}); nothing of it was left half written") \
            from exc
    finally:
        partial.unlink(missing_ok=True)


def write_atomically(path: Path, write) -> None:
    """`write(file)` into a file beside `path`, flushed to disk, then renamed over `path` (`replacing`)."""
    with replacing(path) as partial, partial.open("w", newline="") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


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
        if integer_column(column):
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


TIMELINES = "timeline.jsonl"  # beside results.csv: each point's timeline (module doc)


def append_timeline(out_dir: Path, point_id: str, timeline: dict) -> None:
    """Append `point_id`'s timeline (vlmprobe.estimate.allocator.Timeline.data) to out_dir/timeline.jsonl."""
    path = Path(out_dir) / TIMELINES
    try:
        with path.open("a") as f:
            f.write(json.dumps({"point_id": point_id, **timeline}) + "\n")
            f.flush()
    except OSError as exc:
        raise WriteError(f"{path} could not be written ({first_line(exc)}); the rows are kept in results.csv, and the "
                         f"sweep stops here") from exc


def read_timelines(out_dir: Path) -> dict[str, dict]:
    """point_id -> its timeline, from out_dir/timeline.jsonl ({} without one); a line that is not whole JSON is
    skipped, and a later line of a point wins."""
    path = Path(out_dir) / TIMELINES
    if not path.exists():
        return {}
    timelines = {}
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "point_id" in record:
            timelines[record.pop("point_id")] = record
    return timelines


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
