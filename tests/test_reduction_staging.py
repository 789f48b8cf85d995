"""The staging buffer CUDA's reduction kernel allocates when one reduction spans several blocks
(vlmprobe.estimate.cuda_rules.reduction_staging), against the allocations a recorded H200 run made and hand counts of
Reduce.cuh's setReduceConfig."""

import pytest
import torch

from conftest import REPO, h200_requests, requested
from vlmprobe.backends.estimate import reduction_card
from vlmprobe.estimate.cuda_rules.reduction_staging import Card, iterator, staging
from vlmprobe.estimate.tracker import LiveBytesTracker
from vlmprobe.gpu import device_profile

aten = torch.ops.aten
H200 = Card(multiprocessors=132, max_threads_per_multiprocessor=2048)
RTX3090 = Card(multiprocessors=82, max_threads_per_multiprocessor=1536)


def _sum(x: torch.Tensor, dims, keepdim=False, card=H200):
    out = aten.sum.dim_IntList(x, dims, keepdim)
    return staging(aten.sum.dim_IntList, (x, dims, keepdim), {}, out, card)


TOKENS, PATCHES = 8 * 512, 8 * 196  # the LM's and the ViT's rows at batch 8, length 512
# (what is summed, its shape and dtype, the buffer and semaphores that run allocated, how many a step)
TRACED = [
    ("the LM's RMS norm weight gradients: fp32 rows summed to 576",
     (TOKENS, 576), torch.float32, 18_874_368, 20, 61),  # 30 layers x 2 norms + the final norm
    ("the ViT's qkv bias gradient", (PATCHES, 2304), torch.bfloat16, 29_491_200, 72, 12),
    ("the ViT's fc1 bias gradient", (PATCHES, 3072), torch.bfloat16, 39_321_600, 96, 12),
    ("the ViT's out and fc2 bias gradients and the patch conv's", (PATCHES, 768), torch.bfloat16, 9_830_400, 24, 25),
]


@pytest.mark.parametrize("what, shape, dtype, buffer, semaphores, per_step", TRACED, ids=[t[0] for t in TRACED])
def test_each_staging_buffer_the_h200_run_made_is_the_kernels_config_for_that_reduction(
        what, shape, dtype, buffer, semaphores, per_step):
    # By hand for the first: 576 fp32 outputs, 4 to a vector (576 and the row stride divide by 4), so blocks of
    # 32 x 4 threads (512 / 4 at most); 4096 rows split over 4 warps leave 1024 values a thread (>= 256), 5 columns
    # of blocks (144 / 32) against 132 SMs x 16 blocks: min(423, 1024 / 16 = 64) = 64 blocks an output;
    # buffer 4 B x 576 x 64 x (32 x 4), semaphores 4 B x 5
    assert _sum(torch.empty(shape, dtype=dtype), [0]) == (buffer, semaphores)
    recorded = h200_requests(8)  # what the H200 run at batch 8, length 512 asked for
    assert recorded[buffer] >= 2 * per_step and recorded[semaphores] >= 2 * per_step  # made in both steps


def test_the_rms_norm_gradient_summed_over_batch_and_length_is_the_same_reduction():
    # sum_to_size of a (8, 512, 576) product over (0, 1), keepdim: the two dims coalesce into the 4096 rows
    assert _sum(torch.empty(8, 512, 576), [0, 1], keepdim=True) == (18_874_368, 20)


def test_the_patch_convolutions_bias_gradient_is_summed_from_the_transposed_gradient_it_receives():
    # nanoVLM's patch embedding output is flatten(2).transpose(1, 2): its gradient reaches the convolution as a
    # transposed (8, 768, 14, 14) view whose rows are the 1568 patches, the same reduction as a linear's bias
    grad_output = torch.empty(8, 196, 768, dtype=torch.bfloat16).transpose(1, 2).unflatten(2, (14, 14))
    x = torch.empty(8, 3, 224, 224, dtype=torch.bfloat16)
    weight = torch.empty(768, 3, 16, 16, dtype=torch.bfloat16)
    args = (grad_output, x, weight, [768], [16, 16], [0, 0], [1, 1], False, [0, 0], 1, [False, True, True])
    out = (None, torch.empty_like(weight), torch.empty(768, dtype=torch.bfloat16))
    assert staging(aten.convolution_backward.default, args, {}, out, H200) == (9_830_400, 24)
    args_no_bias = (*args[:10], [False, True, False])
    assert staging(aten.convolution_backward.default, args_no_bias, {}, out[:2] + (None,), H200) == (0, 0)
    # the same gradient laid out as NCHW: its rows are not the patches, and one block per output is enough
    assert _sum(torch.empty(8, 768, 14, 14, dtype=torch.bfloat16), [0, 2, 3]) == (0, 0)


def test_at_batch_1_each_output_has_too_few_rows_to_split_and_the_run_made_none():
    # 512 rows over 4 warps: 128 values a thread, under the 256 that make the kernel split across blocks. The
    # recorded batch-1 run's requests beyond the estimate hold no staging buffer (tests/test_estimate_vs_cuda.py)
    assert _sum(torch.empty(512, 576), [0]) == (0, 0)
    assert _sum(torch.empty(196, 768, dtype=torch.bfloat16), [0]) == (0, 0)


