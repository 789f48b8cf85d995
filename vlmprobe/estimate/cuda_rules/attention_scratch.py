"""What CUDA's fused attention kernels allocate for themselves, beside what they keep for backward.

The estimate runs torch's CPU flash kernel wherever CUDA would run a fused one
(vlmprobe.estimate.cuda_rules.sdpa_choice), and a fake kernel allocates nothing inside the op; this module makes,
around that kernel, the blocks CUDA's own kernels make. cuDNN attention (where sdpa_choice.cudnn_runs: first on sm90
and sm100): a random seed and offset and the forward's workspace (MHA.cpp, run_cudnn_SDP_fprop), and the backward's
workspace with its fp32 dQ accumulator; the workspace sizes are a recorded H200 run's (torch 2.11, cuDNN 9.19), not
derived from a source. Flash attention (sm80-sm89, and any card without a profile): its backward's `softmax_d` and
fp32 `dq_accum`, and with grouped KV heads dK and dV for every query head (torch's flash_api.cpp, mha_bwd). Not
modelled: memory-efficient attention's backward workspace, `deterministic` flash, newer cuDNN frontends' dK/dV
buffers for grouped KV heads. The details: docs/estimate.md.
"""

from __future__ import annotations

import math

import torch

__all__ = ["cudnn", "cudnn_backward_workspace", "CUDNN_FORWARD_WORKSPACE", "flash", "flash_backward_scratch",
           "flash_backward_shapes", "round_up"]

CUDNN_FORWARD_WORKSPACE = 256  # bytes cuDNN's forward graph asked for in the recorded run
CUDNN_ENGINE_EXTRA = 256  # bytes cuDNN's backward engine asked for beyond one fp32 a query row, in the recorded run


def cudnn_backward_workspace(query: torch.Tensor) -> int:
    """Bytes of cuDNN's backward workspace for a (batch, heads, length, head dim) query."""
    batch, heads, length, head_dim = query.shape
    rows = batch * heads * length
    return 4 * rows * head_dim + 4 * rows + CUDNN_ENGINE_EXTRA  # dQ in fp32, then the engine's part


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def flash_backward_shapes(batch: int, length: int, heads: int, head_dim: int,
                          head_multiple: int = 32) -> tuple[tuple, tuple]:
    """(softmax_d, dq_accum) shapes, both fp32, of FlashAttention 2's mha_bwd for a dense (batch, length, heads,
    head_dim) query: the length rounded up to 128, the head dim to `head_multiple` (torch's bundled copy: 32;
    flash-attn 2.8: 64 above 128, vlmprobe.estimate.cuda_rules.flash_attn_standin)."""
    length_rounded = round_up(length, 128)
    return (batch, heads, length_rounded), (batch, length_rounded, heads, round_up(head_dim, head_multiple))


def flash_backward_scratch(query: torch.Tensor, key: torch.Tensor) -> tuple[int, int, int]:
    """Bytes of flash's backward softmax_d, dq_accum, and of each expanded dK / dV (0 without grouped KV heads), for
    (batch, heads, length, head dim) query and key."""
    batch, heads, length, head_dim = query.shape
    softmax_d, dq_accum = (4 * math.prod(shape) for shape in flash_backward_shapes(batch, length, heads, head_dim))
    expanded = 0 if key.shape[-3] == heads else batch * key.shape[-2] * heads * head_dim * key.element_size()
    return softmax_d, dq_accum, expanded


def _block(nbytes: int, device) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _after_backward(out: torch.Tensor, hook) -> None:
    """Run `hook()` once the backward node of `out` has made its gradients, before the engine releases what the node
    saved (a post hook: the engine calls it before release_variables)."""
    if out.grad_fn is not None:
        out.grad_fn.register_hook(lambda grad_inputs, grad_outputs: hook())


def cudnn(attention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs) -> torch.Tensor:
    """`attention(query, key, value, **kwargs)` with cuDNN's own allocations around it: the seed and offset before,
    the forward workspace after, the backward workspace once dQ, dK and dV exist, and the seed and offset let go with
    the node's saved tensors. `query`, `key` and `value` are the kernel's inputs, already in its dtype."""
    device = query.device
    saved = [torch.zeros(1, dtype=torch.int64, device=device) for _ in ("seed", "offset")]
    out = attention(query, key, value, **kwargs)
    _block(CUDNN_FORWARD_WORKSPACE, device)  # made after the output, dropped at once
    size = cudnn_backward_workspace(query)

    def backward():
        _block(size, device)  # made after dQ, dK and dV, dropped at once
        # then the seed and offset: CUDA frees them with the node's other saved tensors, just after these here (the
        # order differs among 512 B blocks only)
        saved.clear()

    _after_backward(out, backward)
    return out  # without a backward the seed and offset die here


def flash(attention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs) -> torch.Tensor:
    """`attention(query, key, value, **kwargs)` with flash's backward scratch made once dQ, dK and dV exist: softmax_d,
    dq_accum and, with grouped KV heads, the expanded dK and dV, freed in the reverse order (C++ locals), softmax_d
    last. `query`, `key` and `value` are the kernel's inputs, already in its dtype."""
    out = attention(query, key, value, **kwargs)
    softmax_d, dq_accum, expanded = flash_backward_scratch(query, key)
    device = query.device

    def backward():
        blocks = [_block(softmax_d, device), _block(dq_accum, device)]
        if expanded:
            blocks += [_block(expanded, device), _block(expanded, device)]
        while blocks:
            blocks.pop()

    _after_backward(out, backward)
    return out
