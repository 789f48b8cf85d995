"""Contiguous copies CUDA kernels make of their inputs inside an op, which a fake (meta) kernel never makes.

A kernel that needs its input laid out row by row calls `input.expect_contiguous()`: a non-contiguous input is
copied into a new block for the duration of the op, allocated before its outputs and freed when it returns. The
tracker sees only what an op returns, so it charges these copies from the table below (the op's inputs each kernel
copies, by argument position), in that order: copies, outputs, then the copies freed.

- native_layer_norm (aten/src/ATen/native/cuda/layer_norm_kernel.cu, layer_norm_cuda: X, gamma and beta through
  expect_contiguous, then Y, mean and rstd) and native_layer_norm_backward (layer_norm_backward_cuda: X, gamma, beta,
  then dX, dgamma, dbeta). A ViT whose residual stream starts as the patch embedding's `flatten(2).transpose(1, 2)`
  (nanoVLM's, and so every block's `x + attn(ln(x))` after it) feeds every layer norm a transposed input: on an H200
  each of nanoVLM-222M's 50 layer norms a step, forward and backward, copied its 196 x 768 fp32 input (602,112 B),
  in the recorded trace of batch 1 at length 512 (results/gpu_check/nvidia-h200/20261128-163858/allocator).
- convolution_backward through cuDNN (aten/src/ATen/native/cudnn/ConvShared.cpp: grad_output laid out in the input's
  memory format before the dgrad / wgrad calls): the same patch embedding's gradient arrives transposed, and the
  trace holds its copy (196 x 768 bf16, 301,056 B) once a step, allocated before cuDNN's workspace.
"""

from __future__ import annotations

import torch

# op -> argument positions of the tensors its CUDA kernel makes contiguous
_CONTIGUOUS_INPUTS = {
    torch.ops.aten.native_layer_norm.default: (0, 2, 3),  # input, weight, bias
    torch.ops.aten.native_layer_norm_backward.default: (1, 5, 6),  # input, weight, bias (grad_out is taken as it is)
    torch.ops.aten.convolution_backward.default: (0,),  # grad_output
}


def copies(func, args) -> list[int]:
    """Bytes of each contiguous copy the CUDA kernel of `func` makes of `args`, in the order it makes them."""
    positions = _CONTIGUOUS_INPUTS.get(func)
    if positions is None:
        return []
    found = []
    for position in positions:
        tensor = args[position] if position < len(args) else None
        if isinstance(tensor, torch.Tensor) and not tensor.is_contiguous():
            found.append(tensor.numel() * tensor.element_size())
    return found
