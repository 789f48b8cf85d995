"""CUDA's SDPA kernel choice, applied on the CPU: the math kernel (which keeps the attention weights) where
CUDA would fall back to it, the CPU flash kernel (O(L) state, like CUDA's flash/efficient) elsewhere."""

import pytest
import torch
import torch.nn.functional as F

from vlmprobe import backends
from vlmprobe.sdpa_choice import cuda_kernel


@pytest.mark.parametrize("dtype,head_dim,mask,grouped,kernel", [
    (torch.bfloat16, 64, False, False, "flash"),
    (torch.bfloat16, 64, False, True, "flash"),  # flash takes grouped KV heads
    (torch.bfloat16, 64, True, False, "efficient"),  # flash takes no mask
    (torch.float32, 64, False, False, "efficient"),  # flash takes no fp32
    (torch.float32, 64, False, True, "math"),  # efficient takes no grouped KV heads
    (torch.bfloat16, 64, True, True, "math"),
    (torch.bfloat16, 320, False, False, "efficient"),  # flash: head_dim <= 256
])
def test_cuda_kernel_follows_the_documented_constraints(dtype, head_dim, mask, grouped, kernel):
    assert cuda_kernel(dtype, head_dim, mask, grouped) == kernel


def saved_bytes(dtype, autocast):
    """Bytes the attention leaves live for backward, under the estimate backend's session."""
    estimate = backends.get("estimate")
    with estimate.session(None) as meter:
        q = torch.empty(2, 8, 128, 64, dtype=torch.float32 if autocast else dtype, requires_grad=True)
        kv = torch.empty(2, 2, 128, 64, dtype=q.dtype, requires_grad=True)
        before = meter.current()
        context = torch.autocast("cpu", dtype=dtype) if autocast else torch.autocast("cpu", enabled=False)
        with context:
            out = F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
        return meter.current() - before, out.shape


def test_fp32_grouped_attention_keeps_the_attention_weights_as_cuda_math_does():
    weights = 2 * 8 * 128 * 128 * 4  # B x H x L x L in fp32
    fp32, shape = saved_bytes(torch.float32, autocast=False)
    bf16, _ = saved_bytes(torch.bfloat16, autocast=True)
    assert shape == (2, 8, 128, 64)
    assert fp32 >= weights  # math kernel: the softmax output is saved
    # flash under bf16 autocast: bf16 casts of q (262,144 B) and of the shared k/v leaf (65,536 B, cast once),
    # the bf16 output (262,144 B) and the fp32 logsumexp (2 x 8 x 128 x 4 = 8,192 B); nothing L x L
    assert bf16 == 262_144 + 65_536 + 262_144 + 8_192


def test_a_bias_of_another_dtype_than_the_query_is_refused_as_cuda_efficient_attention_refuses_it():
    from vlmprobe.sdpa_choice import cuda_sdpa_choice

    q = torch.zeros(1, 2, 16, 8, dtype=torch.bfloat16)
    with cuda_sdpa_choice():
        with pytest.raises(RuntimeError, match="invalid dtype for bias - should match query's dtype"):
            F.scaled_dot_product_attention(q, q, q, attn_mask=torch.zeros(1, 1, 1, 16))  # fp32 mask
        F.scaled_dot_product_attention(q, q, q, attn_mask=torch.zeros(1, 1, 1, 16, dtype=torch.bfloat16))
        F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(1, 1, 1, 16, dtype=torch.bool))
        with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast casts q and the mask alike
            F.scaled_dot_product_attention(q.float(), q.float(), q.float(), attn_mask=torch.zeros(1, 1, 1, 16))
