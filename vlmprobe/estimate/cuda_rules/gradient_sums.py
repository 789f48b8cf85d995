"""Where the autograd engine sums two gradients of one tensor, CUDA adds in place; under a dispatch mode it never does.

The engine sums two gradients of one tensor (a residual stream, a tied embedding) in the consumer's input buffer
(torch/csrc/autograd/input_buffer.cpp, `accumulate`): into the first, `old_var.add_(var)`, when that one is "vanilla"
(`!isTensorSubclassLike`), non-overlapping and dense and the buffer holds the last reference to it and its storage;
else `old_var + var`, a new tensor. Under any Python dispatch mode every tensor is subclass-like, so under the tracker
every sum would be a new block where a real CUDA run allocates none. `first_summand` recognises the engine's sum and
returns `old_var` where CUDA would add into it, and the tracker hands old_var's block to the sum; the last-reference
test is made on this process's reference counts. The details, and what the extra blocks cost: docs/estimate.md.
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
