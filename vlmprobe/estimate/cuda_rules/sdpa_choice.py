"""Which SDPA kernel CUDA would run, and the math kernel on the CPU where CUDA would fall back to it.

torch's CPU SDPA is a flash kernel that takes every input and keeps O(L) state for backward; on CUDA the flash and
memory-efficient kernels refuse some inputs and SDPA falls back to the math kernel, which keeps the (B, H, L, L)
attention weights: the estimate must do the same. The rules are torch's CUDA kernel selection (sdp_utils.cpp, torch
2.11-2.13) for dense 4-d inputs, in the dtype the kernel sees (under autocast, the autocast dtype), with a target
card's limits (vlmprobe.gpu.device_profile); without a card, an sm80+ card's with flash first. Where CUDA raises
instead of falling back, so does the estimate. A memory-efficient mask not aligned to 8 elements is copied, padded,
as CUDA does (attention.cpp pad_bias; `aligned_bias`). cuDNN, first on sm90 and sm100, keeps what flash keeps; its
own buffers are vlmprobe.estimate.cuda_rules.attention_scratch's. Not modelled: dropout masks, and head_dim above 224
with dropout on sm86/89. The rules one by one: docs/estimate.md.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from vlmprobe.estimate.cuda_rules import attention_scratch
from vlmprobe.gpu.device_profile import DeviceProfile

__all__ = ["cuda_kernel", "cuda_sdpa_choice", "cudnn_runs"]

LOW_PRECISION = (torch.float16, torch.bfloat16)


def cuda_kernel(dtype: torch.dtype, head_dim: int, has_mask: bool, grouped: bool,
                device: DeviceProfile | None = None, requires_grad: bool = True) -> str:
    """'flash', 'efficient' or 'math': what CUDA's SDPA would run for these inputs on `device` (None: an sm80+
    card with both fused kernels). `requires_grad`: whether autograd will need the attention's backward."""
    low = dtype in LOW_PRECISION
    if low and not has_mask and head_dim <= 256 and head_dim % 8 == 0 and flash_runs(device, head_dim, requires_grad):
        return "flash"
    if not grouped and head_dim % efficient_alignment(device, low) == 0 and efficient_runs(device, dtype):
        return "efficient"
    return "math"


def flash_runs(device: DeviceProfile | None, head_dim: int, requires_grad: bool) -> bool:
    """The card runs flash attention for this head dim (check_flash_attention_hardware_support, and
    check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120: flash's backward there has no kernel
    for head dims in (192, 224])."""
    if device is None:
        return True
    if not device.sdpa["flash"]:
        return False
    consumer = (8, 6) <= device.compute_capability <= (8, 9) or (12, 0) <= device.compute_capability <= (12, 1)
    return not (requires_grad and consumer and 192 < head_dim <= 224)


def efficient_runs(device: DeviceProfile | None, dtype: torch.dtype) -> bool:
    """The card runs memory-efficient attention in this dtype (check_mem_efficient_hardware_support; its
    dtypes are fp16 and fp32 below sm80, bf16 too from sm80)."""
    if device is None:
        return True
    return device.sdpa["efficient"] and (dtype != torch.bfloat16 or device.compute_capability >= (8, 0))


def efficient_alignment(device: DeviceProfile | None, low_precision: bool) -> int:
    """The head-dim multiple memory-efficient attention needs (minimum_gemm_alignment): 8 for fp16/bf16 (tensor
    cores), 4 for fp32 from sm80 (TF32 tensor cores), 1 for fp32 below."""
    if low_precision:
        return 8
    return 4 if device is None or device.compute_capability >= (8, 0) else 1


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


MEM_EFF_ALIGNMENT = 8  # attention.cpp preprocess_mask: mem_eff_alignment, in elements


def cudnn_first(device: DeviceProfile | None, dtype: torch.dtype) -> bool:
    """The card tries cuDNN attention before the others (its profile's default: check_prefer_cudnn_attention on
    sm90/sm100) and cuDNN takes this dtype (fp16/bf16 only: check_dtypes_low_precision)."""
    return device is not None and device.sdpa["default"] == "cudnn" and dtype in LOW_PRECISION


