"""CUDA's SDPA kernel choice, applied on the CPU: the math kernel (which keeps the attention weights) where
CUDA would fall back to it, the CPU flash kernel (O(L) state, like CUDA's flash/efficient) elsewhere."""

import pytest
import torch
import torch.nn.functional as F

from vlmprobe import backends
from vlmprobe.estimate.cuda_rules.sdpa_choice import cuda_kernel


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
    from vlmprobe.estimate.cuda_rules.sdpa_choice import cuda_sdpa_choice

    q = torch.zeros(1, 2, 16, 8, dtype=torch.bfloat16)
    with cuda_sdpa_choice():
        with pytest.raises(RuntimeError, match="invalid dtype for bias - should match query's dtype"):
            F.scaled_dot_product_attention(q, q, q, attn_mask=torch.zeros(1, 1, 1, 16))  # fp32 mask
        F.scaled_dot_product_attention(q, q, q, attn_mask=torch.zeros(1, 1, 1, 16, dtype=torch.bfloat16))
        F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(1, 1, 1, 16, dtype=torch.bool))
        with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast casts q and the mask alike
            F.scaled_dot_product_attention(q.float(), q.float(), q.float(), attn_mask=torch.zeros(1, 1, 1, 16))


# ---- the target card's kernels (device=): sdp_utils.cpp's hardware and dtype checks ----

def card(key):
    from vlmprobe.gpu import device_profile

    return device_profile.load(key)


@pytest.mark.parametrize("dtype,head_dim,mask,grouped,kernel", [
    (torch.float16, 64, False, False, "efficient"),  # no flash below sm80
    (torch.float16, 64, False, True, "math"),  # ... and memory-efficient takes no grouped KV heads
    (torch.float16, 64, True, False, "efficient"),
    (torch.float32, 64, False, True, "math"),
    (torch.float32, 6, False, False, "efficient"),  # fp32 head dims need no alignment without TF32 tensor cores
    (torch.bfloat16, 64, False, False, "math"),  # memory-efficient takes bf16 only from sm80 (bf16 is refused anyway)
])
@pytest.mark.parametrize("key", ["v100_32gb", "t4"])  # sm70 and sm75: no flash, memory-efficient without bf16
def test_a_v100_runs_no_flash_so_fp16_grouped_attention_falls_back_to_math(key, dtype, head_dim, mask, grouped, kernel):
    assert cuda_kernel(dtype, head_dim, mask, grouped, card(key)) == kernel


@pytest.mark.parametrize("key", ["a100_40gb", "a100_80gb", "h100_80gb", "h20", "h200", "rtx3090", "rtx4090", "l40s",
                                 "a10g", "l4", "rtx_a6000", "rtx5090", "b200"])
@pytest.mark.parametrize("dtype,head_dim,mask,grouped", [
    (torch.bfloat16, 64, False, False), (torch.bfloat16, 64, False, True), (torch.bfloat16, 64, True, False),
    (torch.float32, 64, False, False), (torch.float32, 64, False, True), (torch.float16, 128, True, True),
    (torch.float32, 6, False, False), (torch.bfloat16, 320, False, False),
])
def test_an_sm80_or_later_card_chooses_as_the_rules_without_a_card_do(key, dtype, head_dim, mask, grouped):
    assert cuda_kernel(dtype, head_dim, mask, grouped, card(key)) == cuda_kernel(dtype, head_dim, mask, grouped)


@pytest.mark.parametrize("key,head_dim,requires_grad,kernel", [
    ("rtx3090", 200, True, "efficient"),  # sm86: flash's backward has no kernel for head dims in (192, 224]
    ("rtx4090", 224, True, "efficient"),  # sm89 alike
    ("rtx3090", 200, False, "flash"),  # no backward: flash runs
    ("rtx3090", 232, True, "flash"),  # above 224 (without dropout) flash trains
    ("a100_80gb", 200, True, "flash"),  # sm80 trains any head dim up to 256
    ("rtx5090", 200, True, "efficient"),  # sm120 as sm86/89
    ("a10g", 224, True, "efficient"),
    ("b200", 200, True, "flash"),  # sm100 has no such limit
])
def test_consumer_ampere_and_ada_train_no_flash_with_head_dims_above_192_up_to_224(key, head_dim, requires_grad, kernel):
    assert cuda_kernel(torch.bfloat16, head_dim, False, False, card(key), requires_grad) == kernel


