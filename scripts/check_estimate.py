#!/usr/bin/env python
"""Accuracy of the estimate backend, printed as tables of relative error per point.

1. bookkeeping: estimate vs the cpu backend (the same program on real tensors) on tiny models; must be 0.
2. published: the seq_len estimate for the RTX 3090 (device=rtx3090) vs the published CUDA figures of nanoVLM
   issue #103, measured on that card.
3. cuda: estimate vs cuda for the seq_len and qwen2_vl_image_size sweeps. With a GPU visible both are run
   here; otherwise `--cuda-dir DIR` (repeatable) compares committed cuda results dirs with a fresh estimate
   of the same config; without either this part says it is unverified. A cuda run that named no card
   (device=none) is estimated for the card it ran on (env.json's device_name), where a profile is that card's:
   its kernels and cuBLAS workspaces are what the measurement holds. A dir that ran a dataset's steps
   (data.source, steps.csv) is compared step by step too.

    python scripts/check_estimate.py [--cuda-dir results/seq_len/<stamp>] [--parts bookkeeping,published,cuda]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd

from vlmprobe.gpu import device_profile
from vlmprobe.point.dataset_steps import STEPS_FILE
from vlmprobe.results.table import read_table, superseded
from vlmprobe.sizes import MiB

TINY_SETTINGS = {
    "fp32": ["train.autocast_dtype=null"],
    "fp32 + bf16 autocast": [],
    "bf16 weights": ["train.param_dtype=bfloat16", "train.autocast_dtype=null"],
}
TINY_MODELS = ["nanovlm_tiny", "qwen2_vl_tiny", "qwen2_5_vl_tiny", "qwen3_vl_tiny", "llava_tiny", "llava_next_tiny",
               "idefics3_tiny", "gemma3_tiny", "mllama_tiny"]
TINY_LENGTHS = "[48,64]"  # lm_max_length of the smoke sweep's points: every tiny variant's images fit (idefics3_tiny's take 33)
CUDA_SWEEPS = ["seq_len", "qwen2_vl_image_size"]
PEAKS = ["peak_allocated_bytes", "peak_reserved_bytes"]


def sweep(args: list[str], out: Path) -> Path:
    """Run `python -m vlmprobe ARGS` into `out`; the results dir it wrote."""
    proc = subprocess.run([sys.executable, "-m", "vlmprobe", *args, f"results_dir={out}"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"vlmprobe {' '.join(args)} failed:\n{proc.stderr[-2000:]}")
    return max(out.glob("*/*/"), key=lambda p: p.stat().st_mtime)


def relative(table: pd.DataFrame, reference: str, estimate: str, error: str = "rel_error_%") -> pd.DataFrame:
    table[error] = ((table[estimate] - table[reference]) / table[reference] * 100).round(2) + 0.0  # no "-0"
    for column in (reference, estimate):
        table[column] = (table[column] / MiB).round(1)
    return table.rename(columns={reference: f"{reference} MiB", estimate: f"{estimate} MiB"})


def bookkeeping(tmp: Path, models: list[str]) -> pd.DataFrame:
    rows = []
    for model in models:
        for setting, extra in TINY_SETTINGS.items():
            base = ["+sweep=smoke", f"+sweep.axes.model=[{model}]", f"sweep.axes.data.lm_max_length={TINY_LENGTHS}", *extra]
            figures = {}
            for backend in ("cpu", "estimate"):
                table = read_table(sweep(base + [f"measure.backend={backend}"], tmp / f"{model}-{backend}") / "results.csv")
                figures[backend] = table.set_index("point_id")["peak_allocated_bytes"]
            for point_id, cpu in figures["cpu"].sort_index().items():  # results.csv: in the order points finished
                rows.append({"model": model, "setting": setting, "point": point_id, "cpu": cpu,
                             "estimate": figures["estimate"][point_id]})
    return relative(pd.DataFrame(rows), "cpu", "estimate")


def estimate_overrides(env: dict) -> list[str]:
    """The command of a cuda results dir (its env.json) as an estimate: the same overrides, and where it named no
    card, the profile of the card it ran on (none where no profile is that card's)."""
    overrides = [o for o in env["overrides"] if o.split("=")[0] not in ("measure.backend", "results_dir", "resume")]
    named = [o for o in overrides if o.split("=")[0] in ("device", "+device")]
    if not named or named[-1].split("=", 1)[1] == "none":
        card = device_profile.key_of_card(env["device_name"])
        if card is not None:
            overrides = [o for o in overrides if o not in named] + [f"device={card}"]
    return overrides + ["measure.backend=estimate"]


def against(reference_dir: Path, tmp: Path) -> tuple[pd.DataFrame, pd.DataFrame | None]:
    """Estimate the command of a cuda results dir (estimate_overrides) and compare point by point; where the dir
    ran a dataset's steps (data.source: steps.csv), step by step too (else None)."""
    overrides = estimate_overrides(json.loads((reference_dir / "env.json").read_text()))
    print(f"estimated with: {' '.join(overrides)}\n")
    estimated = sweep(overrides, tmp / reference_dir.name)
    steps = step_by_step(reference_dir / STEPS_FILE, estimated / STEPS_FILE) if (reference_dir / STEPS_FILE).exists() \
        else None
    return point_by_point(read_table(reference_dir / "results.csv"), read_table(estimated / "results.csv")), steps


def step_by_step(reference: Path, estimate: Path) -> pd.DataFrame:
    """Two steps.csv files compared micro batch by micro batch (point, step, micro, rank): peak allocated and
    reserved. A micro batch only one of them ran (the other ran out before it) has an empty side."""
    keys = ["point_id", "step", "micro", "rank"]
    cuda = pd.read_csv(reference)[[*keys, "longest_tokens", *PEAKS]]
    return compared(cuda.merge(pd.read_csv(estimate)[[*keys, *PEAKS]], on=keys, how="outer",
                               suffixes=("_cuda", "_estimate")))


def point_by_point(cuda: pd.DataFrame, estimate: pd.DataFrame) -> pd.DataFrame:
    columns = ["point_id", "status", *PEAKS]
    return compared(cuda[columns].merge(estimate[columns], on="point_id", suffixes=("_cuda", "_estimate")))


def compared(merged: pd.DataFrame) -> pd.DataFrame:
    """Peaks of cuda (suffix _cuda) and estimate (_estimate) side by side, in MiB, with their relative errors."""
    merged = merged.rename(columns={
        "peak_allocated_bytes_cuda": "cuda", "peak_allocated_bytes_estimate": "estimate",
        "peak_reserved_bytes_cuda": "cuda reserved", "peak_reserved_bytes_estimate": "estimate reserved"})
    merged = relative(merged, "cuda", "estimate")
    return relative(merged, "cuda reserved", "estimate reserved", "reserved rel_error_%")


def published(tmp: Path) -> pd.DataFrame:
    from vlmprobe.results import published as reference

    estimate = read_table(sweep(["+sweep=seq_len", f"device={reference.CARD.key}", "measure.backend=estimate"],
                                tmp / "published") / "results.csv")
    side = reference.side_by_side(estimate)
    side = side[side["ratio"].notna()]
    table = pd.DataFrame({"batch_size": side["batch_size"], "lm_max_length": side["lm_max_length"],
                          "published": side["published_bytes"].astype(float), "estimate": side["ours_bytes"].astype(float)})
    return relative(table, "published", "estimate")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cuda-dir", action="append", type=Path, default=[], help="a results dir with backend=cuda rows")
    parser.add_argument("--parts", default="bookkeeping,published,cuda")
    parser.add_argument("--models", default=",".join(TINY_MODELS), help="tiny models of the bookkeeping part")
    args = parser.parse_args()
    parts = args.parts.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if "bookkeeping" in parts:
            print("## estimate vs cpu backend (same program, real tensors): must be 0\n")
            table = bookkeeping(tmp, args.models.split(","))
            print(table.to_markdown(index=False), "\n")
            if (table["rel_error_%"] != 0).any():
                raise SystemExit("estimate and cpu disagree: the fake bookkeeping is broken")
        if "published" in parts:
            print("## seq_len estimate vs the published RTX 3090 figures (nanoVLM issue #103, CUDA)\n")
            print(published(tmp).to_markdown(index=False), "\n")
        if "cuda" in parts:
            dirs = list(args.cuda_dir)
            if not dirs:
                import torch

                if torch.cuda.is_available():
                    dirs = [sweep([f"+sweep={name}", "measure.backend=cuda"], tmp / f"cuda-{name}") for name in CUDA_SWEEPS]
            if not dirs:
                print("## estimate vs cuda: UNVERIFIED (no GPU visible and no --cuda-dir given)\n")
            for directory in dirs:
                print(f"## estimate vs cuda: {directory}\n")
                if note := superseded(Path(directory)):  # a program the code no longer runs
                    print(f"**{note}**\n")
                points, steps = against(directory, tmp)
                print(points.to_markdown(index=False), "\n")
                if steps is not None:
                    print(f"### step by step ({STEPS_FILE})\n")
                    print(steps.to_markdown(index=False), "\n")
    print("MiB = 1024^2 bytes; rel_error_% = (estimate - reference) / reference; cuda / estimate: peak allocated "
          "(max_memory_allocated), reserved: peak reserved (max_memory_reserved).")


if __name__ == "__main__":
    main()
