"""Inputs whose values a forward reads, made so that fake tensors can answer those reads.

FakeTensorMode answers reads of values only for constant fakes (fakes that keep their real values), and propagates
constants only through ops whose outputs have at most CONSTANT_NUMEL_LIMIT (= 1) elements. A family's batch()
therefore raises that limit to its largest such input for as long as the batch lives (`hold_constant_limit`) and
makes those inputs with `constant_tensor` (constant fakes under the mode, ordinary tensors on real backends), so the
model runs unchanged. No activation is computed for real; a constant is still charged at its size, as CUDA would
allocate it. Private torch API: `torch._subclasses.fake_tensor.CONSTANT_NUMEL_LIMIT` (torch 2.11-2.13), raised only
while a batch made here is alive; no transformers patching.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable

import torch

__all__ = ["collated", "constant_tensor", "hold_constant_limit"]

_limit_requests: dict[int, int] = {}  # live requests for a raised CONSTANT_NUMEL_LIMIT: key -> numel
_limit_keys = itertools.count()
_limit_default = 1


def hold_constant_limit(numel: int) -> Callable[[], None]:
    """Inside FakeTensorMode, keep real values for tensors of up to `numel` elements derived from constant
    fakes until the returned release() is called; no effect on real tensors. Requests may overlap: the
    limit is the largest live one, and torch's own value once none is left."""
    from torch._subclasses import fake_tensor

    global _limit_default
    if not _limit_requests:
        _limit_default = fake_tensor.CONSTANT_NUMEL_LIMIT
    key = next(_limit_keys)
    _limit_requests[key] = numel
    fake_tensor.CONSTANT_NUMEL_LIMIT = max([_limit_default, *_limit_requests.values()])

    def release() -> None:
        if _limit_requests.pop(key, None) is not None:
            fake_tensor.CONSTANT_NUMEL_LIMIT = max([_limit_default, *_limit_requests.values()])

    return release


def release_with(tensor: torch.Tensor, release: Callable[[], None]) -> None:
    """Call `release` when `tensor` (a batch's input_ids: the batch lives as long as it does) dies."""
    weakref.finalize(tensor, release)


def constant_tensor(values, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A tensor of Python data or a numpy array (integers, or Idefics3's pixel values, which its forward
    reads to drop all-zero padding images): a constant fake under FakeTensorMode. torch.tensor's own storage
    never passes the tracker (made without a dispatched allocation; the tracker skips fake mode's
    lift_fresh), but a collator's batch lives on the GPU: the clone allocates it through a dispatched op on
    every backend (and stays constant: clone of a constant is constant, within the held limit)."""
    return torch.tensor(values, dtype=dtype, device=device).clone()


def collated(data, device: torch.device, input_ids: list[int], labels: list[int], inputs: Callable[[], dict],
             limit: int = 0) -> dict:
    """One micro batch as a training collator hands it: `data.batch_size` copies of a sample's input_ids and labels
    (constants: every family's forward reads input_ids), then the family's other inputs, which `inputs()` makes
    once the limit is raised (a constant made with constant_tensor stays constant only within it). The limit is
    the batch's token count, or `limit` where the forward reads a larger constant, held as long as the batch
    lives (its input_ids)."""
    b = data.batch_size
    release = hold_constant_limit(max(b * data.lm_max_length, limit))
    batch = {"input_ids": constant_tensor([input_ids] * b, device), "labels": constant_tensor([labels] * b, device),
             **inputs()}
    release_with(batch["input_ids"], release)
    return batch