def test_a_reduction_along_the_rows_spreads_its_many_outputs_over_blocks_and_stages_nothing():
    # the RMS norm's variance: mean over the last dimension, 4096 outputs
    x = torch.empty(8, 512, 576)
    out = aten.mean.dim(x, [-1], True)
    assert staging(aten.mean.dim, (x, [-1], True), {}, out, H200) == (0, 0)


def test_a_full_sum_stages_one_value_per_block():
    # 2**20 fp32 values into one output: reduced along the fastest dimension (block of 512 lanes, each warp's
    # values reduced within the block), so the buffer holds one value per block: 4 B x min(132 x 4, 2048 / 16)
    x = torch.empty(2**20)
    assert staging(aten.sum.default, (x,), {}, aten.sum.default(x), H200) == (4 * 128, 4)


def test_the_cards_multiprocessors_decide_how_far_a_wide_reduction_splits():
    # 16384 fp32 outputs: 128 columns of 32 x 4 threads; the H200 fills 132 x 16 blocks with 17 an output, an
    # RTX 3090 82 x 12 with 8 (div_up(984, 128)); under the 64 that the 1024 values a thread would allow
    x = torch.empty(4096, 16384)
    assert _sum(x, [0]) == (4 * 16384 * 17 * 128, 4 * 128)
    assert _sum(x, [0], card=RTX3090) == (4 * 16384 * 8 * 128, 4 * 128)


def test_nothing_is_staged_without_a_card_or_for_what_is_not_modelled():
    x = torch.empty(4096, 576)
    out = aten.sum.dim_IntList(x, [0])
    assert staging(aten.sum.dim_IntList, (x, [0]), {}, out, None) == (0, 0)
    assert staging(aten.amax.default, (x, [0]), {}, out, H200) == (0, 0)
    as_double = aten.sum.dim_IntList(x, [0], dtype=torch.float64)  # CUDA casts the input first: not modelled
    assert staging(aten.sum.dim_IntList, (x, [0]), {"dtype": torch.float64}, as_double, H200) == (0, 0)
    half = x.to(torch.bfloat16)  # bf16 into fp32 is one kernel on CUDA: modelled, staged in fp32 as the fp32 sum is
    assert staging(aten.sum.dim_IntList, (half, [0]), {"dtype": torch.float32},
                   aten.sum.dim_IntList(half, [0], dtype=torch.float32), H200) == (18_874_368, 20)


def test_tensor_iterator_puts_the_reduced_dimensions_first_and_merges_what_steps_as_one():
    # a (2, 3, 4) fp32 tensor summed over dims 0 and 2: the output steps 0 there; reduced dims 2 (4 B) and
    # 0 (48 B) cannot merge (4 x 4 != 48), the kept dim 1 (16 B) comes after them
    it = iterator([2, 3, 4], [0, 4, 0], [48, 16, 4])
    assert (it.shape, it.out_strides, it.in_strides) == ([4, 2, 3], [0, 0, 4], [4, 48, 16])
    # summed over dims 0 and 1 of a contiguous (2, 3, 4): they merge into 6 rows of 16 B
    it = iterator([2, 3, 4], [0, 0, 4], [48, 16, 4])
    assert (it.shape, it.out_strides, it.in_strides) == ([6, 4], [0, 4], [16, 4])
    assert (it.num_reduce_dims, it.num_outputs) == (1, 4)


def test_the_tracker_allocates_the_buffer_and_semaphores_after_the_output_and_frees_them_as_the_op_returns(
        allocator_events):
    grad = torch.empty(PATCHES, 768, dtype=torch.bfloat16)
    with LiveBytesTracker(reduction_card=H200) as t:
        bias_grad = grad.sum(0)
        # the output (1536 B), the buffer and the semaphores (24 B, a 512 B block) live at once; then the output
        assert (t.peak, t.current) == (1536 + 9_830_400 + 512, 1536)
    with LiveBytesTracker() as bare:  # no card: no staging
        grad.sum(0)
        assert bare.peak == 1536
    assert requested(allocator_events) == [1536, 9_830_400, 24, 1536]
    assert bias_grad.shape == (768,)


@pytest.mark.parametrize("key", sorted(p.stem for p in (REPO / "conf" / "device").glob("*.yaml") if p.stem != "none"))
def test_a_profiles_card_holds_the_threads_its_architecture_does(key):
    # resident threads per SM, CUDA's table by compute capability: 1024 on sm75, 1536 on sm86 / sm89 / sm120,
    # 2048 on sm70 / sm80 / sm90 / sm100
    card = device_profile.load(key)
    threads = {(7, 5): 1024, (8, 6): 1536, (8, 9): 1536, (12, 0): 1536}.get(card.compute_capability, 2048)
    assert card.max_threads_per_multiprocessor == threads
    assert reduction_card(card) == Card(card.multiprocessors, card.max_threads_per_multiprocessor)
    assert reduction_card(None) is None
