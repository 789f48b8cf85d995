"""The micro batches each rank runs, step by step, as the Hugging Face Trainer makes them from a dataset.

Rules, read from transformers 5.25 (trainer.py _get_train_sampler, _get_dataloader, the epoch loop) and accelerate
1.16 (data_loader.py prepare_data_loader, SeedableRandomSampler, BatchSamplerShard):
- random: the Trainer's RandomSampler, which accelerate replaces by its SeedableRandomSampler (the Trainer's
  accelerator_config.use_seedable_sampler defaults true): epoch e is torch.randperm(n) from a torch.Generator
  seeded with seed + e (seed: data_seed, else the seed set_seed gave torch, TrainingArguments.seed = 42).
- group_by_length: LengthGroupedSampler(per-device batch x gradient accumulation): a permutation cut into
  megabatches of min(n // (4 x that batch), 50) x that batch (at least 1x), each sorted longest first, the longest
  sample of all moved to the front. The Trainer gives it no generator, so a real run draws the permutation from
  torch's global generator after the model's init drew from it; here a generator seeded with `seed` draws it, one
  permutation per epoch: the grouping is the Trainer's, the exact permutation an assumption.
- sequential: the dataset's order. worst_first (vlmprobe's, for planning): the samples by LM tokens, longest first
  (ties by index), every epoch, so the first steps are the heaviest.
- batches: BatchSampler(per-device batch, drop_last); with several ranks accelerate's BatchSamplerShard (no
  split_batches, even_batches true): batch i goes to rank i % world_size, a round missing some ranks' batches is
  completed from the epoch's first samples (or dropped with drop_last). One rank: the batches as they are.
- steps: grad_accum consecutive micro batches of a rank make an optimizer step; an epoch's last step takes what is
  left (the Trainer's remainder). Epochs follow each other until `steps` steps are planned.
A sample's LM tokens are its text tokens plus its images' and videos' tokens (vlmprobe/dataset/image_tokens.py) and
the markers around each (ModelSpec.image_markers); beyond max_length it is cut to max_length (the trainer's
truncation) and counted as truncated. A micro batch is padded to its longest sample, rounded up to
pad_to_multiple_of (DataCollatorWithPadding's rule).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlmprobe.dataset.image_tokens import image_tokens, video_tokens
from vlmprobe.dataset.shapes import Sample
from vlmprobe.errors import ConfigError, require_counts, require_flags, whole

__all__ = ["batch_shards", "lm_tokens", "plan_batches", "rank_batches", "SAMPLERS", "sample_order", "StepBatch"]

SAMPLERS = ("random", "group_by_length", "sequential", "worst_first")
MEGABATCH_MULT = 50  # transformers' get_length_grouped_indices: at most 50 batches per megabatch


@dataclass(frozen=True)
class StepBatch:
    """One rank's micro batch of one optimizer step."""

    step: int  # optimizer step, from 0
    micro: int  # micro batch within the step (gradient accumulation), from 0
    rank: int
    epoch: int
    indices: tuple[int, ...]  # the samples' Sample.index
    tokens: tuple[int, ...]  # each sample's LM tokens after truncation
    image_tokens: tuple[int, ...]  # each sample's image and video tokens (before truncation)
    images: tuple[tuple[int, int], ...]  # the micro batch's images, (height, width) px
    truncated: int  # samples cut at max_length
    padded_length: int  # the longest sample, rounded up to pad_to_multiple_of


def lm_tokens(samples: list[Sample], spec) -> list[tuple[int, int]]:
    """(LM tokens, of which image and video tokens) of each sample for the family of `spec`, before truncation:
    text, image and video tokens and the markers the processor writes around each image and video."""
    counted = []
    for sample in samples:
        vision = sum(image_tokens(spec, h, w, images_in_sample=len(sample.images)) for h, w in sample.images)
        vision += sum(video_tokens(spec, f, h, w) for f, h, w in sample.videos)
        markers = getattr(spec, "image_markers", 0) * (len(sample.images) + len(sample.videos))
        counted.append((sample.text_tokens + vision + markers, vision))
    return counted


