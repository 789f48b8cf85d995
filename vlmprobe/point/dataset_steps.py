"""A dataset's batches, step after step, in one backend session (data.source=): the allocator's cached blocks carry
from one step to the next, as in a real run, so fragmentation from batches of changing shapes shows in reserved.

Rule: the samples (vlmprobe.dataset.read_samples) are planned once per point and rank (plan_batches over
dist.world_size ranks, this process's rank kept; the point's sampler, seed, per-device batch, grad_accum,
lm_max_length as the max length, pad_to_multiple_of); each optimizer step then runs its micro batches one after
another as vlmprobe.steps.sft does (zero_grad, then per micro batch its inputs made as the collator hands them,
forward under autocast, loss / grad_accum, backward; then the optimizer step), each micro batch's inputs built
right before its forward and dropped after its backward. Every step is
traced anew (no step replay: the shapes differ from step to step). Steps are counted from 1 (the Trainer's
global_step once the step is done); micro and rank from 0, as in the plan.

Per micro batch a record: its samples, longest sample, padded length, image tokens and sizes, the peak allocated and
reserved over its forward and backward (the step's optimizer update counted in its last micro batch),
num_alloc_retries so far, and its status; an out-of-memory ends the run there, its record `oom`. The records leave
the point under the row's `steps` key and become steps.csv (vlmprobe.run.sweep).

Limits: the families of vlmprobe.config.checks.DATASET_FAMILIES, step=sft, padded batches or, with data.packing,
one row of the micro batch's samples (Qwen2-VL, Qwen2.5-VL, InternVL); images only; a real DataLoader prefetches the next
batches (their host copies are not on the device; pin_memory is not modelled).
"""

from __future__ import annotations

import csv
from pathlib import Path


from vlmprobe.dataset import StepBatch, plan_batches, read_samples, sample_notes
from vlmprobe.errors import ConfigError, WriteError, first_line
from vlmprobe.models.base import DataShape
from vlmprobe.models.fake_constants import hold_constant_limit
from vlmprobe.sizes import in_words
from vlmprobe.states import Phase, Status
from vlmprobe.steps.common import PhaseClock, StepReport

__all__ = ["DEFAULT_STEPS_CAP", "DatasetRun", "append_steps_csv", "batch_words", "gather_ranks", "plan", "world_size",
           "STEPS_COLUMNS", "STEPS_FILE"]

DEFAULT_STEPS_CAP = 20  # data.steps=null: one epoch, at most this many steps
STEPS_FILE = "steps.csv"
STEPS_COLUMNS = ("point_id", "step", "micro", "rank", "samples", "longest_tokens", "padded_length", "image_tokens",
                 "images", "peak_allocated_bytes", "peak_reserved_bytes", "num_alloc_retries", "status")
NUMBERS = ("no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")


