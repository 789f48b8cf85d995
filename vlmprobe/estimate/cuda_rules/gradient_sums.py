"""Where the autograd engine sums two gradients of one tensor, CUDA adds in place; under a dispatch mode it never does.

A tensor used twice in the forward (a residual stream, a tied embedding, q/k/v read from one input) gets two
gradients in the backward. The engine sums them in the consumer's input buffer (torch/csrc/autograd/input_buffer.cpp,
`accumulate`): with grad mode off it writes the sum into the first one, `old_var.add_(var)`, when that one is
"vanilla" (`!isTensorSubclassLike`), non-overlapping and dense, and the buffer holds the last reference to it and to its
storage; otherwise `old_var + var`, a new tensor. While any Python dispatch mode is on, `isTensorSubclassLike` is true
for every tensor, so under the tracker the engine always takes the second way: one new gradient-sized block per sum,
where a real CUDA run allocates nothing. In a nanoVLM-222M step that was 470 extra transient blocks of the LM's
residual size, and a second 108 MiB block for the tied embedding's gradient; fed to the allocator model they made
segments CUDA never made (the H200 trace at batch 1, length 512: 116 MiB more reserved, +2.4%).

`first_summand` recognises the engine's sum (an `aten.add.Tensor` of two tensors dispatched straight from
`_engine_run_backward` while a node runs and grad mode is off; a backward formula written in Python has frames of its
own) and returns `old_var` when CUDA would add into it; the tracker then hands old_var's block to the sum instead of
allocating one. The last-reference test is made on the counts this process sees: old_var's tensor and storage
reference counts against var's, which reaches the sum the same way (moved out of the node's outputs), so a summand
also held elsewhere (the same gradient sent to two inputs by an add's backward, a view whose base lives) counts more
than var and is summed out of place, as on CUDA.
"""

from __future__ import annotations

import sys

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false

__all__ = ["first_summand"]

_ADD = torch.ops.aten.add.Tensor
_ENGINE_ENTRY = "_engine_run_backward"  # torch/autograd/graph.py: backward() and autograd.grad() run the engine here


def _storage_references(tensor: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


def first_summand(func, args, kwargs) -> torch.Tensor | None:
    """old_var of the engine's `old_var + var` when CUDA would add var into it in place, else None. Called from a
    dispatch mode's __torch_dispatch__: the frame two up is the one that dispatched the op (the engine's entry for an
    op the engine runs from C++)."""
    if func is not _ADD or kwargs or len(args) != 2 or torch.is_grad_enabled():
        return None
    caller = sys._getframe(2)
    if caller is None or caller.f_code.co_name != _ENGINE_ENTRY or torch._C._current_autograd_node() is None:
        return None
    old, new = args
    if not isinstance(new, torch.Tensor) or old.shape != new.shape or old.dtype != new.dtype:
        return None
    if not is_non_overlapping_and_dense_or_false(old) or old.untyped_storage() is new.untyped_storage():
        return None
    if old._use_count() > new._use_count() or _storage_references(old) > _storage_references(new):
        return None
    return old
