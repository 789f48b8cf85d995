"""The index and partial-sum buffers CUDA's embedding backward makes when it sorts the token ids.

`embedding_dense_backward` on CUDA (aten/src/ATen/native/cuda/Embedding.cu) takes one of two paths. Up to 3072 ids
(and without scale_grad_by_freq) one kernel adds each row of the gradient into the weight's gradient: nothing but that
gradient is allocated. Above, it sorts the ids and sums each id's rows in parallel (EmbeddingBackwardKernel.cu,
embedding_backward_cuda_kernel), through buffers sized from the shapes alone (the sync-free form: as many segments as
min(ids, vocabulary) may need):
- before the weight's gradient: the sorted ids and their original positions (one index each), and the positions
  0..n-1 the sort pairs with the ids, dropped after the sort;
- after it: each segment's offset (one index an id), the segment count (one int64), a scratch index an id for
  cub's unique-by-key (dropped at once), the partials per segment and their offsets (one index a segment), the
  partial-segment count (one int64), each partial segment's offset (one index a partial segment: n / 10 + segments,
  10 rows a thread), and each partial segment's sum of a row (fp32 for fp16 / bf16 gradients), dropped after its
  kernels; the rest when the op returns, last made first.
The H200 run of nanoVLM-222M at batch 8, length 512 (4096 ids, 576 features; results/gpu_check/nvidia-h200/
20261128-163858/allocator_requests.csv) made each of these, of these sizes and in this order, twice; its batch 1
(512 ids) none. Not modelled: cub's own temporary storage for the sort, the unique-by-key and the scan (83,455 and
1,279 B there: sized by cub's tuning for the element count), a non-contiguous ids or gradient copied first,
scale_grad_by_freq (its counts).
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
