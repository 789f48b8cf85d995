"""Which SDPA kernel CUDA would run, and the math kernel on the CPU where CUDA would fall back to it.

torch's CPU SDPA is a flash kernel that takes every input (any dtype, masks, grouped KV heads) and keeps
O(L) state for backward. On CUDA the flash and memory-efficient kernels refuse some inputs and SDPA falls
back to the math kernel, which keeps the (B, H, L, L) attention weights: the estimate must do the same.
The rules, from torch's CUDA kernel selection (sdp_utils.cpp) and the documentation of
scaled_dot_product_attention (torch 2.11-2.13), for the inputs our models give (dense, 4-d, no nesting):
- flash: fp16/bf16 inputs, no attn_mask (is_causal is fine), head_dim <= 256 and a multiple of 8;
  grouped KV heads (enable_gqa) are supported;
- memory-efficient: fp32/fp16/bf16, masks allowed, head_dim a multiple of 8 (4 for fp32); no enable_gqa;
- math: anything else, e.g. fp32 with grouped KV heads (Qwen2-VL trained without autocast).
Where CUDA's chosen kernel raises instead of falling back (a memory-efficient bias whose dtype is not the
query's), the estimate raises the same error.
The dtype that counts is the one the kernel sees: under autocast, the autocast dtype.
Not modelled: cuDNN attention (not preferred by default), per-architecture limits (e.g. large head dims
in backward on consumer GPUs), dropout masks.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

LOW_PRECISION = (torch.float16, torch.bfloat16)


def cuda_kernel(dtype: torch.dtype, head_dim: int, has_mask: bool, grouped: bool) -> str:
    """'flash', 'efficient' or 'math': what CUDA's SDPA would run for these inputs."""
    if dtype in LOW_PRECISION and not has_mask and head_dim <= 256 and head_dim % 8 == 0:
        return "flash"
    if not grouped and head_dim % (8 if dtype in LOW_PRECISION else 4) == 0:
        return "efficient"
    return "math"


def refuse_bias_dtype(kernel: str, dtype: torch.dtype, attn_mask) -> None:
    """Raise as CUDA does where the memory-efficient kernel gets an additive mask (its `bias`) of another
    dtype than the query's: `_efficient_attention_forward` checks it ("invalid dtype for bias - should
    match query's dtype"), while kernel selection does not look at the mask's dtype, so SDPA does not fall
    back. A boolean mask is converted to the query's dtype first; under autocast both are cast to `dtype`."""
    if kernel != "efficient" or attn_mask is None or attn_mask.dtype == torch.bool:
        return
    mask_dtype = attn_mask.dtype
    if torch.is_autocast_enabled(attn_mask.device.type) and mask_dtype.is_floating_point:
        mask_dtype = torch.get_autocast_dtype(attn_mask.device.type)
    if mask_dtype != dtype:
        raise RuntimeError(f"invalid dtype for bias - should match query's dtype (CUDA's memory-efficient SDPA "
                           f"kernel: query {dtype}, attn_mask {attn_mask.dtype})")


@contextlib.contextmanager
def cuda_sdpa_choice():
    """While active, F.scaled_dot_product_attention runs torch's math kernel where CUDA would."""
    original = F.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        dtype = query.dtype
        if torch.is_autocast_enabled(query.device.type) and dtype.is_floating_point:
            dtype = torch.get_autocast_dtype(query.device.type)
        grouped = enable_gqa and query.shape[-3] != key.shape[-3]
        kernel = cuda_kernel(dtype, query.shape[-1], attn_mask is not None, grouped)
        refuse_bias_dtype(kernel, dtype, attn_mask)
        if kernel != "math":
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            scale=scale, enable_gqa=enable_gqa)
        # autocast casts SDPA's inputs (lower_precision_fp list) but not the math kernel's: cast as it would
        query, key, value = (t.to(dtype) for t in (query, key, value))
        return torch.ops.aten._scaled_dot_product_attention_math(
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)[0]

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original
