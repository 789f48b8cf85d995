"""FlashAttention 2 on the estimate backend: flash-attn's Python entry points, allocating what its CUDA code does.

With `model.attn_implementation=flash_attention_2` transformers' own flash path runs unchanged (its transposes, its
dtype cast, its varlen / packed-sequence decisions, the vision towers' one varlen call over `cu_seqlens`); only the
kernel behind it is this module, written from flash-attn 2.8's `flash_attn/flash_attn_interface.py` (the autograd
functions) and `csrc/flash_attn/flash_api.cpp` (`mha_fwd`, `mha_varlen_fwd`, `mha_bwd`, `mha_varlen_bwd`): the same
tensors, of the same shapes and dtypes, made and freed in the same order. Values are never computed. Not modelled:
the split-KV accumulators for short queries, `deterministic=True` (refused), dropout's returned probabilities. What
each call allocates: docs/estimate.md.
"""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.nn.functional as F

from vlmprobe.estimate.cuda_rules.attention_scratch import flash_backward_shapes, round_up

__all__ = ["flash_attention_standin", "flash_attn_func", "flash_attn_varlen_func"]

IMPLEMENTATION = "flash_attention_2"


def _contiguous_last(x: torch.Tensor) -> torch.Tensor:
    """flash-attn's maybe_contiguous: the kernel needs a unit stride in the last dimension only."""
    return x.contiguous() if x.stride(-1) != 1 else x


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, deterministic: bool) -> None:
    # flash_api.cpp's own checks, with its messages: a real run fails here too.
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise RuntimeError("query and key must have the same dtype")
    if q.shape[-1] > 256:
        raise RuntimeError("FlashAttention forward only supports head dimension at most 256")
    if deterministic:
        # refused like the kernel's own checks: its dq accumulator has one split per SM, a count no profile gives
        raise RuntimeError("flash_attention_2 with deterministic=True (FLASH_ATTENTION_DETERMINISTIC=1) is not "
                           "modelled by the estimate: its dq accumulator has one split per SM")


def _pad_head(x: torch.Tensor, head_size: int) -> torch.Tensor:
    return F.pad(x, [0, 8 - head_size % 8]) if head_size % 8 else x


