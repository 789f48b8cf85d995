"""What CUDA's fused attention kernels allocate for themselves (vlmprobe.estimate.cuda_rules.attention_scratch): cuDNN's against
the allocations the H200 run recorded and torch's selection rules, flash's against hand counts of torch's mha_bwd."""

import pytest
import torch
import torch.nn.functional as F

from conftest import h200_requests, requested
from vlmprobe import backends
from vlmprobe.estimate.cuda_rules import attention_scratch
from vlmprobe.estimate.cuda_rules.sdpa_choice import cudnn_runs
from vlmprobe.gpu import device_profile

@pytest.mark.parametrize("batch, heads, length, size, calls", [
    (1, 9, 512, 1_198_336, 30), (1, 12, 196, 611_776, 12),  # the LM's 30 layers, the ViT's 12, at batch 1
    (8, 9, 512, 9_584_896, 30), (8, 12, 196, 4_892_416, 12),  # and at batch 8
])
def test_the_backward_workspace_is_what_the_h200_run_asked_for_each_attention(batch, heads, length, size, calls):
    query = torch.empty(batch, heads, length, 64, dtype=torch.bfloat16)
    assert attention_scratch.cudnn_backward_workspace(query) == size
    assert h200_requests(batch)[size] == 2 * calls  # once a layer, in each of the two steps


def test_the_forward_workspace_seed_and_offset_are_what_the_run_asked_for_each_attention():
    recorded = h200_requests(1)
    assert recorded[attention_scratch.CUDNN_FORWARD_WORKSPACE] >= 2 * 42  # 30 + 12 layers, two steps
    assert recorded[8] >= 2 * 2 * 42  # a seed and an offset each


def card(key):
    return device_profile.load(key)


@pytest.mark.parametrize("key, dtype, head_dim, key_length, expected", [
    ("h200", torch.bfloat16, 64, 512, True),
    ("h200", torch.float16, 256, 512, True),  # sm90 with cuDNN 9.10+: head dims up to 256
    ("h200", torch.bfloat16, 264, 512, False),
    ("h200", torch.bfloat16, 100, 512, False),  # not a multiple of 8
    ("h200", torch.float32, 64, 512, False),  # fp16 / bf16 only
    ("h200", torch.bfloat16, 64, 1, False),  # a key length of 1
    ("h100_80gb", torch.bfloat16, 128, 512, True),
    ("rtx3090", torch.bfloat16, 64, 512, False),  # torch tries flash first there
    ("a100_80gb", torch.bfloat16, 64, 512, False),
    ("b200", torch.bfloat16, 128, 512, True),  # sm100 tries cuDNN first too
    ("b200", torch.bfloat16, 256, 512, False),  # ... with head dims up to 128 only
    ("rtx5090", torch.bfloat16, 64, 512, False),  # sm120 tries flash first
])
def test_cudnn_runs_where_torch_tries_it_first_and_takes_the_inputs(key, dtype, head_dim, key_length, expected):
    q = torch.empty(1, 2, 16, head_dim)
    kv = torch.empty(1, 2, key_length, head_dim)
    assert cudnn_runs(card(key), dtype, q, kv, kv, 0.0) == expected
    assert not cudnn_runs(None, dtype, q, kv, kv, 0.0)


def _allocations(device, events):
    """The allocator model's requests of one bf16 attention (2 x 4 heads x 64 x 64) and its backward, on `device`
    (`events`: the allocator_events fixture)."""
    estimate = backends.get("estimate")
    with estimate.session(None, device=device) as meter:
        q, k, v = (torch.empty(2, 4, 64, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        grad = torch.empty(2, 4, 64, 64, dtype=torch.bfloat16)
        before = meter.current()
        forward = len(events)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        kept = meter.current() - before
        backward = len(events)
        out.backward(grad)
        del out
        left = meter.current() - before
        end = len(events)
    return requested(events[forward:backward]), requested(events[backward:end]), kept, left


OUT, LSE = 2 * 4 * 64 * 64 * 2, 2 * 4 * 64 * 4  # bf16 output (2 x 4 heads x 64 x 64), fp32 softmax statistics


def test_a_cudnn_call_makes_its_seed_offset_and_workspaces_where_cuda_does(allocator_events):
    forward, backward, kept, left = _allocations(card("h200"), allocator_events)
    # seed and offset, then the output and statistics, then the 256 B workspace dropped at once
    assert forward == [8, 8, OUT, LSE, 256]
    assert kept == 512 + 512 + OUT + LSE  # the seed and offset kept for backward, in 512 B blocks
    workspace = 4 * 2 * 4 * 64 * 64 + 4 * 2 * 4 * 64 + 256  # dQ in fp32, one fp32 a query row, 256 B
    # dQ, dK, dV, the workspace, then the leaves' gradients (AccumulateGrad's copies under the tracker)
    assert backward == [OUT, OUT, OUT, workspace, OUT, OUT, OUT]
    # after backward the seed and offset are gone with the node's saved tensors; the gradients of q, k, v stay
    assert left == 3 * OUT


def test_a_flash_call_makes_its_backward_accumulators_after_the_gradients(allocator_events):
    forward, backward, kept, left = _allocations(card("rtx3090"), allocator_events)  # flash first there
    assert forward == [OUT, LSE] and kept == OUT + LSE  # nothing of its own in the forward
    softmax_d = 4 * 2 * 4 * 128  # fp32 (batch, heads, 64 rounded up to 128)
    dq_accum = 4 * 2 * 128 * 4 * 64  # fp32 (batch, 128, heads, 64 rounded up to 32: 64)
    assert backward == [OUT, OUT, OUT, softmax_d, dq_accum, OUT, OUT, OUT]
    assert left == 3 * OUT
    assert _allocations(None, allocator_events)[:2] == (forward, backward)  # no card: an sm80+ card's rules, flash first


def test_flash_with_grouped_kv_heads_also_expands_dk_and_dv_to_every_query_head():
    query = torch.empty(2, 8, 100, 80, dtype=torch.bfloat16)
    key = torch.empty(2, 2, 100, 80, dtype=torch.bfloat16)
    softmax_d, dq_accum, expanded = attention_scratch.flash_backward_scratch(query, key)
    assert softmax_d == 4 * 2 * 8 * 128  # 100 rounded up to 128
    assert dq_accum == 4 * 2 * 128 * 8 * 96  # head dim 80 rounded up to 96
    assert expanded == 2 * 100 * 8 * 80 * 2  # (batch, key length, query heads, head dim) in bf16
    assert attention_scratch.flash_backward_scratch(query, query)[2] == 0
