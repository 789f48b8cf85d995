"""Contiguous copies CUDA kernels make of their inputs inside an op, which a fake (meta) kernel never makes.

A kernel that needs its input laid out row by row calls `input.expect_contiguous()` (or `.contiguous()`): a
non-contiguous input is copied into a new block for the duration of the op, allocated before its outputs (or, for
the ops of the second table, after them) and freed when it returns. The tracker sees only what an op returns, so it
charges these copies from the tables below (the op's inputs each kernel copies, by argument position), in that
order: copies, outputs, then the copies freed. The ops, from torch's CUDA sources: native_layer_norm and its backward
(layer_norm_kernel.cu), convolution_backward through cuDNN (ConvShared.cpp), max() and min() of a whole tensor
(ReduceAllOps.cpp), and advanced indexing with index tensors whose broadcast strides differ
(TensorAdvancedIndexing.cpp). Where a model meets each, and the H200 trace that holds them: docs/estimate.md.
"""

from __future__ import annotations

import math

import torch
from torch._prims_common import make_contiguous_strides_for

__all__ = ["copies"]

# op -> argument positions of the tensors its CUDA kernel makes contiguous
_CONTIGUOUS_INPUTS = {
    torch.ops.aten.native_layer_norm.default: (0, 2, 3),  # input, weight, bias
    torch.ops.aten.native_layer_norm_backward.default: (1, 5, 6),  # input, weight, bias (grad_out is taken as it is)
    torch.ops.aten.convolution_backward.default: (0,),  # grad_output
}


# op -> argument positions of the tensors its kernel makes contiguous after allocating its output
_CONTIGUOUS_AFTER_OUTPUT = {
    torch.ops.aten.max.default: (0,),
    torch.ops.aten.min.default: (0,),
}


# advanced indexing ops -> whether their index copies come after the op's output
_INDEXING = {
    torch.ops.aten.index.Tensor: False,
    torch.ops.aten.index_put_.default: False,
    torch.ops.aten._index_put_impl_.default: False,
    torch.ops.aten.index_put.default: True,
}


def copies(func, args) -> tuple[list[int], list[int]]:
    """Bytes of each contiguous copy the CUDA kernel of `func` makes of `args`, in the order it makes them: (before its
    outputs, after them)."""
    after_output = _INDEXING.get(func)
    if after_output is not None:
        found = _index_copies(args[1])
        return ([], found) if after_output else (found, [])
    return _copies(_CONTIGUOUS_INPUTS.get(func), args), _copies(_CONTIGUOUS_AFTER_OUTPUT.get(func), args)


def _index_copies(indices) -> list[int]:
    """AdvancedIndex on CUDA: the index tensors broadcast to one shape; where their strides there do not all match,
    each one not contiguous in that shape is copied. Integer indices only (a boolean mask goes through nonzero)."""
    tensors = [t for t in indices if t is not None]
    if len(tensors) < 2 or any(t.dtype in (torch.bool, torch.uint8) for t in tensors):
        return []
    shape = torch.broadcast_shapes(*(t.shape for t in tensors))
    strides = [_broadcast_strides(t, shape) for t in tensors]
    if all(s == strides[0] for s in strides):
        return []
    contiguous = make_contiguous_strides_for(shape)
    return [math.prod(shape) * t.element_size() for t, s in zip(tensors, strides)
            if any(n > 1 and a != b for n, a, b in zip(shape, s, contiguous))]


def _broadcast_strides(tensor: torch.Tensor, shape) -> tuple[int, ...]:
    """The strides of `tensor.expand(shape)`: 0 along the dimensions it is broadcast over."""
    lead = len(shape) - tensor.dim()
    return tuple(0 if d < lead or tensor.shape[d - lead] == 1 < shape[d] else tensor.stride(d - lead)
                 for d in range(len(shape)))


def _copies(positions, args) -> list[int]:
    found = []
    for position in positions or ():
        tensor = args[position] if position < len(args) else None
        if isinstance(tensor, torch.Tensor) and not tensor.is_contiguous():
            found.append(tensor.numel() * tensor.element_size())
    return found