def _forward(q, k, v, lse_shape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mha_fwd / mha_varlen_fwd: (out, softmax_lse, rng_state); the contiguous copies die at return."""
    q, k, v = (_contiguous_last(x) for x in (q, k, v))
    out = torch.empty_like(q)
    softmax_lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
    rng_state = torch.empty(2, dtype=torch.int64, device=q.device)
    return out, softmax_lse, rng_state


def _backward(dout, q, k, v, out, softmax_d_shape, dq_accum_shape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The autograd function's backward: dq, dk, dv, then mha_bwd / mha_varlen_bwd's temporaries."""
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dout, q, k, v, out = (_contiguous_last(x) for x in (dout, q, k, v, out))
    softmax_d = torch.empty(softmax_d_shape, dtype=torch.float32, device=q.device)
    dq_accum = torch.empty(dq_accum_shape, dtype=torch.float32, device=q.device)
    heads, kv_heads = q.shape[-2], k.shape[-2]
    if kv_heads != heads:  # MQA / GQA: the kernel writes per query head, then sums into dk, dv
        dk_expanded = torch.empty(*k.shape[:-2], heads, k.shape[-1], dtype=k.dtype, device=k.device)
        dv_expanded = torch.empty_like(dk_expanded)
        torch.sum(dk_expanded.reshape(*k.shape[:-1], heads // kv_heads, k.shape[-1]), dim=-2, out=dk)
        torch.sum(dv_expanded.reshape(*v.shape[:-1], heads // kv_heads, v.shape[-1]), dim=-2, out=dv)
        del dv_expanded, dk_expanded  # C++ locals die in reverse order of construction
    del dq_accum, softmax_d
    return dq, dk, dv


class _FlashAttn(torch.autograd.Function):
    """flash-attn's FlashAttnFunc (batch, seqlen, heads, head_size) and FlashAttnVarlenFunc (total, heads,
    head_size), told apart by `cu_seqlens_q`."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, max_seqlen_q, is_grad_enabled):
        is_grad = is_grad_enabled and any(x.requires_grad for x in (q, k, v))
        head_size = q.shape[-1]
        q, k, v = (_pad_head(x, head_size) for x in (q, k, v))
        if cu_seqlens_q is None:
            batch, seqlen, heads = q.shape[:3]
            lse_shape = (batch, heads, seqlen)
        else:
            lse_shape = (q.shape[1], q.shape[0])  # unpadded lse: (heads, total_q)
        out_padded, softmax_lse, rng_state = _forward(q, k, v, lse_shape)
        if is_grad:
            ctx.save_for_backward(q, k, v, out_padded, softmax_lse, rng_state)
            ctx.varlen = None if cu_seqlens_q is None else (cu_seqlens_q.shape[0] - 1, max_seqlen_q)
        return out_padded[..., :head_size]

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, _softmax_lse, _rng_state = ctx.saved_tensors
        head_multiple = 32 if q.shape[-1] <= 128 else 64
        head_size_rounded = round_up(q.shape[-1], head_multiple)
        if ctx.varlen is None:
            batch, seqlen, heads = q.shape[:3]
            softmax_d_shape, dq_accum_shape = flash_backward_shapes(batch, seqlen, heads, q.shape[-1], head_multiple)
        else:
            batch, _ = ctx.varlen
            total, heads = q.shape[:2]
            softmax_d_shape = (heads, total + 128 * batch)
            dq_accum_shape = (total + 128 * batch, heads, head_size_rounded)
        head_size = dout.shape[-1]
        dq, dk, dv = _backward(_pad_head(dout, head_size), q, k, v, out, softmax_d_shape, dq_accum_shape)
        return dq[..., :head_size], dk[..., :head_size], dv[..., :head_size], None, None, None


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash_attn.flash_attn_func's signature (transformers reads it to decide which keywords to pass)."""
    _check(q, k, v, deterministic)
    return _FlashAttn.apply(q, k, v, None, None, torch.is_grad_enabled())


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """flash_attn.flash_attn_varlen_func's signature."""
    _check(q, k, v, deterministic)
    return _FlashAttn.apply(q, k, v, cu_seqlens_q, max_seqlen_q, torch.is_grad_enabled())


@contextlib.contextmanager
def flash_attention_standin():
    """While active, transformers' "flash_attention_2" runs on this module's kernels: models accept it at
    construction (the stand-in is the package and the card transformers looks for) and its flash path
    imports these functions instead of flash_attn's. Where transformers' modeling code is not imported, no
    model here runs it (vlmprobe.models.base.TRANSFORMERS_MODULES), and nothing is patched."""
    fa_utils = sys.modules.get("transformers.modeling_flash_attention_utils")
    modeling = sys.modules.get("transformers.modeling_utils")
    if fa_utils is None or modeling is None:
        yield
        return
    PreTrainedModel = modeling.PreTrainedModel

    original_imports = fa_utils._lazy_imports
    original_check = PreTrainedModel._check_and_adjust_attn_implementation

    def lazy_imports(implementation, *args, **kwargs):
        if implementation == IMPLEMENTATION:
            return flash_attn_func, flash_attn_varlen_func, None, fa_utils._pad_input, fa_utils._unpad_input
        return original_imports(implementation, *args, **kwargs)

    def check_and_adjust(self, attn_implementation, *args, **kwargs):
        if attn_implementation == IMPLEMENTATION:
            return attn_implementation
        return original_check(self, attn_implementation, *args, **kwargs)

    fa_utils._lazy_imports = lazy_imports
    PreTrainedModel._check_and_adjust_attn_implementation = check_and_adjust
    fa_utils._loaded_implementation = None  # transformers caches the functions it imported last: re-import ours
    try:
        yield
    finally:
        fa_utils._lazy_imports = original_imports
        PreTrainedModel._check_and_adjust_attn_implementation = original_check
        fa_utils._loaded_implementation = None