def test_on_a_v100_fp16_grouped_attention_keeps_the_attention_weights_that_an_a100_does_not():
    estimate = backends.get("estimate")

    def saved(device):
        with estimate.session(None, device=device) as meter:
            q = torch.empty(2, 8, 128, 64, dtype=torch.float16, requires_grad=True)
            kv = torch.empty(2, 2, 128, 64, dtype=torch.float16, requires_grad=True)
            before = meter.current()
            out = F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)  # kept: autograd needs it
            return meter.current() - before, out.shape

    weights = 2 * 8 * 128 * 128 * 2  # B x H x L x L in fp16
    # flash on the A100: the fp16 output (2 x 8 x 128 x 64 x 2 = 262,144 B) and the fp32 logsumexp (8,192 B)
    assert saved(card("a100_80gb")) == saved(None) == (262_144 + 8_192, (2, 8, 128, 64))
    assert saved(card("v100_32gb"))[0] >= weights  # math on the V100: the softmax output is saved for backward


def masked_attention_bytes(device, side, layers=1, mask_dtype=torch.bfloat16):
    """Bytes `layers` masked bf16 attention calls over one (1, 1, side, side) mask leave live for backward
    under the estimate, the mask itself not counted."""
    estimate = backends.get("estimate")
    with estimate.session(None, device=device) as meter:
        mask = torch.zeros(1, 1, side, side, dtype=mask_dtype)
        x = torch.empty(1, 2, side, 64, dtype=torch.bfloat16, requires_grad=True)
        before = meter.current()
        outs = [F.scaled_dot_product_attention(x, x, x, attn_mask=mask) for _ in range(layers)]
        return meter.current() - before, [o.shape for o in outs]


def block(n):
    return -(-n // 512) * 512  # the caching allocator's 512 B rounding


@pytest.mark.parametrize("side", [100, 12])
def test_a_mask_whose_rows_are_not_a_multiple_of_8_is_copied_padded_once_per_memory_efficient_call(side):
    # one layer without a mask copy: the bf16 output (1 x 2 x side x 64 x 2 B) and the fp32 logsumexp
    plain = block(2 * side * 64 * 2) + block(2 * side * 4)
    # attention.cpp pad_bias: rows padded to the next multiple of 8 (100 -> 104, 12 -> 16), a bf16 copy per call
    padded = block(side * (side + 8 - side % 8) * 2)
    for layers in (1, 3):
        kept, _ = masked_attention_bytes(None, side, layers)
        assert kept == layers * (plain + padded)
        # a card that puts cuDNN first (sm90) hands the mask to cuDNN as it is: no copy; cuDNN keeps its seed and
        # offset for backward instead (an int64 each, a 512 B block each: vlmprobe.estimate.cuda_rules.attention_scratch)
        assert masked_attention_bytes(card("h100_80gb"), side, layers)[0] == layers * (plain + 2 * 512)


def test_an_aligned_mask_is_shared_by_every_call_and_a_boolean_one_is_made_additive_first():
    kept, _ = masked_attention_bytes(None, 96, layers=2)
    assert kept == 2 * (block(2 * 96 * 64 * 2) + block(2 * 96 * 4))  # 96 % 8 == 0: nothing copied
    # a boolean mask of 12 x 12: its additive bf16 form (and CUDA's -inf scalar), then that form padded to 16
    kept, _ = masked_attention_bytes(None, 12, layers=1, mask_dtype=torch.bool)
    plain = block(2 * 12 * 64 * 2) + block(2 * 12 * 4)
    assert kept == plain + block(12 * 16 * 2)
