#!/usr/bin/env python
"""nanoVLM issue #103's batch sizes estimated one after another in one process, as measure_vram.py ran them,
beside one fresh process per point (as vlmprobe measures) and the published RTX 3090 figures.

measure_vram.py builds the model once, then for each batch size in turn: reset_peak_memory_stats, a fresh
AdamW, 2 iterations of zero_grad -> forward under autocast (the logits kept in `_`) -> backward -> step, then
max_memory_allocated; it drops the optimizer, loss and batch and calls empty_cache before the next batch size.
What one batch size leaves to the next: the weights, the gradients (until the next zero_grad), the last logits
in `_` (until the next forward returns), the cuBLAS workspaces, and every allocator segment still holding one of
them, whose free remainder later requests are split from. This script runs that loop on the estimate backend
(fake tensors, one allocator model for the whole loop, the card's profile; each iteration's batch made anew, as
the DataLoader does) and prints each batch size's peak allocated bytes beside the fresh-process estimate of the
same point (`+sweep=seq_len device=<card>`) and the published figure, then the cost of a sample between batch 8
and 16 for each. A difference between the two estimates is what the one process's allocation history does to
the figures under the allocator model's rules (block rounding and reuse), nothing else: the step is the same.

    python scripts/check_one_process.py [--lengths 128,512] [--batch-sizes 1,8,16] [--device rtx3090]
"""

from __future__ import annotations

import argparse

import pandas as pd
import torch
from hydra.utils import instantiate

from vlmprobe import backends
from vlmprobe.config.plan import plan_overrides
from vlmprobe.distributed import engines
from vlmprobe.errors import ConfigError
from vlmprobe.gpu import device_profile
from vlmprobe.models.base import DataShape
from vlmprobe.point.build import build_spec, built, DTYPES
from vlmprobe.point.measure import measure
from vlmprobe.results import finding as check, published as reference
from vlmprobe.script_args import options, positive_ints
from vlmprobe.sizes import MiB


def points(length: int, batch_sizes: list[int], card: str, model: str | None) -> list[dict]:
    axes = [f"sweep.axes.data.batch_size=[{','.join(map(str, batch_sizes))}]",
            f"sweep.axes.data.lm_max_length=[{length}]"]
    extra = [f"model={model}"] if model else []
    return [p.config for p in plan_overrides(["+sweep=seq_len", "measure.backend=estimate", f"device={card}", *axes,
                                              *extra])]


def fresh(configs: list[dict]) -> dict[int, int | None]:
    """batch size -> peak allocated bytes of the point estimated on its own (None where it ran out of memory)."""
    rows = {c["data"]["batch_size"]: measure(c) for c in configs}
    return {b: row["peak_allocated_bytes"] if row["status"] == "ok" else None for b, row in rows.items()}


def one_process(configs: list[dict]) -> dict[int, int | None]:
    """batch size -> peak allocated bytes when the batch sizes of `configs` (one length, in order) run one after
    another in one session as measure_vram.py runs them (None where it ran out of memory)."""
    point = configs[0]
    backend = backends.get("estimate")
    spec = build_spec(point["model"])
    card = device_profile.from_config(point["device"])
    train = point["train"]
    peaks = {}
    with backend.session(card.total_memory, "off", card) as meter:
        engine = engines.make(point, backend.device())
        model, _ = built(spec, engine, train, backend.name, meter, lambda: None)
        autocast = backend.autocast(DTYPES.get(train.get("autocast_dtype") or ""))
        held = None  # measure_vram.py's `_`: the last logits, alive across batch sizes until the next forward returns
        for config in configs:
            data = DataShape.from_config(config["data"])
            meter.reset_peak()  # torch.cuda.reset_peak_memory_stats
            engine.prepare(spec, model, instantiate(config["optimizer"], _convert_="all"))  # a fresh AdamW
            batch = loss = None
            try:
                for _ in range(config["measure"]["steps"]):
                    batch = spec.batch(data, backend.device())  # the DataLoader's next batch, moved to the device
                    engine.zero_grad()
                    with autocast():
                        loss, outputs = spec.loss(engine.model, batch)
                    held, outputs = outputs, None  # `_, loss = model(...)`: the previous logits die here
                    engine.backward(loss)
                    engine.step()
                peaks[data.batch_size] = meter.peaks()["allocated"]
            except torch.OutOfMemoryError:
                peaks[data.batch_size] = None
            # measure_vram.py's `finally`: del optimizer, loss and the batch, then empty_cache
            engine.optimizer = batch = loss = None
            meter.tracker.allocator.empty_cache()
        del held
    return peaks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=positive_ints, default="128,512",
                        help="lm_max_length values (comma-separated)")
    parser.add_argument("--batch-sizes", type=positive_ints, default="1,8,16",
                        help="in the order measure_vram.py ran them")
    parser.add_argument("--device", default=reference.CARD.key, choices=[c for c in options("device") if c != "none"],
                        metavar="PROFILE", help="the card's profile (conf/device/)")
    parser.add_argument("--model", default=None, choices=options("model"), metavar="MODEL",
                        help="another model config (default: the sweep's nanoVLM-222M)")
    args = parser.parse_args()
    lengths, batch_sizes = args.lengths, args.batch_sizes
    try:  # a value the planner refuses (a length too short for the model's image tokens, ...): its one line
        planned = {length: points(length, batch_sizes, args.device, args.model) for length in lengths}
    except ConfigError as exc:
        parser.error(str(exc))
    published = {} if args.model else {(r.batch_size, r.lm_max_length): int(r.peak_bytes)
                                       for r in reference.load().itertuples() if r.status == "ok"}
    rows, slopes = [], []
    for length in lengths:
        configs = planned[length]
        alone, together = fresh(configs), one_process(configs)
        figures = {"published": {b: published.get((b, length)) for b in batch_sizes}, "fresh process": alone,
                   "one process": together}
        for b in batch_sizes:
            rows.append({"lm_max_length": length, "batch_size": b,
                         **{f"{k} MiB": None if v[b] is None else v[b] / MiB for k, v in figures.items()},
                         "one - fresh MiB":
                             None if None in (alone[b], together[b]) else (together[b] - alone[b]) / MiB})
        if {check.SLOPE_FROM, check.SLOPE_TO} <= set(batch_sizes):
            per = {k: check.per_sample({(b, length): v[b] for b in v}, length) for k, v in figures.items()}
            slopes.append({"lm_max_length": length, **{f"{k} MiB": None if s is None else s / MiB for k, s in per.items()}})
    print(f"## Peak allocated, device={args.device} (estimate: backend estimate, no GPU; published: CUDA, RTX 3090;"
          f" MiB = 1024^2 B)\n")
    print((pd.DataFrame(rows).round(1) + 0.0).to_markdown(index=False), "\n")  # + 0.0: no "-0"
    if slopes:
        print(f"## Per sample, batch {check.SLOPE_FROM} -> {check.SLOPE_TO}\n")
        print((pd.DataFrame(slopes).round(2) + 0.0).to_markdown(index=False))


if __name__ == "__main__":
    main()
