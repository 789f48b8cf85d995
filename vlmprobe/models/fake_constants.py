"""Inputs whose values a forward reads, made so that fake tensors can answer those reads.

Several VLM forwards read values of their inputs (Qwen's image_grid_thw.tolist() and cu_seqlens split
sizes, the image-token count check of get_placeholder_mask in Qwen, LLaVA, Gemma 3 and InternVL, Idefics3's
search for all-zero padding images in pixel_values and its pixel mask). FakeTensorMode (the estimate backend
runs batch() and loss() inside it) can answer those only for *constant* fake tensors (fakes that keep their
real values), and it propagates constants only through ops whose outputs have at most CONSTANT_NUMEL_LIMIT
(= 1) elements. A family's batch() therefore raises that limit to the largest such input (the batch's token
count; Idefics3's pixel_values) for as long as the batch lives (`hold_constant_limit`) and makes those inputs
with `constant_tensor` -- torch.tensor of Python data or a numpy array, which under the mode gives constant
fakes and on real backends ordinary tensors -- so every tensor derived from them alone in the forward (and in
checkpointed recomputation) stays constant and the model runs unchanged. Constants are only these inputs,
what is derived from them (masks, counts, cu_seqlens, Idefics3's unpadded pixel_values) and Python scalars;
every activation derives from parameters, non-constant fakes, so no activation is computed for real. A
constant is still charged by the tracker at its size, as CUDA would allocate it.

Private torch API used: `torch._subclasses.fake_tensor.CONSTANT_NUMEL_LIMIT` (module global read by
FakeTensorMode.may_turn_const at each op; present with the same meaning in torch 2.11-2.13), raised only
while a batch made here is alive and restored when the last one dies. Nothing else private, no
transformers patching.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable

import torch

__all__ = ["collated", "constant_tensor"]

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
