"""The answer on stdout: per point the figures that decide whether it fits, then one verdict line in words.

Progress and notices go to stderr; this goes to stdout, so it can be piped (`output=json`: the rows as JSON lines
instead). A point fits when what the card would show (predicted_device_bytes: peak reserved + the CUDA context)
stays within the capacity it ran against; without a card (device=none) there is no verdict, only what it needs.
The breakdown is what the row measured: weights, gradients and optimizer state as they stand after the step, and
the rest of the peak (activations, the loss, workspaces) as the difference. Sizes in GiB (2^30 B). An out-of-memory
verdict names the largest one or two groups of what was live when it ran out, where the row has them (oom_filled:
estimate and cpu). A point that ran a dataset's steps (data.source) says where it first ran out, or its worst step,
from its dataset_steps column (vlmprobe.point.dataset_steps).
"""

from __future__ import annotations

import json
import math

import pandas as pd

from vlmprobe.gpu import device_profile
from vlmprobe.sizes import GiB, in_words
from vlmprobe.states import Status

__all__ = ["OUTPUTS", "answer_lines", "breakdown", "card_name", "gib", "json_lines", "records", "shown", "verdict"]

OUTPUTS = ("text", "json")  # the top-level `output=`: the table and verdicts, or the rows as JSON lines


def gib(value) -> str:
    """A size as GiB with two decimals; "-" where it is missing (None or NaN)."""
    return "-" if value is None or pd.isna(value) else f"{value / GiB:.2f}"


def size(value) -> str:
    """A size in words (sizes.in_words); "-" where it is missing."""
    return "-" if value is None else in_words(value)


def figure(row: dict, key: str) -> int | None:
    value = row.get(key)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return int(value)


def card_name(row: dict) -> str | None:
    """The target card's name (device=), or None without one."""
    key = row.get("device")
    if not isinstance(key, str) or key in ("", "none"):
        return None
    profile = device_profile.load(key)
    return profile.name if profile is not None else key


def shown(row: dict) -> int | None:
    """What the card would show at the peak: predicted_device_bytes where the row has it (estimate), nvml's figure
    on cuda, else the peak reserved."""
    for key in ("predicted_device_bytes", "nvml_process_bytes", "peak_reserved_bytes"):
        if (value := figure(row, key)) is not None:
            return value
    return None


def verdict(row: dict) -> str:
    """One line in words: fits (with the room left), does not fit (where, and by how much), or what it needs; for
    a dataset's steps, where it first ran out or its worst step."""
    line = single_verdict(row)
    steps = row.get("dataset_steps")
    if not isinstance(steps, str) or not steps:
        return line
    if row["status"] == Status.OOM:
        head, _, tail = line.partition(": ran out")
        return f"{head}: {steps}; ran out{tail}"
    return f"{line}; {steps}"


def single_verdict(row: dict) -> str:
    """verdict() without a dataset's steps."""
    name, status = row["point_id"], row["status"]
    card, capacity = card_name(row), figure(row, "imposed_capacity_bytes")
    on = f" on the {card}" if card else (" in the capacity given" if capacity else "")
    phase = row.get("peak_phase") or None
    if status == Status.OOM:
        asked = figure(row, "oom_block_bytes")
        where = f" in {phase}" if phase else ""
        need = f", asking for {size(asked)}" if asked else ""
        held = figure(row, "peak_allocated_bytes")
        filled = row.get("oom_filled")
        largest = f"; largest live: {', '.join(filled.split('; ')[:2])}" if isinstance(filled, str) and filled else ""
        return (f"{name}: does not fit{on}: ran out{where}{need} with {size(held)} allocated of {size(capacity)}"
                f"{largest}")
    if status != Status.OK:
        return f"{name}: {status}: {str(row.get('error') or '').splitlines()[0] if row.get('error') else 'no figures'}"
    need, peak = shown(row), figure(row, "peak_allocated_bytes")
    where = f", peak in {phase}" if phase else ""
    if capacity is None or need is None:
        return (f"{name}: needs {size(peak)} allocated, {size(figure(row, 'peak_reserved_bytes'))} reserved{where} "
                f"(no card given: device=NAME gives a verdict)")
    left = capacity - need
    if card and figure(row, "predicted_device_bytes") is not None and \
            device_profile.context_note(device_profile.load(row["device"])):
        where += f"; its CUDA context taken as {size(device_profile.ASSUMED_CONTEXT_BYTES)}, not measured on it"
    if left >= 0:
        return f"{name}: fits{on} with {size(left)} to spare ({size(need)} of {size(capacity)}{where})"
    return f"{name}: does not fit{on}: needs {size(need)}, {size(-left)} over {size(capacity)}{where}"


COLUMNS = ("point", "status", "peak alloc", "peak reserved", "on the card", "capacity", "left", "weights", "grads",
           "optimizer", "rest", "peak in")


PARTS = {"weights": "params_bytes", "gradients": "grads_bytes", "optimizer state": "optimizer_state_bytes"}


def breakdown(row: dict) -> dict[str, int | None]:
    """The peak allocated, in parts: weights, gradients and optimizer state as the row measured them, and the rest
    (activations, the loss, workspaces) as the difference; None where a figure is missing."""
    peak = figure(row, "peak_allocated_bytes")
    parts = {name: figure(row, key) for name, key in PARTS.items()}
    known = None not in parts.values() and peak is not None
    return {**parts, "rest": peak - sum(parts.values()) if known else None}


def cells(row: dict) -> list[str]:
    peak, capacity, need = figure(row, "peak_allocated_bytes"), figure(row, "imposed_capacity_bytes"), shown(row)
    left = capacity - need if capacity is not None and need is not None and row["status"] == Status.OK else None
    return [str(row["point_id"]), str(row["status"]), gib(peak), gib(figure(row, "peak_reserved_bytes")),
            gib(figure(row, "predicted_device_bytes")), gib(capacity), gib(left), *map(gib, breakdown(row).values()),
            str(row.get("peak_phase") or "-")]


def records(table: pd.DataFrame) -> list[dict]:
    return table.astype(object).where(table.notna(), None).to_dict("records")


def answer_lines(table: pd.DataFrame) -> list[str]:
    """The table of figures (GiB) and one verdict per point; nothing for an empty table."""
    rows = records(table)
    if not rows:
        return []
    backends = sorted({str(r.get("backend")) for r in rows if r.get("backend")})
    grid = [list(COLUMNS)] + [cells(r) for r in rows]
    widths = [max(len(line[i]) for line in grid) for i in range(len(COLUMNS))]
    text = ["  ".join(c.ljust(w) if i < 2 or i == len(COLUMNS) - 1 else c.rjust(w)
                      for i, (c, w) in enumerate(zip(line, widths))).rstrip() for line in grid]
    head = (f"vlmprobe: {', '.join(backends)} (GiB = 2^30 B; 'on the card': peak reserved + CUDA context; rest: "
            f"activations and workspaces at the peak)")
    return [head, *text, "", *(verdict(r) for r in rows)]


def json_lines(table: pd.DataFrame) -> list[str]:
    """The rows, one JSON object a line (NaN as null)."""
    return [json.dumps(row, default=str) for row in records(table)]