def plan(point: dict, spec, data: DataShape, rank: int | None = None) -> tuple[list, list[StepBatch]]:
    """(samples, the planned micro batches) of the point's data.source: rank `rank`'s (None: every rank's, as the
    config checks read them). The ranks are dist.world_size's (one without dist); image tokens follow the point's
    pixel bounds (data.min_pixels / max_pixels, else the model's), as its batches are built."""
    try:
        samples = read_samples(data.source, image_dir=data.image_dir)
    except ConfigError as exc:  # the library's line names the dataset; the command's names its key too
        raise ConfigError(f"data.source={data.source}: {exc}") from None
    bounded = spec.sized_for(data)  # the plan's image tokens as dataset_batch makes them (Qwen: the point's bounds)
    accum, world = point["train"]["grad_accum_steps"], world_size(point)
    steps = data.steps or min(DEFAULT_STEPS_CAP, -(-len(samples) // (data.batch_size * accum * world)))
    planned = plan_batches(samples, bounded, batch_size=data.batch_size, steps=steps, world_size=world,
                           seed=data.seed, sampler=data.sampler, max_length=data.lm_max_length,
                           pad_to_multiple_of=data.pad_to_multiple_of, grad_accum=accum)
    by_index = {s.index: s for s in samples}
    markers = spec.image_markers
    for batch in planned:  # a sample whose images and markers do not fit its tokens: one line, before any step
        for index, tokens in zip(batch.indices, batch.tokens):
            images = by_index[index].images
            framed = sum(bounded.image_tokens_at(h, w) for h, w in images) + markers * len(images)
            if framed > tokens:
                raise_unfit(spec, index, tokens, framed)
    return samples, [b for b in planned if rank is None or b.rank == rank]


def world_size(point: dict) -> int:
    """The ranks the point's batches are dealt to: dist.world_size, 1 without dist."""
    return (point.get("dist") or {}).get("world_size") or 1  # dist=none holds 1


def raise_unfit(spec, index: int, tokens: int, framed: int) -> None:
    raise ConfigError(f"data.source sample {index} is not allowed for {spec.name}: after truncation it keeps {tokens} "
                      f"tokens, but its images and their vision markers take {framed}; give a larger "
                      f"data.lm_max_length or smaller images (data.max_pixels)")


class DatasetRun:
    """The planned micro batches of one point, run in its session; `records` fills as they run (an out-of-memory
    leaves those before it and its own)."""

    def __init__(self, samples: list, planned: list[StepBatch], world: int = 1, packing: bool = False):
        self.samples = {s.index: s for s in samples}
        self.planned = planned
        self.packing = packing  # the micro batch is one row of its samples' tokens (its "padded length")
        self.world = world  # ranks the batches were dealt to (the note names this one's where there are several)
        self.records: list[dict] = []
        self.notes = sample_notes(samples)

    def run(self, backend, meter, point: dict, spec, data: DataShape, engine, autocast, report: StepReport) -> None:
        """Every planned step (module docstring), filling `report` as vlmprobe.steps.sft does."""
        accum = point["train"]["grad_accum_steps"]
        limit = max(max(4 * len(b.tokens) * b.padded_length, spec.dataset_patches(list(b.images), data))
                    for b in self.planned)
        clock = PhaseClock(meter, report)
        steps: dict[int, list[StepBatch]] = {}
        for batch in self.planned:
            steps.setdefault(batch.step, []).append(batch)
        release = hold_constant_limit(limit)  # the batches' token and patch counts stay real values on fakes
        try:
            for step, micro_batches in steps.items():
                started = clock.begin_step(engine)
                for i, planned in enumerate(micro_batches):
                    window: dict[str, int] = {}
                    record = self.record(planned)
                    self.current = (record, window)
                    inputs = spec.dataset_batch(self.sample_list(planned), planned.padded_length, data,
                                                backend.device())
                    clock.enter(Phase.FORWARD)
                    with autocast():
                        loss = engine.model(**inputs, use_cache=False).loss
                        if accum > 1:
                            loss = loss / accum  # the mean over the effective batch, as accumulation loops do
                    closed(clock, meter, Phase.FORWARD, window)
                    clock.enter(Phase.BACKWARD)
                    engine.backward(loss)
                    del loss, inputs
                    closed(clock, meter, Phase.BACKWARD, window)
                    if i == len(micro_batches) - 1:  # the optimizer step's window counts in this micro batch
                        clock.end_step(engine, lambda: kept_peaks(engine.step, meter, window), started)
                    self.finish(record, window, backend, meter, Status.OK)
            self.current = None
            clock.finish(engine)
        finally:
            release()

    current: tuple[dict, dict] | None = None  # the micro batch running now: its record and peak window

    def ran_out(self, backend, meter) -> None:
        """The running micro batch ran out of memory: its record `oom`, with the peaks it reached."""
        if self.current is None:
            return
        record, window = self.current
        for key, value in meter.peaks().items():
            window[key] = max(window.get(key, 0), value)
        self.finish(record, window, backend, meter, Status.OOM)
        self.current = None

    def finish(self, record: dict, window: dict, backend, meter, status: str) -> None:
        record.update(peak_allocated_bytes=window.get("allocated"), peak_reserved_bytes=window.get("reserved"),
                      num_alloc_retries=backend.final_stats(meter).get("num_alloc_retries"), status=status)
        self.records.append(record)

    def record(self, planned: StepBatch) -> dict:
        longest = max(range(len(planned.tokens)), key=lambda i: planned.tokens[i])
        return {"step": planned.step + 1, "micro": planned.micro, "rank": planned.rank,
                "samples": " ".join(map(str, planned.indices)), "longest_tokens": planned.tokens[longest],
                "padded_length": sum(planned.tokens) if self.packing else planned.padded_length,
                "image_tokens": sum(planned.image_tokens),
                "images": " ".join(f"{h}x{w}" for h, w in planned.images),
                "longest_images": [list(size) for size in self.samples[planned.indices[longest]].images]}

    def sample_list(self, planned: StepBatch) -> list[tuple[list[tuple[int, int]], int]]:
        return [(list(self.samples[i].images), tokens) for i, tokens in zip(planned.indices, planned.tokens)]

    def note(self) -> str | None:
        """The row's dataset_steps: where it first ran out, else its worst step (the highest allocated peak)."""
        if not self.records:
            return None
        out = next((r for r in self.records if r["status"] == Status.OOM), None)
        if out is not None:
            return f"runs out at step {out['step']}{self.on_rank(out)}: {batch_words(out)}"
        worst = max(self.records, key=lambda r: (r["peak_allocated_bytes"] or 0, -r["step"]))
        return (f"worst step {worst['step']} of {self.records[-1]['step']}{self.on_rank(worst)}: "
                f"{batch_words(worst)}, {in_words(worst['peak_allocated_bytes'])} allocated")

    def on_rank(self, record: dict) -> str:
        return f" on rank {record['rank']}" if self.world > 1 else ""

    def rows(self) -> list[dict]:
        """The records as steps.csv rows (without point_id)."""
        return [{k: v for k, v in r.items() if k != "longest_images"} for r in self.records]


def gather_ranks(rows: dict[int, dict]) -> dict:
    """A distributed point's `steps` and `dataset_steps` from its rank rows (each rank ran its own batches): every
    rank's records, rank by rank; the note of the first rank that ran out, else of the rank with the highest peak."""
    ranks = [r for r in sorted(rows) if rows[r].get("steps") is not None]
    if not ranks:
        return {}
    out = [r for r in ranks if rows[r].get("status") == Status.OOM]
    top = out[0] if out else max(ranks, key=lambda r: (rows[r].get("peak_allocated_bytes") or 0, -r))
    return {"steps": [record for r in ranks for record in rows[r]["steps"]],
            "dataset_steps": rows[top].get("dataset_steps")}


def closed(clock: PhaseClock, meter, phase: str, window: dict) -> None:
    """Close `phase` on the clock, keeping its peaks in the micro batch's `window` too."""
    meter.sync()
    for key, value in meter.peaks().items():
        window[key] = max(window.get(key, 0), value)
    clock.close(phase)


def kept_peaks(run, meter, window: dict) -> None:
    """run(), then its window's peaks kept in the micro batch's `window` (PhaseClock closes it right after)."""
    run()
    meter.sync()
    for key, value in meter.peaks().items():
        window[key] = max(window.get(key, 0), value)


def batch_words(record: dict) -> str:
    """"a batch with a 3,812-token sample holding two 1,344 x 1,008 images": the batch's longest sample, in words."""
    sizes: dict[tuple[int, int], int] = {}
    for h, w in record["longest_images"]:
        sizes[(h, w)] = sizes.get((h, w), 0) + 1
    if not sizes:
        held = "no image"
    else:
        parts = [f"{NUMBERS[n] if n < len(NUMBERS) else n} {h:,} x {w:,} image{'s' if n > 1 else ''}"
                 for (h, w), n in sizes.items()]
        held = " and ".join(parts)
    return f"a batch with a {record['longest_tokens']:,}-token sample holding {held}"


def append_steps_csv(out_dir: Path, point_id: str, rows: list[dict]) -> None:
    """Append a point's step rows to out_dir/steps.csv (the header written with the first). Rows the point left
    there before (a resumed sweep running it again) are dropped first, so each point's steps appear once."""
    path = Path(out_dir) / STEPS_FILE
    try:
        if path.exists() and path.stat().st_size:
            with path.open(newline="") as f:
                before = list(csv.DictReader(f))
            kept = [r for r in before if r.get("point_id") != point_id]
            if len(kept) < len(before):  # written beside it, then renamed over it: a crash leaves one whole file
                write_rows(path.with_suffix(".csv.tmp"), kept).replace(path)
        new = not path.exists() or not path.stat().st_size
        with path.open("a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=STEPS_COLUMNS)
            if new:
                writer.writeheader()
            writer.writerows({"point_id": point_id, **{k: row.get(k) for k in STEPS_COLUMNS[1:]}} for row in rows)
    except OSError as exc:
        raise WriteError(f"{path} cannot be written: {first_line(exc)}") from None


def write_rows(path: Path, rows: list[dict]) -> Path:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=STEPS_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return path
