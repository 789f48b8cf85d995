"""The published nanoVLM issue #103 table (RTX 3090) as data, and our rows set beside it.

nanovlm_issue103.csv holds the figures as published (MiB, two decimals, torch.cuda.max_memory_allocated()
/ 1024**2) with the setup measure_vram.py ran, as a vlmprobe row's input columns; `load` adds them in bytes.
A published point is `ok` (a figure), `oom` or `absent` (not reported).
"""

from __future__ import annotations

from importlib.resources import files

import pandas as pd

from vlmprobe.gpu import device_profile
from vlmprobe.sizes import MiB
from vlmprobe.states import Status

__all__ = ["AXES", "CARD", "DEVICE", "DEVICE_BYTES", "load", "matches", "same_setup", "SETUP", "setup_text",
           "side_by_side"]

TABLE = files("vlmprobe.results") / "nanovlm_issue103.csv"
DEVICE = "RTX 3090"
# The card's profile (conf/device/rtx3090.yaml): torch.cuda.get_device_properties(0).total_memory on an RTX
# 3090 is 23.69 GiB, not the nominal 24 GiB (24,576 MiB) nor 24e9 B. Fitting is judged against what the
# allocator could ever have had.
CARD = device_profile.load("rtx3090")
DEVICE_BYTES = CARD.total_memory
# what measure_vram.py ran, as a row's input columns: full fine-tune, no checkpointing, no accumulation, the
# logits kept alive through backward and the optimizer step (hold_outputs)
SETUP = ["model", "dtype", "autocast_dtype", "optimizer", "grad_accum_steps", "grad_ckpt_lm", "grad_ckpt_vision",
         "freeze_vision", "freeze_lm", "lora_r", "attn_implementation", "steps", "hold_outputs", "image_size",
         "images_per_sample"]
POINT = ["batch_size", "lm_max_length"]
AXES = {"batch_size", "lm_max_length"}  # the row columns the seq_len sweep varies


def load() -> pd.DataFrame:
    with TABLE.open() as f:
        table = pd.read_csv(f)
    table["peak_bytes"] = (table["peak_mib"] * MiB).round().astype("Int64")
    return table


def same_setup(table: pd.DataFrame) -> pd.Series:
    """Rows run with the published setup (one for the whole table). A setup column the table lacks (results
    written before vlmprobe recorded it) is not compared. These columns are never empty in a row, and both
    sides are parsed by pandas, so comparing them as text is exact."""
    present = [c for c in SETUP if c in table.columns]
    setup = load()[present].iloc[0].astype(str)
    return (table[present].astype(str) == setup).all(axis=1)


def setup_text() -> str:
    return ", ".join(f"{k}={v}" for k, v in load()[SETUP].iloc[0].items())


def matches(table: pd.DataFrame, axis_columns: list[str]) -> bool:
    """A sweep the published table speaks to: its axes are the table's, every row has the published setup,
    and it has every point the paper reports (a max-batch search over the same axes does not)."""
    if set(axis_columns) != AXES or not len(table) or not bool(same_setup(table).all()):
        return False
    published = load()
    reported = published[published["status"] != "absent"]
    return set(zip(reported["batch_size"], reported["lm_max_length"])) <= set(zip(table["batch_size"], table["lm_max_length"]))


def side_by_side(table: pd.DataFrame) -> pd.DataFrame:
    """One row per (batch_size, lm_max_length) either side has: ours_status/ours_bytes, published_status/
    published_bytes, ratio = ours / published where both have a figure. Only rows with the published setup."""
    ours = table[same_setup(table)][[*POINT, "status", "peak_allocated_bytes"]]
    ours = ours.rename(columns={"status": "ours_status", "peak_allocated_bytes": "ours_bytes"})
    published = load()[[*POINT, "status", "peak_bytes"]]
    published = published.rename(columns={"status": "published_status", "peak_bytes": "published_bytes"})
    both = ours.merge(published, on=POINT, how="outer").sort_values(["lm_max_length", "batch_size"],
                                                                    ascending=[False, True], ignore_index=True)
    figures = (both["ours_status"] == Status.OK) & (both["published_status"] == Status.OK)
    both["ratio"] = (both["ours_bytes"].astype(float) / both["published_bytes"].astype(float)).where(figures)
    return both