def cudnn_runs(device: DeviceProfile | None, dtype: torch.dtype, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, dropout_p: float) -> bool:
    """torch runs cuDNN attention for this call on `device`: the card tries it first (cudnn_first) and cuDNN takes
    the inputs (sdp_utils.cpp, check_cudnn_tensor_shapes: head dims multiples of 8, at most 256 on sm90 with cuDNN
    9.10 or later, 128 elsewhere; a key/value length above 1; a query length of 1 only without dropout)."""
    if not cudnn_first(device, dtype):
        return False
    head_dim_limit = 256 if device.compute_capability == (9, 0) else 128
    d_qk, d_v = query.shape[-1], value.shape[-1]
    if d_qk > head_dim_limit or d_v > head_dim_limit or d_qk % 8 or d_v % 8:
        return False
    return key.shape[-2] != 1 and not (query.shape[-2] == 1 and dropout_p)


def aligned_bias(attn_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The mask CUDA's memory-efficient kernel gets for `attn_mask` (in this order): under autocast a floating mask
    in the autocast dtype (`dtype`; autocast casts SDPA's floating arguments before the kernel sees them, so the
    cast here leaves it nothing to do); a boolean mask as an additive one in that dtype (attention.cpp
    convert_boolean_attn_mask: 0 where True, -inf elsewhere); then, unless every stride but the last is a multiple
    of 8 elements and the last is 1 (aligned_tensor), its last dimension padded by 8 - size % 8 (pad_bias: by 8
    where the size is already a multiple, as CUDA does) into a new tensor and sliced back to its size. The slice
    keeps the padded copy alive for as long as the kernel keeps the mask."""
    if attn_mask.is_floating_point() and attn_mask.dtype != dtype and torch.is_autocast_enabled(attn_mask.device.type):
        attn_mask = attn_mask.to(dtype)
    if attn_mask.dtype == torch.bool:
        attn_mask = torch.where(attn_mask, 0.0, torch.tensor(float("-inf"), dtype=dtype, device=attn_mask.device))
    strides = attn_mask.stride()
    if all(s % MEM_EFF_ALIGNMENT == 0 for s in strides[:-1]) and strides[-1] == 1:
        return attn_mask
    size = attn_mask.shape[-1]
    padded = F.pad(attn_mask, (0, MEM_EFF_ALIGNMENT - size % MEM_EFF_ALIGNMENT))
    return padded[..., :size]


def autocast_casts(tensors, dtype: torch.dtype) -> tuple:
    """SDPA's inputs as autocast hands them to the kernel, cast here so that the casts come before the kernel's own
    allocations (vlmprobe.estimate.cuda_rules.attention_scratch), as on CUDA. A leaf that requires grad is left to autocast
    itself, inside the call, while it caches casts: its cast is then the one cached for the whole autocast region."""
    if not torch.is_autocast_enabled(tensors[0].device.type):
        return tuple(tensors)
    cached = torch.is_autocast_cache_enabled()
    return tuple(t if not t.is_floating_point() or (cached and t.is_leaf and t.requires_grad) else t.to(dtype)
                 for t in tensors)


@contextlib.contextmanager
def cuda_sdpa_choice(device: DeviceProfile | None = None):
    """While active, F.scaled_dot_product_attention runs torch's math kernel where CUDA would on `device`."""
    original = F.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        dtype = query.dtype
        if torch.is_autocast_enabled(query.device.type) and dtype.is_floating_point:
            dtype = torch.get_autocast_dtype(query.device.type)
        grouped = enable_gqa and query.shape[-3] != key.shape[-3]
        # sdp_utils' input_requires_grad: grad mode on and any of q, k, v requiring grad
        requires_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        kernel = cuda_kernel(dtype, query.shape[-1], attn_mask is not None, grouped, device, requires_grad)
        refuse_bias_dtype(kernel, dtype, attn_mask)
        if kernel == "efficient" and attn_mask is not None and not cudnn_first(device, dtype):
            attn_mask = aligned_bias(attn_mask, dtype)
        if kernel != "math":
            kwargs = dict(attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                          enable_gqa=enable_gqa)
            if cudnn_runs(device, dtype, query, key, value, dropout_p):
                scratch = attention_scratch.cudnn
            elif kernel == "flash":
                scratch = attention_scratch.flash
            else:
                return original(query, key, value, **kwargs)
            return scratch(original, *autocast_casts((query, key, value), dtype), **kwargs)
        # autocast casts SDPA's inputs (lower_precision_fp list) but not the math kernel's: cast as it would
        query, key, value = (t.to(dtype) for t in (query, key, value))
        return torch.ops.aten._scaled_dot_product_attention_math(
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)[0]

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original
