"""A plan's micro batches as rows: per step, micro batch and rank the samples, the longest sample, the padded
length, the image tokens and sizes, the truncated count; `steps_plan.csv` is those rows, and `worst` the micro
batch the engine should fear most (the longest padded length, then the most image tokens; the first of equals).
"""

from __future__ import annotations

import csv
from pathlib import Path

from vlmprobe.dataset.batches import StepBatch
from vlmprobe.errors import ConfigError, WriteError, first_line

__all__ = ["COLUMNS", "summarize_plan", "worst", "write_steps_csv"]

COLUMNS = ("step", "micro", "rank", "samples", "longest_tokens", "padded_length", "image_tokens", "images",
           "truncated")


def summarize_plan(plan: list[StepBatch]) -> list[dict]:
    """One row per micro batch of `plan`, in its order; `samples` and `images` as text ("3 17", "448x448 ...")."""
    if not plan:
        raise ConfigError("the plan is not allowed: it holds no micro batch")
    return [{"step": b.step, "micro": b.micro, "rank": b.rank, "samples": " ".join(map(str, b.indices)),
             "longest_tokens": max(b.tokens), "padded_length": b.padded_length, "image_tokens": sum(b.image_tokens),
             "images": " ".join(f"{h}x{w}" for h, w in b.images), "truncated": b.truncated} for b in plan]


def worst(rows: list[dict]) -> dict:
    """The row with the longest padded length, then the most image tokens (the first of equals)."""
    return max(rows, key=lambda r: (r["padded_length"], r["image_tokens"], -rows.index(r)))


def write_steps_csv(rows: list[dict], path: str | Path) -> Path:
    """`rows` (summarize_plan's) as a CSV file with COLUMNS; WriteError naming the file where it cannot be written."""
    path = Path(path)
    try:
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS)
            writer.writeheader()
            writer.writerows({k: row[k] for k in COLUMNS} for row in rows)
    except OSError as exc:
        raise WriteError(f"{path} cannot be written: {first_line(exc)}") from None
    return path
