"""The index and partial-sum buffers CUDA's embedding backward makes when it sorts the token ids.

`embedding_dense_backward` on CUDA (aten/src/ATen/native/cuda/Embedding.cu) adds each row of the gradient into the
weight's gradient up to 3072 ids (and without scale_grad_by_freq), allocating nothing else. Above, it sorts the ids
and sums each id's rows in parallel (EmbeddingBackwardKernel.cu, embedding_backward_cuda_kernel) through index and
fp32 partial-sum buffers sized from the shapes alone (the sync-free form), some made before the weight's gradient and
the rest after it: this module makes them in that order and of those sizes. Not modelled: cub's own temporary
storage, a non-contiguous ids or gradient copied first, scale_grad_by_freq (its counts). Each buffer, and the H200
run they were checked against: docs/estimate.md.
"""

from __future__ import annotations

import torch

__all__ = ["scratch"]

_EMBEDDING_DENSE_BACKWARD = torch.ops.aten.embedding_dense_backward.default
DIRECT_MAX_IDS = 3072  # Embedding.cu: up to this many ids one kernel accumulates straight into the weight's gradient
ROWS_PER_THREAD = 10  # EmbeddingBackwardKernel.cu, NROWS_PER_THREAD: rows of a segment one thread sums
COUNT = 8  # bytes of an int64 count kept on the device


def scratch(func, args) -> tuple[list[tuple[int, bool]], list[tuple[int, bool]]]:
    """(before, after): the blocks CUDA's embedding backward allocates before its output and after it, each as
    (bytes, dropped at once); the others live until the op returns. Empty for any other op or the direct path."""
    if func is not _EMBEDDING_DENSE_BACKWARD:
        return [], []
    grad, ids, num_weights = args[0], args[1], args[2]
    scale_grad_by_freq = args[4] if len(args) > 4 else False
    n = ids.numel()
    if n <= DIRECT_MAX_IDS or scale_grad_by_freq:
        return [], []
    index = ids.element_size()
    segments = min(n, num_weights)
    partial_segments = n // ROWS_PER_THREAD + segments
    accumulate = 4 if grad.dtype in (torch.float16, torch.bfloat16) else grad.element_size()
    before = [(n * index, False), (n * index, False), (n * index, True)]  # sorted, original positions, 0..n-1
    after = [(n * index, False), (COUNT, False), (n * index, True),  # segment offsets, their count, unique's scratch
             (segments * index, False), (segments * index, False), (COUNT, False),  # partials per segment, offsets
             (partial_segments * index, False),  # partial-segment offsets
             (partial_segments * grad.shape[-1] * accumulate, True)]  # the partial sums
    return before, after