def sample_order(sampler: str, lengths: list[int], epoch: int, seed: int, grouped_batch: int,
                 generator: torch.Generator | None = None) -> list[int]:
    """Positions of the samples in the order the sampler yields them in `epoch` (group_by_length draws from
    `generator`, which carries over from epoch to epoch)."""
    n = len(lengths)
    if sampler == "sequential":
        return list(range(n))
    if sampler == "worst_first":
        return sorted(range(n), key=lambda i: (-lengths[i], i))
    if sampler == "random":
        return torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    mult = min(n // (grouped_batch * 4), MEGABATCH_MULT) or 1
    size = mult * grouped_batch
    permutation = torch.randperm(n, generator=generator).tolist()
    megabatches = [sorted(permutation[i:i + size], key=lambda j: lengths[j], reverse=True) for i in range(0, n, size)]
    longest = max(range(len(megabatches)), key=lambda m: lengths[megabatches[m][0]])  # the first of the longest
    megabatches[0][0], megabatches[longest][0] = megabatches[longest][0], megabatches[0][0]
    return [i for megabatch in megabatches for i in megabatch]


def batch_shards(order: list[int], batch_size: int, world_size: int, drop_last: bool) -> list[list[list[int]]]:
    """Each rank's micro batches of one epoch: BatchSampler, then BatchSamplerShard's rounds (module docstring)."""
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    if drop_last and batches and len(batches[-1]) < batch_size:
        batches.pop()
    if world_size == 1:
        return [batches]
    return [rank_batches(batches, world_size, rank, batch_size, drop_last) for rank in range(world_size)]


def rank_batches(batches: list[list[int]], world_size: int, rank: int, batch_size: int,
                 drop_last: bool) -> list[list[int]]:
    """One rank's batches as BatchSamplerShard hands them out (split_batches false, even_batches true): a round of
    world_size batches is handed out once its last batch is full; without drop_last the unfinished round is then
    filled up, every rank's batch completed from the samples of the epoch's first world_size batches (repeated
    where they are too few)."""
    mine, first, pending = [], [], None
    for i, batch in enumerate(batches):
        if not drop_last and i < world_size:
            first += batch
        if i % world_size == rank:
            pending = batch
        if i % world_size == world_size - 1 and len(batch) == batch_size:
            mine.append(pending)
            pending = None
    if drop_last or not first:
        return mine
    if pending is not None and len(pending) == batch_size:
        mine.append(pending)
    while len(first) < world_size * batch_size:
        first += first
    last, i = list(batches[-1]), len(batches) - 1
    if len(last) == batch_size:  # already handed out: the filling starts at the next batch
        last, i = [], i + 1
    cursor = 0
    while i % world_size != 0 or last:
        end = cursor + batch_size - len(last)
        last = last + first[cursor:end]
        if i % world_size == rank:
            mine.append(last)
        cursor, last, i = end, [], i + 1
    return mine


def plan_batches(samples: list[Sample], spec, *, batch_size: int, steps: int, world_size: int = 1, seed: int = 42,
                 sampler: str = "random", max_length: int | None = None, pad_to_multiple_of: int | None = None,
                 drop_last: bool = False, grad_accum: int = 1) -> list[StepBatch]:
    """Every rank's micro batches for `steps` optimizer steps (module docstring), in step, micro, rank order."""
    check(samples, batch_size, steps, world_size, seed, sampler, max_length, pad_to_multiple_of, drop_last, grad_accum)
    counted = lm_tokens(samples, spec)
    full = [tokens for tokens, _ in counted]
    kept = [min(t, max_length) if max_length else t for t in full]
    generator = torch.Generator().manual_seed(seed) if sampler == "group_by_length" else None
    planned: list[StepBatch] = []
    step, epoch = 0, 0
    while step < steps:
        order = sample_order(sampler, kept, epoch, seed, batch_size * grad_accum, generator)
        ranks = batch_shards(order, batch_size, world_size, drop_last)
        if not ranks[0]:
            raise ConfigError(f"batch_size={batch_size} is not allowed with drop_last=true: {len(samples)} samples "
                              f"make no full batch on each of {world_size} rank(s)")
        micro_batches = len(ranks[0])
        for start in range(0, micro_batches, grad_accum):
            if step == steps:
                break
            for micro in range(min(grad_accum, micro_batches - start)):
                for rank in range(world_size):
                    positions = ranks[rank][start + micro]
                    planned.append(step_batch(samples, positions, full, kept, counted, step, micro, rank, epoch,
                                              pad_to_multiple_of))
            step += 1
        epoch += 1
    return planned


def step_batch(samples, positions, full, kept, counted, step, micro, rank, epoch, multiple) -> StepBatch:
    longest = max(kept[p] for p in positions)
    padded = -(-longest // multiple) * multiple if multiple else longest
    return StepBatch(step=step, micro=micro, rank=rank, epoch=epoch,
                     indices=tuple(samples[p].index for p in positions), tokens=tuple(kept[p] for p in positions),
                     image_tokens=tuple(counted[p][1] for p in positions),
                     images=tuple(size for p in positions for size in samples[p].images),
                     truncated=sum(full[p] > kept[p] for p in positions), padded_length=padded)


def check(samples, batch_size, steps, world_size, seed, sampler, max_length, pad_to_multiple_of, drop_last,
          grad_accum) -> None:
    if not samples:
        raise ConfigError("the dataset is not allowed: it holds no samples")
    require_counts("plan", {"batch_size": batch_size, "steps": steps, "world_size": world_size,
                            "grad_accum": grad_accum}, ["batch_size", "steps", "world_size", "grad_accum"])
    require_counts("plan", {"seed": seed}, ["seed"], low=0)
    require_flags("plan", {"drop_last": drop_last}, ["drop_last"])
    if sampler not in SAMPLERS:
        raise ConfigError(f"plan.sampler={sampler!r} is not allowed: use one of {', '.join(SAMPLERS)}")
    for key, value in (("max_length", max_length), ("pad_to_multiple_of", pad_to_multiple_of)):
        if value is not None and (not whole(value) or value < 1):
            raise ConfigError(f"plan.{key}={value!r} is not allowed: it must be an integer >= 1 or null")
