"""The embedding backward's index and partial-sum buffers on CUDA's sorting path (vlmprobe.estimate.cuda_rules.embedding_backward),
against the allocations the H200 run recorded and hand counts of EmbeddingBackwardKernel.cu's sizes."""

import torch

from conftest import h200_requests
from vlmprobe.estimate.cuda_rules.embedding_backward import scratch
from vlmprobe.estimate.tracker import LiveBytesTracker

BACKWARD = torch.ops.aten.embedding_dense_backward.default


def _program(ids: int, features: int, vocab: int, dtype=torch.float32, scale_grad_by_freq=False):
    grad = torch.empty(ids, features, dtype=dtype)
    return scratch(BACKWARD, (grad, torch.empty(ids, dtype=torch.int64), vocab, -1, scale_grad_by_freq))


def test_nanovlm_at_batch_8_length_512_makes_the_blocks_the_h200_run_made():
    before, after = _program(8 * 512, 576, 49152)
    index = 4096 * 8  # an int64 an id
    partial_segments = 4096 // 10 + 4096  # 10 rows a thread, as many segments as ids (the vocabulary is larger)
    assert before == [(index, False), (index, False), (index, True)]
    assert after == [(index, False), (8, False), (index, True), (index, False), (index, False), (8, False),
                     (partial_segments * 8, False), (partial_segments * 576 * 4, True)]
    assert partial_segments * 576 * 4 == 10_379_520 and partial_segments * 8 == 36_040
    recorded = h200_requests(8)
    assert recorded[10_379_520] == 2 and recorded[36_040] == 2  # one of each a step


def test_up_to_3072_ids_one_kernel_makes_nothing_but_the_gradient():
    assert _program(3072, 576, 49152) == ([], [])
    assert _program(512, 576, 49152) == ([], [])  # nanoVLM at batch 1, length 512: the run made none either
    assert _program(3073, 576, 49152) != ([], [])
    assert _program(4096, 576, 49152, scale_grad_by_freq=True) == ([], [])  # its counts: not modelled


def test_a_small_vocabulary_caps_the_segments_and_16_bit_gradients_are_summed_in_fp32():
    before, after = _program(5000, 64, 100, dtype=torch.bfloat16)
    segments, partial_segments = 100, 5000 // 10 + 100
    assert after[3] == (segments * 8, False) and after[6] == (partial_segments * 8, False)
    assert after[7] == (partial_segments * 64 * 4, True)


def test_the_tracker_makes_them_around_the_gradient_and_frees_them_last_made_first(allocator_events):
    grad = torch.empty(4000, 8)
    ids = torch.zeros(4000, dtype=torch.int64)
    with LiveBytesTracker():
        weight_grad = BACKWARD(grad, ids, 50, -1, False)
    sequence = allocator_events  # "+bytes" a request, "-bytes" a free
    index, partial = 4000 * 8, 4000 // 10 + 50
    assert sequence[:13] == [
        f"+{index}", f"+{index}", f"+{index}", f"-{index}",  # sorted, original positions, 0..n-1 dropped
        f"+{50 * 8 * 4}",  # the weight's gradient (the op's output)
        f"+{index}", "+8", f"+{index}", f"-{index}", f"+{50 * 8}", f"+{50 * 8}", "+8", f"+{partial * 8}"]
    assert sequence[13:] == [f"+{partial * 8 * 4}", f"-{partial * 8 * 4}",  # the partial sums, dropped
                             f"-{partial * 8}", "-8", f"-{50 * 8}", f"-{50 * 8}", "-8", f"-{index}",  # last made first
                             f"-{index}", f"-{index}"]
    assert weight_grad.shape == (50, 8)
